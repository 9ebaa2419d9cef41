// `moetrain op muon` and `moetrain op qk_clip` (docs/op.md) against
// tests/reference/muon_reference.py, an independent NumPy f64 transcription of
// docs/model.md#muon and #qk-clip that writes op-shaped groups (inputs.h5: the op's
// datasets and attributes; expected.h5: its outputs): one Muon step on [A, B] with
// A < B, A > B, square, [E, A, B] and the momentum variants, and QK-Clip of an MLA
// layer with and without query LoRA, to 1e-10 relative (max |ours - numpy| /
// max |numpy| per tensor). Bad input exits 2 with one line naming the file, group
// and dataset or attribute, and writes nothing. Skipped only when /usr/bin/python3
// lacks numpy or h5py. (The max_logit of op attention and op mla is checked against
// PyTorch with every other output in op_reference_test.cpp.)
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>

#include "io/hdf5.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

constexpr double kOptimOpTolerance = 1e-10;

double optim_op_relative_error(const Tensor& a, const Tensor& b) {
  const std::vector<double> va = a.to_vector(), vb = b.to_vector();
  REQUIRE(va.size() == vb.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    if (std::isnan(va[i]) != std::isnan(vb[i])) diff = INFINITY;
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / std::max(scale, 1e-300);
}

// The reference files, written once per process into the build tree; "" without numpy/h5py.
string optim_reference_dir() {
  static string dir;
  static bool done = false;
  if (done) return dir;
  done = true;
  if (testing::run_command("/usr/bin/python3 -c 'import numpy, h5py' >/dev/null 2>&1") != 0) return dir;
  const string out = string(MOETRAIN_BINARY_DIR) + "/reference/muon_op";
  fs::remove_all(out);
  testing::CommandOutput r = testing::capture_command("/usr/bin/python3 " + string(MOETRAIN_SOURCE_DIR) +
                                                      "/tests/reference/muon_reference.py " + out);
  INFO(r.output);
  REQUIRE(r.code == 0);
  dir = out;
  return dir;
}

// Lines of the output other than empty ones.
int64_t optim_op_lines(const string& s) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '\n' && i > 0 && s[i - 1] != '\n') ++n;
  return n;
}

}  // namespace

TEST_CASE("op muon: one step matches the NumPy reference on every matrix shape", "[cli][op][muon]") {
  const string dir = optim_reference_dir();
  if (dir.empty()) {
    WARN("skipped: /usr/bin/python3 cannot import numpy and h5py");
    return;
  }
  hdf5::Reader in(dir + "/inputs.h5"), want(dir + "/expected.h5");
  int64_t ran = 0;
  bool wide = false, tall = false, square = false, experts = false;
  for (const string& c : in.groups("/")) {
    if (c.rfind("muon_", 0) != 0) continue;
    INFO("case " << c);
    const string out = dir + "/out_" + c + ".h5";
    testing::CommandOutput r =
        testing::run_moetrain("op muon --in " + dir + "/inputs.h5 --group " + c + " --out " + out);
    INFO(r.output);
    REQUIRE(r.code == 0);
    // muon_two_steps: the op takes one step; the file's grad_2 is the second's gradient (not read).
    const bool two = c == "muon_two_steps";
    if (!two) CHECK(r.output.find("not used") == string::npos);
    hdf5::Reader ours(out);
    CHECK(ours.datasets(c) == std::vector<string>{"momentum", "param"});
    for (const string& name : {string("param"), string("momentum")}) {
      const Tensor got = ours.read(c, name), expected = want.read(c, two ? name + "_1" : name);
      REQUIRE(got.shape() == expected.shape());
      const double e = optim_op_relative_error(got, expected);
      INFO(name << ": max rel error " << e);
      CHECK(e < kOptimOpTolerance);
    }
    const Shape shape = in.shape(c, "param");
    const int64_t A = shape[shape.ndim() - 2], B = shape[shape.ndim() - 1];
    experts |= shape.ndim() == 3;
    wide |= shape.ndim() == 2 && A < B;
    tall |= shape.ndim() == 2 && A > B;
    square |= shape.ndim() == 2 && A == B;
    ++ran;
  }
  CHECK(ran >= 10);
  CHECK((wide && tall && square && experts));
}

TEST_CASE("op qk_clip: MLA weights match the NumPy reference, with and without query LoRA", "[cli][op][qk_clip]") {
  const string dir = optim_reference_dir();
  if (dir.empty()) {
    WARN("skipped: /usr/bin/python3 cannot import numpy and h5py");
    return;
  }
  hdf5::Reader in(dir + "/inputs.h5"), want(dir + "/expected.h5");
  for (const string& c : {string("qk_clip_mla"), string("qk_clip_mla_no_lora")}) {
    INFO("case " << c);
    const string out = dir + "/out_" + c + ".h5";
    testing::CommandOutput r =
        testing::run_moetrain("op qk_clip --in " + dir + "/inputs.h5 --group " + c + " --out " + out);
    INFO(r.output);
    REQUIRE(r.code == 0);
    CHECK(r.output.find("not used") == string::npos);
    hdf5::Reader ours(out);
    CHECK(ours.datasets(c + "/params") == want.datasets(c + "/params"));
    for (const string& name : want.datasets(c + "/params")) {
      const Tensor got = ours.read(c + "/params", name), expected = want.read(c + "/params", name);
      REQUIRE(got.shape() == expected.shape());
      const double e = optim_op_relative_error(got, expected);
      INFO(name << ": max rel error " << e);
      CHECK(e < kOptimOpTolerance);
      // Something was clipped: the output is not the input.
      CHECK(optim_op_relative_error(got, in.read(c + "/params", name)) > 1e-3);
    }
    CHECK(optim_op_relative_error(ours.read(c, "gamma"), want.read(c, "gamma")) < kOptimOpTolerance);
  }
}

TEST_CASE("op muon, op qk_clip: bad input exits 2 naming the file, group and dataset or attribute",
          "[cli][op][muon][qk_clip][errors]") {
  TempDir tmp;
  const string file = tmp / "in.h5";
  {
    hdf5::Writer w(file);
    auto muon = [&](const string& g, const Shape& param, const Shape& grad, double lr) {
      w.write(g, "param", randn(param, DType::f64, 1));
      w.write(g, "grad", randn(grad, DType::f64, 2));
      if (lr >= -1) w.set_attribute(g, "lr", lr);
    };
    muon("muon_ok", {4, 6}, {4, 6}, 0.01);
    muon("muon_vector", {6}, {6}, 0.01);
    muon("muon_grad_shape", {4, 6}, {6, 4}, 0.01);
    muon("muon_no_lr", {4, 6}, {4, 6}, -2);
    muon("muon_bad_momentum", {4, 6}, {4, 6}, 0.01);
    w.set_attribute("muon_bad_momentum", "momentum", 1.5);
    w.write("muon_no_grad", "param", randn({4, 6}, DType::f64, 1));
    w.set_attribute("muon_no_grad", "lr", 0.01);
    auto clip = [&](const string& g, double tau, const Shape& max_logit) {
      w.write(g + "/params", "q_b_proj.weight", randn({2 * 6, 5}, DType::f64, 3));
      w.write(g + "/params", "kv_b_proj.weight", randn({2 * 7, 4}, DType::f64, 4));
      w.write(g, "max_logit", full(max_logit, 150.0, DType::f64));
      w.set_attribute(g, "H", int64_t{2});
      w.set_attribute(g, "qk_rope_head_dim", int64_t{2});
      w.set_attribute(g, "tau", tau);
    };
    clip("clip_ok", 100, {2});
    clip("clip_tau_zero", 0, {2});
    clip("clip_max_logit_rank", 100, {2, 1});
    clip("clip_max_logit_heads", 100, {3});
    clip("clip_dims", 100, {2});
    w.set_attribute("clip_dims", "qk_nope_head_dim", int64_t{3});  // the shapes give 6 - 2 = 4
    w.write("clip_no_kv/params", "q_b_proj.weight", randn({12, 5}, DType::f64, 3));
    w.write("clip_no_kv", "max_logit", full({2}, 1.0, DType::f64));
    w.set_attribute("clip_no_kv", "H", int64_t{2});
    w.set_attribute("clip_no_kv", "qk_rope_head_dim", int64_t{2});
    clip("clip_attention", 100, {2});
    w.set_attribute("clip_attention", "kind", string("attention"));
    w.commit();
  }
  const string out = tmp / "out.h5";
  // The good groups run (and the outputs of op muon are param and momentum).
  for (const string& ok : {string("op muon --group muon_ok"), string("op qk_clip --group clip_ok")}) {
    testing::CommandOutput r = testing::run_moetrain(ok + " --in " + file + " --out " + out);
    INFO(r.output);
    CHECK(r.code == 0);
    fs::remove(out);
  }
  struct Case {
    const char* name;
    string args;
    std::vector<string> expect;
  };
  const std::vector<Case> cases = {
      {"muon: missing grad", "op muon --group muon_no_grad", {file, "/muon_no_grad", "grad"}},
      {"muon: a vector", "op muon --group muon_vector", {file, "/muon_vector/param", "[A, B]"}},
      {"muon: grad of another shape", "op muon --group muon_grad_shape", {file, "/muon_grad_shape/grad", "[6, 4]"}},
      {"muon: no lr", "op muon --group muon_no_lr", {file, "/muon_no_lr", "attribute lr"}},
      {"muon: momentum out of range", "op muon --group muon_bad_momentum", {file, "/muon_bad_momentum", "momentum"}},
      {"qk_clip: tau 0", "op qk_clip --group clip_tau_zero", {file, "/clip_tau_zero", "tau"}},
      {"qk_clip: max_logit rank", "op qk_clip --group clip_max_logit_rank",
       {file, "/clip_max_logit_rank/max_logit", "rank 1"}},
      {"qk_clip: max_logit heads", "op qk_clip --group clip_max_logit_heads",
       {file, "/clip_max_logit_heads/max_logit", "[H]"}},
      {"qk_clip: head dims", "op qk_clip --group clip_dims", {file, "/clip_dims", "qk_nope_head_dim"}},
      {"qk_clip: no kv_b_proj", "op qk_clip --group clip_no_kv", {file, "/clip_no_kv/params/kv_b_proj.weight"}},
      {"qk_clip: not MLA", "op qk_clip --group clip_attention", {file, "/clip_attention", "kind", "attention"}},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      testing::CommandOutput r = testing::run_moetrain(c.args + " --in " + file + " --out " + out);
      INFO(r.output);
      CHECK(r.code == 2);
      CHECK(optim_op_lines(r.output) == 1);
      for (const string& e : c.expect) CHECK(r.output.find(e) != string::npos);
      CHECK(!fs::exists(out));
    }
  }
}
