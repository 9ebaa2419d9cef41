// src/io/hdf5: round trips of tensors and attributes through nested groups, the
// temp-file-then-rename writer, the messages of bad files, and interop with h5py
// (written by h5py and read here, written here and read by h5py; skipped when
// /usr/bin/python3 cannot import h5py).
#include <catch2/catch.hpp>

#include <filesystem>

#include "io/hdf5.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using moetrain::testing::error_of;
namespace fs = std::filesystem;

TEST_CASE("hdf5: tensors and attributes round-trip through nested groups", "[io][hdf5]") {
  TempDir tmp;
  const std::string path = tmp / "t.h5";
  Tensor a = randn({2, 3, 5}, DType::f64, 1), b = randn({7}, DType::f32, 2), s = from_vector({2.5}, {}, DType::f64);
  Tensor empty_rows = zeros({0, 4}, DType::f32);
  Tensor idx = from_vector({3, 0, 7, 1, 1, 2}, {3, 2}, DType::i64);
  Tensor bits = from_vector({0, 1, 0x3f80, 65535}, {2, 2}, DType::u16);  // bf16 bit patterns of an export
  {
    hdf5::Writer w(path);
    w.write("/", "a", a);
    w.write("case/params", "b", b);
    w.write("case", "s", s);
    w.write("case", "empty", empty_rows);
    w.write("case", "idx", idx);
    w.write("/", "bits", bits);
    w.set_attribute("case", "scale", 0.125);
    w.set_attribute("case", "H", int64_t{4});
    w.set_attribute("case", "gate_mode", std::string("softplus"));
    w.set_attribute("case", "H", int64_t{5});  // replaces
    CHECK(!fs::exists(path));                  // nothing at the final name before commit
    w.commit();
  }
  CHECK(fs::exists(path));
  CHECK(tmp.listing() == std::vector<std::string>{"t.h5"});  // no temp file left

  hdf5::Reader r(path);
  CHECK(moetrain::testing::bitwise_equal(r.read("", "a"), a));
  CHECK(moetrain::testing::bitwise_equal(r.read("/case/params/", "b"), b));
  CHECK(moetrain::testing::bitwise_equal(r.read("case", "s"), s));
  CHECK(r.read("case", "empty").shape() == Shape{0, 4});
  CHECK(r.read("case", "idx").dtype() == DType::i64);
  CHECK(moetrain::testing::bitwise_equal(r.read("case", "idx"), idx));
  CHECK(moetrain::testing::bitwise_equal(r.read("/", "bits"), bits));
  CHECK(r.datasets("case") == std::vector<std::string>{"empty", "idx", "s"});
  CHECK(r.groups("case") == std::vector<std::string>{"params"});
  CHECK(r.groups("/") == std::vector<std::string>{"case"});
  CHECK(r.has_group("case/params"));
  CHECK(!r.has_group("case/nothing/deeper"));
  CHECK(r.has_dataset("case", "s"));
  CHECK(!r.has_dataset("case", "params"));
  CHECK(r.attr_double("case", "scale") == 0.125);
  CHECK(r.attr_int("case", "H") == 5);
  CHECK(r.attr_double("case", "H") == 5.0);  // integers are numbers too
  CHECK(r.attr_string("case", "gate_mode") == "softplus");
  CHECK(!r.attr_double("case", "missing").has_value());
  CHECK(r.attributes("case") == std::vector<std::string>{"H", "gate_mode", "scale"});
  CHECK(error_of([&] { r.attr_double("case", "gate_mode"); }).find("gate_mode") != std::string::npos);
  CHECK(error_of([&] { r.attr_int("case", "scale"); }).find("expected an integer") != std::string::npos);
}

TEST_CASE("hdf5: errors name the file, the group or dataset and the problem", "[io][hdf5]") {
  TempDir tmp;
  const std::string path = tmp / "t.h5";
  {
    hdf5::Writer w(path);
    w.write("kda", "q", randn({2, 3}, DType::f64, 1));
    w.write("kda", "k", randn({2, 3}, DType::f64, 2));
    w.commit();
  }
  hdf5::Reader r(path);
  std::string missing = error_of([&] { r.read("kda", "beta"); });
  CHECK(missing.find(path) != std::string::npos);
  CHECK(missing.find("missing dataset beta") != std::string::npos);
  CHECK(missing.find("k, q") != std::string::npos);  // what the group holds
  std::string no_group = error_of([&] { r.read("kdx", "q"); });
  CHECK(no_group.find("no group /kdx") != std::string::npos);
  CHECK(no_group.find("kda") != std::string::npos);
  std::string rank = error_of([&] { r.read("kda", "q", 4); });
  CHECK(rank.find("/kda/q has rank 2") != std::string::npos);
  CHECK(error_of([&] { r.read("/", "kda"); }).find("is a group") != std::string::npos);

  CHECK(error_of([&] { hdf5::Reader x(tmp / "none.h5"); }).find("none.h5: no such file") != std::string::npos);
  const std::string text = tmp.write("text.h5", "not an hdf5 file at all");
  CHECK(error_of([&] { hdf5::Reader x(text); }).find("not an HDF5 file") != std::string::npos);
  std::string bytes = moetrain::testing::read_bytes(path);
  const std::string cut = tmp.write("cut.h5", bytes.substr(0, bytes.size() / 2));
  std::string truncated = error_of([&] { hdf5::Reader x(cut); });
  CHECK(truncated.find("cut.h5") != std::string::npos);

  CHECK(error_of([&] { hdf5::Writer w(tmp / "no/such/dir/x.h5"); }).find("no/such/dir/x.h5") != std::string::npos);
  hdf5::Writer w(tmp / "w.h5");
  w.write("g", "x", randn({2}, DType::f32, 1));
  CHECK(error_of([&] { w.write("g", "x", randn({2}, DType::f32, 1)); }).find("already exists") != std::string::npos);
  CHECK(error_of([&] { w.write("g", "i", arange(3, DType::i32)); }).find("f32, f64, i64 or u16") != std::string::npos);
}

TEST_CASE("hdf5: a writer dropped before commit leaves the old file untouched", "[io][hdf5]") {
  TempDir tmp;
  const std::string path = tmp / "t.h5";
  {
    hdf5::Writer w(path);
    w.write("/", "x", ones({3}, DType::f64));
    w.commit();
  }
  {
    hdf5::Writer w(path);
    w.write("/", "x", zeros({3}, DType::f64));
    w.write("/", "y", zeros({3}, DType::f64));
  }  // no commit: e.g. an exception between the writes
  CHECK(tmp.listing() == std::vector<std::string>{"t.h5"});
  hdf5::Reader r(path);
  CHECK(r.read("/", "x").to_vector() == std::vector<double>{1, 1, 1});
  CHECK(!r.has_dataset("/", "y"));
}

TEST_CASE("hdf5: files written by h5py read here, and ours read by h5py", "[io][hdf5]") {
  if (moetrain::testing::run_command("/usr/bin/python3 -c 'import h5py, numpy' >/dev/null 2>&1") != 0) {
    WARN("skipped: /usr/bin/python3 cannot import h5py (Debian python3-h5py)");
    return;
  }
  TempDir tmp;
  const std::string theirs = tmp / "theirs.h5", ours = tmp / "ours.h5";
  const std::string write_py = tmp.write("write.py", R"(import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "w") as f:
    g = f.create_group("case")
    g["x"] = np.arange(6, dtype=np.float32).reshape(2, 3)
    g["s"] = np.float64(1.5)
    g["ids"] = np.arange(4, dtype=np.int32)
    g["idx"] = np.array([[5, 0], [2, 9]], dtype=np.int64)
    g["half"] = np.zeros(3, dtype=np.float16)
    g.attrs["flag"] = True
    g.attrs["off"] = np.bool_(False)
    g.attrs["mode"] = "lowerbound"
    g.attrs["fixed"] = np.bytes_("chunked")
    g.attrs["eps"] = np.float32(0.25)
    g.attrs["H"] = 4
    g.attrs["vec"] = np.arange(3)
)");
  REQUIRE(moetrain::testing::run_command("/usr/bin/python3 " + write_py + " " + theirs) == 0);
  hdf5::Reader r(theirs);
  CHECK(r.read("case", "x").dtype() == DType::f32);
  CHECK(r.read("case", "x").to_vector() == std::vector<double>{0, 1, 2, 3, 4, 5});
  CHECK(r.read("case", "s").shape() == Shape{});
  CHECK(r.read("case", "s").item<double>() == 1.5);
  std::string ints = error_of([&] { r.read("case", "ids"); });
  CHECK(ints.find("/case/ids has dtype int32") != std::string::npos);
  CHECK(r.read("case", "idx").dtype() == DType::i64);
  CHECK(r.read("case", "idx").to_vector() == std::vector<double>{5, 0, 2, 9});
  CHECK(error_of([&] { r.read("case", "half"); }).find("dtype f16") != std::string::npos);
  CHECK(r.attr_bool("case", "flag") == true);
  CHECK(r.attr_bool("case", "off") == false);
  CHECK(r.attr_string("case", "mode") == "lowerbound");
  CHECK(r.attr_string("case", "fixed") == "chunked");
  CHECK(r.attr_double("case", "eps") == 0.25);
  CHECK(r.attr_int("case", "H") == 4);
  CHECK(error_of([&] { r.attribute("case", "vec"); }).find("holds 3 values") != std::string::npos);

  {
    hdf5::Writer w(ours);
    w.write("g/grad", "w", from_vector({1, 2, 3, 4}, {2, 2}, DType::f64));
    w.write("g", "topk_idx", from_vector({4, 1, 0, 3}, {2, 2}, DType::i64));
    w.set_attribute("g", "op", std::string("kda"));
    w.set_attribute("g", "chunk_size", int64_t{16});
    w.set_attribute("g", "eps", 1e-5);
    w.commit();
  }
  const std::string read_py = tmp.write("read.py", R"(import sys, h5py, numpy as np
with h5py.File(sys.argv[1], "r") as f:
    w = f["g/grad/w"]
    assert w.dtype == np.float64 and w.shape == (2, 2), (w.dtype, w.shape)
    assert (w[()] == np.array([[1, 2], [3, 4]])).all()
    i = f["g/topk_idx"]
    assert i.dtype == np.int64 and (i[()] == np.array([[4, 1], [0, 3]])).all(), (i.dtype, i[()])
    a = f["g"].attrs
    assert a["op"] == "kda", a["op"]
    assert a["chunk_size"] == 16 and a["eps"] == 1e-5
)");
  CHECK(moetrain::testing::run_command("/usr/bin/python3 " + read_py + " " + ours) == 0);
}
