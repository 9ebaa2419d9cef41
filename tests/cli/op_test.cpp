// `moetrain op` end to end without PyTorch: the binary on HDF5 inputs written here
// gives what the op gives in-process (bitwise), absent upstream gradients count as
// zeros, no upstream gradient at all writes outputs only, and bad input exits 2 with
// one line naming the file and the dataset or attribute; latent_moe equals the
// model's MoeLayer run in-process, weights given per expert under HF names. The
// comparison with PyTorch is tests/cli/op_reference_test.cpp.
#include <catch2/catch.hpp>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>

#include "autograd/engine.h"
#include "backend/cuda/runtime.h"
#include "io/hdf5.h"
#include "moetrain.h"
#include "nn/moe.h"
#include "ops/kda/kda.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using moetrain::testing::bitwise_equal;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = testing::CommandOutput;

Result run_cli(const string& args) { return testing::run_moetrain(args); }

// Lines of the output other than empty ones.
int64_t lines(const string& s) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '\n' && i > 0 && s[i - 1] != '\n') ++n;
  return n;
}

constexpr int64_t B = 2, T = 21, H = 2, HV = 4, K = 8, V = 5;

struct KdaInputs {
  Tensor q, k, v, g, beta, h0, d_o, d_ht;
  KdaInputs() {
    q = l2_norm(randn({B, T, H, K}, DType::f64, 1));
    k = l2_norm(randn({B, T, H, K}, DType::f64, 2));
    v = randn({B, T, HV, V}, DType::f64, 3);
    g = neg(mul(softplus(randn({B, T, HV, K}, DType::f64, 4)), rand({B, T, HV, K}, DType::f64, 5)));
    beta = sigmoid(randn({B, T, HV}, DType::f64, 6));
    h0 = randn({B, HV, K, V}, DType::f64, 7);
    d_o = randn({B, T, HV, V}, DType::f64, 8);
    d_ht = randn({B, HV, K, V}, DType::f64, 9);
  }
  // Writes the group, leaving out the datasets named in `skip`.
  void write(hdf5::Writer& w, const string& group, const std::vector<string>& skip = {}) const {
    auto put = [&](const string& name, const Tensor& t) {
      if (std::find(skip.begin(), skip.end(), name) == skip.end()) w.write(group, name, t);
    };
    put("q", q);
    put("k", k);
    put("v", v);
    put("g", g);
    put("beta", beta);
    put("h0", h0);
    put("do", d_o);
    put("dht", d_ht);
  }
};

}  // namespace

TEST_CASE("op: kda through the CLI equals the op in-process, in both modes", "[cli][op]") {
  TempDir tmp;
  KdaInputs in;
  {
    hdf5::Writer w(tmp / "in.h5");
    in.write(w, "/");
    in.write(w, "no_dht", {"dht"});
    in.write(w, "no_upstream", {"do", "dht"});
    w.commit();
  }
  for (KdaMode mode : {KdaMode::recurrent, KdaMode::chunked}) {
    DYNAMIC_SECTION(kda_mode_name(mode)) {
      Tensors leaves{in.q.clone(), in.k.clone(), in.v.clone(), in.g.clone(), in.beta.clone(), in.h0.clone()};
      for (Tensor& t : leaves) t.set_requires_grad(true);
      KdaResult r =
          kda(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], 1.0 / std::sqrt(8.0), mode, 8);
      autograd::backward({r.o, r.final_state}, {in.d_o, in.d_ht});

      const string flags = string(" --mode ") + kda_mode_name(mode) + " --chunk-size 8";
      Result res = run_cli("op kda --in " + tmp / "in.h5" + " --out " + tmp / "out.h5" + flags);
      INFO(res.output);
      REQUIRE(res.code == 0);
      hdf5::Reader out(tmp / "out.h5");
      CHECK(bitwise_equal(out.read("/", "o"), r.o.detach()));
      CHECK(bitwise_equal(out.read("/", "ht"), r.final_state.detach()));
      const char* names[] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
      for (size_t i = 0; i < leaves.size(); ++i) {
        INFO(names[i]);
        CHECK(bitwise_equal(out.read("/", names[i]), leaves[i].grad()));
      }
      CHECK(out.attr_string("/", "op") == "kda");
      CHECK(out.attr_string("/", "mode") == kda_mode_name(mode));
      CHECK(out.attr_int("/", "chunk_size") == 8);

      // dht absent = zeros: the same as writing zeros explicitly.
      {
        hdf5::Writer w(tmp / "zeros.h5");
        in.write(w, "no_dht", {"dht"});
        w.write("no_dht", "dht", zeros({B, HV, K, V}, DType::f64));
        w.commit();
      }
      REQUIRE(run_cli("op kda --group no_dht --in " + tmp / "in.h5" + " --out " + tmp / "a.h5" + flags).code == 0);
      REQUIRE(run_cli("op kda --group no_dht --in " + tmp / "zeros.h5" + " --out " + tmp / "b.h5" + flags).code == 0);
      hdf5::Reader a(tmp / "a.h5"), b(tmp / "b.h5");
      CHECK(a.datasets("no_dht") == b.datasets("no_dht"));
      for (const string& name : b.datasets("no_dht")) {
        INFO(name);
        CHECK(bitwise_equal(a.read("no_dht", name), b.read("no_dht", name)));
      }

      // No upstream gradient at all: outputs only.
      REQUIRE(run_cli("op kda --group no_upstream --in " + tmp / "in.h5" + " --out " + tmp / "c.h5" + flags).code == 0);
      hdf5::Reader c(tmp / "c.h5");
      CHECK(c.datasets("no_upstream") == std::vector<string>{"ht", "o"});
      CHECK(bitwise_equal(c.read("no_upstream", "o"), r.o.detach()));
    }
  }
}

TEST_CASE("op: bad input exits 2 with one line naming the file and the dataset or attribute", "[cli][op]") {
  TempDir tmp;
  KdaInputs in;
  const string file = tmp / "in.h5";
  {
    hdf5::Writer w(file);
    in.write(w, "ok");
    in.write(w, "no_beta", {"beta"});
    in.write(w, "bad_k", {"k"});
    w.write("bad_k", "k", randn({B, T, H, K + 1}, DType::f64, 2));
    in.write(w, "bad_do", {"do"});
    w.write("bad_do", "do", randn({B, T, HV, V + 1}, DType::f64, 2));
    in.write(w, "mixed", {"v"});
    w.write("mixed", "v", randn({B, T, HV, V}, DType::f32, 3));
    w.write("fused", "q_raw", in.q);
    w.write("fused", "k_raw", in.k);
    w.write("fused", "v", in.v);
    w.write("fused", "f_raw", in.g);
    w.write("fused", "beta_raw", in.beta);
    w.write("fused", "A_log", zeros({HV}, DType::f64));
    w.write("fused", "dt_bias", zeros({HV * K}, DType::f64));
    w.set_attribute("fused", "gate_mode", string("softpluss"));
    w.write("gpt2", "x", randn({B, T, 16}, DType::f64, 1));
    w.commit();
  }
  const string out = tmp / "out.h5";
  struct Case {
    const char* name;
    string args;
    std::vector<string> expect;  // substrings of the message
  };
  const std::vector<Case> cases = {
      {"missing dataset", "op kda --group no_beta", {file, "/no_beta", "missing dataset beta"}},
      {"wrong shape", "op kda --group bad_k", {file, "/bad_k", "k is [2, 21, 2, 9]"}},
      {"upstream gradient of the wrong shape", "op kda --group bad_do", {file, "/bad_do/do", "[2, 21, 4, 6]"}},
      {"mixed dtypes", "op kda --group mixed", {file, "/mixed/v", "f32", "one dtype"}},
      {"unknown op", "op kdb --group ok", {file, "unknown op 'kdb'", "kda, kda_fused"}},
      {"unknown gate_mode", "op kda_fused --group fused", {file, "/fused", "gate_mode", "softpluss"}},
      {"missing group", "op kda --group nothing", {file, "no group /nothing"}},
      {"missing attribute", "op gpt2_block --group gpt2", {file, "/gpt2", "attribute H"}},
      {"unknown mode", "op kda --group ok --mode fast", {"unknown mode 'fast'"}},
      {"missing input file", "op kda --in " + tmp / "nope.h5", {"nope.h5", "no such file"}},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      string args = c.args.find("--in ") == string::npos ? c.args + " --in " + file : c.args;
      Result r = run_cli(args + " --out " + out);
      INFO(r.output);
      CHECK(r.code == 2);
      CHECK(lines(r.output) == 1);
      for (const string& e : c.expect) CHECK(r.output.find(e) != string::npos);
      CHECK(!fs::exists(out));
    }
  }
  if (!cuda::built_with_cuda()) {
    Result r = run_cli("op kda --group ok --device cuda --in " + file + " --out " + out);
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("no CUDA backend") != string::npos);
  }
}

TEST_CASE("op: unused datasets and attributes are reported, not fatal", "[cli][op]") {
  TempDir tmp;
  KdaInputs in;
  {
    hdf5::Writer w(tmp / "in.h5");
    in.write(w, "/", {"h0"});
    w.write("/", "h_0", in.h0);  // a typo: warned about, and h0 counts as absent
    w.set_attribute("/", "gate_mod", string("softplus"));
    w.commit();
  }
  Result r = run_cli("op kda --in " + tmp / "in.h5" + " --out " + tmp / "out.h5");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(r.output.find("/h_0 was not used") != string::npos);
  CHECK(r.output.find("attribute gate_mod") != string::npos);
  hdf5::Reader out(tmp / "out.h5");
  CHECK(!out.has_dataset("/", "dh0"));
}

TEST_CASE("op: latent_moe equals the model's MoeLayer in-process, per-expert weights in and gradients out",
          "[cli][op][moe]") {
  TempDir tmp;
  const int64_t D = 12, L = 6, F = 5, E = 5, k = 2, N = 9;
  MoeConfig c;
  c.num_experts = E;
  c.top_k = k;
  c.num_shared_experts = 2;
  c.expert_d_ff = F;
  c.latent_dim = L;
  c.routed_scaling_factor = 1.7;
  FfnConfig ffn;
  ffn.kind = FfnKind::situ_glu;
  ffn.situ_beta = 3.0;
  ffn.situ_linear_beta = 6.0;
  ParamFactory factory(true, DType::f64, 11);
  MoeLayer layer(c, D, ffn, 0.3, factory, "");
  layer.router.bias = mul_scalar(randn({E}, DType::f32, 5), 0.2);  // a buffer: f32 in the model
  Tensor x = randn({N, D}, DType::f64, 6), dy = randn({N, D}, DType::f64, 7);

  auto expert_slice = [&](const Tensor& stacked, int64_t j) {
    return reshape(slice(stacked, 0, j, j + 1), {stacked.size(1), stacked.size(2)}).contiguous();
  };
  // Writes the layer's weights under HF names (experts one by one), leaving out `skip`.
  auto write_group = [&](hdf5::Writer& w, const string& g, const std::vector<string>& skip) {
    auto put = [&](const string& name, const Tensor& t) {  // name: "x" or "params/NAME"
      if (std::find(skip.begin(), skip.end(), name) != skip.end()) return;
      const size_t slash = name.find('/');
      if (slash == string::npos) w.write(g, name, t);
      else w.write(g + "/" + name.substr(0, slash), name.substr(slash + 1), t);
    };
    put("x", x);
    put("dy", dy);
    for (const NamedParameter& p : factory.params()) {
      const string stacked = "experts.";
      if (p.name.rfind(stacked, 0) == 0) {  // experts.w1.weight -> experts.{j}.w1.weight
        for (int64_t j = 0; j < E; ++j)
          put("params/experts." + std::to_string(j) + "." + p.name.substr(stacked.size()),
              expert_slice(p.tensor.detach(), j));
      } else {
        put("params/" + p.name, p.tensor.detach());
      }
    }
    put("params/gate.e_score_correction_bias", layer.router.bias.to(DType::f64));
    w.set_attribute(g, "num_experts", E);
    if (std::find(skip.begin(), skip.end(), "top_k") == skip.end()) w.set_attribute(g, "top_k", k);
    w.set_attribute(g, "num_shared_experts", int64_t{2});
    w.set_attribute(g, "routed_scaling_factor", 1.7);
    w.set_attribute(g, "beta", 3.0);
    w.set_attribute(g, "linear_beta", 6.0);
  };
  const string file = tmp / "in.h5";
  {
    hdf5::Writer w(file);
    write_group(w, "moe", {});
    w.write("moe", "dtopk_weight", randn({N, k}, DType::f64, 8));  // not an upstream gradient: warned about
    write_group(w, "no_top_k", {"top_k"});
    write_group(w, "partial_latent", {"params/routed_expert_norm.weight"});
    write_group(w, "missing_expert", {"params/experts.4.w2.weight"});
    w.commit();
  }

  Tensor xl = x.clone();
  xl.set_requires_grad(true);
  Routing routing;
  Tensor y = layer.forward(reshape(xl, {1, N, D}), /*training=*/false, &routing);
  autograd::backward({y}, {reshape(dy, {1, N, D})});

  Result res = run_cli("op latent_moe --group moe --in " + file + " --out " + tmp / "out.h5");
  INFO(res.output);
  REQUIRE(res.code == 0);
  CHECK(res.output.find("/moe/dtopk_weight was not used") != string::npos);
  hdf5::Reader out(tmp / "out.h5");
  CHECK(out.datasets("moe") == std::vector<string>{"dx", "topk_idx", "topk_weight", "y"});
  CHECK(bitwise_equal(out.read("moe", "y"), reshape(y, {N, D}).detach()));
  CHECK(bitwise_equal(out.read("moe", "dx"), xl.grad()));
  Tensor idx = out.read("moe", "topk_idx");
  CHECK(idx.dtype() == DType::i64);
  CHECK(idx.shape() == Shape{N, k});
  CHECK(idx.to_vector() == std::vector<double>(routing.experts.begin(), routing.experts.end()));
  CHECK(bitwise_equal(out.read("moe", "topk_weight"), routing.weights.detach()));
  // Every weight gets its gradient under its HF name; the bias (a buffer) none.
  std::vector<string> want;
  for (const NamedParameter& p : factory.params()) {
    const string stacked = "experts.";
    if (p.name.rfind(stacked, 0) == 0) {
      for (int64_t j = 0; j < E; ++j) {
        const string name = "experts." + std::to_string(j) + "." + p.name.substr(stacked.size());
        INFO(name);
        want.push_back(name);
        CHECK(bitwise_equal(out.read("moe/grad", name), expert_slice(p.tensor.grad(), j)));
      }
    } else {
      INFO(p.name);
      want.push_back(p.name);
      CHECK(bitwise_equal(out.read("moe/grad", p.name), p.tensor.grad()));
    }
  }
  std::sort(want.begin(), want.end());
  CHECK(out.datasets("moe/grad") == want);
  CHECK(want.size() == static_cast<size_t>(3 * E + 7));  // gate, 3 latent, 3 shared

  struct Bad {
    const char* group;
    std::vector<string> expect;
  };
  for (const Bad& b : {Bad{"no_top_k", {"/no_top_k", "attribute top_k"}},
                       Bad{"partial_latent", {"/partial_latent/params", "routed_expert_norm.weight", "all three"}},
                       Bad{"missing_expert", {"/missing_expert/params", "missing dataset experts.4.w2.weight"}}}) {
    Result r = run_cli(string("op latent_moe --group ") + b.group + " --in " + file + " --out " + tmp / "bad.h5");
    INFO(b.group << ": " << r.output);
    CHECK(r.code == 2);
    CHECK(lines(r.output) == 1);
    CHECK(r.output.find(file) != string::npos);
    for (const string& e : b.expect) CHECK(r.output.find(e) != string::npos);
    CHECK(!fs::exists(tmp / "bad.h5"));
  }
}
