// PyTorch parity of `moetrain op`: tests/reference/k3_reference.py (an independent
// plain-PyTorch transcription of docs/model.md) writes random f64 inputs and upstream
// gradients to inputs.h5 and the outputs and autograd gradients to expected.h5, one
// group per case; the binary runs each case (the KDA ops in both modes, chunked with
// C = 16 on T = 37, which leaves a tail of 5) and every output and gradient must
// match to 1e-10 relative (max |ours - torch| / max |torch| per tensor); integer
// outputs (latent_moe's topk_idx) must be equal. The same inputs rounded to f32 then
// run the f32 path, which must match the f64 reference to 2e-5 (the MoE cases keep a
// margin between biased scores so f32 selects the same experts). Skipped only when
// /usr/bin/python3 cannot import torch and h5py (launch/setup.sh installs them).
#include <catch2/catch.hpp>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "io/hdf5.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using std::string;

namespace {

constexpr double kTolerance = 1e-10;
// f32 inputs (rounded from the f64 ones) computed in f32, against the f64 reference.
constexpr double kTolerance32 = 2e-5;  // measured <= 2.2e-6

int run_quiet(const string& cmd, string* output = nullptr) {
  testing::CommandOutput r = testing::capture_command(cmd);
  if (output) *output = r.output;
  return r.code;
}

double relative_error(const Tensor& a, const Tensor& b) {
  std::vector<double> va = a.to_vector(), vb = b.to_vector();
  REQUIRE(va.size() == vb.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    diff = std::max(diff, std::abs(va[i] - vb[i]));
    scale = std::max(scale, std::abs(vb[i]));
  }
  return diff / std::max(scale, 1e-300);
}

std::vector<string> split_commas(const string& s) {
  std::vector<string> out;
  std::stringstream in(s);
  string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// Copies group `g` of `in` (datasets converted to f32, attributes, subgroups) into `out`.
void copy_as_f32(const hdf5::Reader& in, hdf5::Writer& out, const string& g) {
  out.create_group(g);
  for (const string& name : in.datasets(g)) out.write(g, name, in.read(g, name).to(DType::f32));
  for (const string& name : in.attributes(g)) out.set_attribute(g, name, *in.attribute(g, name));
  for (const string& sub : in.groups(g)) copy_as_f32(in, out, g + "/" + sub);
}

// Runs every case of dir/expected.h5 on `inputs` and checks each output and gradient
// against expected.h5 to `tolerance`; prints the worst error per case and mode.
void check_cases(const string& dir, const string& inputs, const string& tag, double tolerance) {
  hdf5::Reader expected(dir + "/expected.h5");
  const std::vector<string> cases = expected.groups("/");
  REQUIRE(cases.size() >= 19);  // 15 before latent_moe (4 cases)
  for (const string& c : cases) {
    const string op = *expected.attr_string(c, "op");
    std::vector<string> modes = split_commas(*expected.attr_string(c, "modes"));
    if (modes.empty()) modes.push_back("");
    for (const string& mode : modes) {
      // No SECTIONs: each would rerun the Python script.
      INFO("case " << c << (mode.empty() ? "" : " " + mode) << " (" << tag << ")");
      const string out_path = dir + "/out_" + tag + "_" + c + (mode.empty() ? "" : "_" + mode) + ".h5";
      string args = "op " + op + " --in " + inputs + " --group " + c + " --out " + out_path;
      if (!mode.empty())
        args += " --mode " + mode + " --chunk-size " + std::to_string(*expected.attr_int(c, "chunk_size"));
      testing::CommandOutput run = testing::run_moetrain(args);
      const string& output = run.output;
      const int code = run.code;
      INFO(output);
      CHECK(code == 0);
      if (code != 0) continue;
      CHECK(output.find("not used") == string::npos);  // every dataset and attribute was used

      hdf5::Reader ours(out_path);
      CHECK(ours.attr_string(c, "dtype") == tag);
      double worst = 0;
      string worst_name;
      for (const string& sub : {string(""), string("/grad")}) {
        const string g = c + sub;
        if (!expected.has_group(g)) continue;
        CHECK(ours.datasets(g) == expected.datasets(g));  // nothing missing, nothing extra
        for (const string& name : expected.datasets(g)) {
          Tensor want = expected.read(g, name);
          if (!ours.has_dataset(g, name)) continue;
          Tensor got = ours.read(g, name);
          INFO(g << "/" << name << ": ours " << got.shape().str() << ", torch " << want.shape().str());
          CHECK(got.shape() == want.shape());
          if (got.shape() != want.shape()) continue;
          if (want.dtype() == DType::i64) {  // indices: exactly
            CHECK(got.dtype() == DType::i64);
            CHECK(got.to_vector() == want.to_vector());
            continue;
          }
          double e = relative_error(got, want);
          CHECK(e < tolerance);
          if (e >= worst) {
            worst = e;
            worst_name = (sub.empty() ? "" : "grad/") + name;
          }
        }
      }
      std::printf("op reference %s: %-28s %-10s max rel error %.2e (%s)\n", tag.c_str(), c.c_str(),
                  mode.empty() ? "-" : mode.c_str(), worst, worst_name.c_str());
    }
  }
}

}  // namespace

TEST_CASE("op: every op and layer matches the PyTorch transcription of docs/model.md", "[cli][op][reference]") {
  if (run_quiet("/usr/bin/python3 -c 'import torch, h5py'") != 0) {
    WARN("skipped: /usr/bin/python3 cannot import torch and h5py (Debian python3-torch, python3-h5py)");
    return;
  }
  const string dir = string(MOETRAIN_BINARY_DIR) + "/reference/k3";
  std::filesystem::remove_all(dir);
  string log;
  int rc =
      run_quiet("/usr/bin/python3 " + string(MOETRAIN_SOURCE_DIR) + "/tests/reference/k3_reference.py " + dir, &log);
  INFO(log);
  REQUIRE(rc == 0);

  check_cases(dir, dir + "/inputs.h5", "f64", kTolerance);

  // The f32 path on the same inputs rounded to f32, against the f64 reference.
  {
    hdf5::Reader in(dir + "/inputs.h5");
    hdf5::Writer out(dir + "/inputs_f32.h5");
    for (const string& c : in.groups("/")) copy_as_f32(in, out, c);
    out.commit();
  }
  check_cases(dir, dir + "/inputs_f32.h5", "f32", kTolerance32);
}
