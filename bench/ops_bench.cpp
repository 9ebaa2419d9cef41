// Core-op benchmarks, as ratios to same-run baselines:
//   matmul (GPT-2-small shapes)      vs raw cblas_sgemm on the same buffers
//   elementwise / norm / softmax     vs memcpy of the same bytes (GB/s)
//   fused KDA gates (fwd + bwd)      vs the unfused ops they replace
//   GPT-2's MLP as mlp_gelu (fwd + bwd) vs linear, gelu_tanh, linear as three ops
//   AdamW::non_finite_update         vs AdamW::step on GPT-2 small's 124M parameters
//   index_add_plan (the CUDA embedding/gather backward's host plan) vs memcpy (GB/s)
// Run: build/moetrain_bench_ops [--benchmark_filter=...]; the ratio table is printed last.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/moe.h"
#include "ops/view/view_simt.h"
#include "optim/adamw.h"
#include "optim/make_optimizer.h"
#include "config/config.h"
#include "train/model_source.h"

using namespace moetrain;

namespace {

// [M, K] x [K, N] shapes of a GPT-2-small step at B*T = 256 rows.
const std::vector<std::vector<int64_t>> kGemmShapes = {
    {256, 768, 2304},   // attn.c_attn
    {256, 768, 3072},   // mlp.c_fc
    {256, 3072, 768},   // mlp.c_proj
    {256, 768, 50304},  // lm head (padded vocab)
};

void set_gemm_counters(benchmark::State& st, int64_t m, int64_t k, int64_t n) {
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * m * k * n, benchmark::Counter::kIsIterationInvariantRate,
                                              benchmark::Counter::kIs1000);
}

void BM_sgemm_openblas(benchmark::State& st) {
  int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor a = randn({m, k}, DType::f32, 1), b = randn({k, n}, DType::f32, 2), c = empty({m, n});
  for (auto _ : st) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, 1.f, a.data<float>(), k, b.data<float>(), n,
                0.f, c.data<float>(), n);
    benchmark::ClobberMemory();
  }
  set_gemm_counters(st, m, k, n);
}

void BM_matmul(benchmark::State& st) {
  int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor a = randn({m, k}, DType::f32, 1), b = randn({k, n}, DType::f32, 2);
  for (auto _ : st) benchmark::DoNotOptimize(matmul(a, b).raw_data());
  set_gemm_counters(st, m, k, n);
}

// linear() = x W^T as in a model: weight [out, in].
void BM_linear(benchmark::State& st) {
  int64_t m = st.range(0), k = st.range(1), n = st.range(2);
  Tensor x = randn({m, k}, DType::f32, 1), w = randn({n, k}, DType::f32, 2);
  for (auto _ : st) benchmark::DoNotOptimize(linear(x, w).raw_data());
  set_gemm_counters(st, m, k, n);
}

constexpr int64_t kRows = 1024, kCols = 768;  // B*T = 1024 tokens of GPT-2-small width

void set_bytes(benchmark::State& st, int64_t bytes) {
  st.counters["GB/s"] = benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate,
                                           benchmark::Counter::kIs1000);
}

void BM_memcpy(benchmark::State& st) {  // read + write of kRows*kCols floats
  Tensor a = randn({kRows, kCols}, DType::f32, 1), b = empty({kRows, kCols});
  for (auto _ : st) {
    std::memcpy(b.raw_data(), a.raw_data(), a.nbytes());
    benchmark::ClobberMemory();
  }
  set_bytes(st, 2 * a.nbytes());
}

template <class F>
void bandwidth(benchmark::State& st, int64_t tensors_touched, F&& op) {
  for (auto _ : st) benchmark::DoNotOptimize(op().raw_data());
  set_bytes(st, tensors_touched * kRows * kCols * 4);
}

void BM_add(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1), b = randn({kRows, kCols}, DType::f32, 2);
  bandwidth(st, 3, [&] { return add(a, b); });
}
void BM_add_bias(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1), b = randn({kCols}, DType::f32, 2);
  bandwidth(st, 2, [&] { return add(a, b); });
}
void BM_gelu_tanh(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1);
  bandwidth(st, 2, [&] { return gelu_tanh(a); });
}
void BM_layer_norm(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1), w = randn({kCols}, DType::f32, 2), b = randn({kCols}, DType::f32, 3);
  bandwidth(st, 2, [&] { return layer_norm(a, w, b); });
}
void BM_rms_norm(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1), w = randn({kCols}, DType::f32, 2);
  bandwidth(st, 2, [&] { return rms_norm(a, w); });
}
void BM_softmax(benchmark::State& st) {
  Tensor a = randn({kRows, kCols}, DType::f32, 1);
  bandwidth(st, 2, [&] { return softmax(a); });
}

// Forward + backward of op over leaves that require grad; the rate counts the
// [kRows, kCols] input once, so a fused op and its unfused twin compare as times.
template <class F>
void forward_backward(benchmark::State& st, const Tensors& leaves, F&& op) {
  for (auto _ : st) {
    sum(op()).backward();
    for (Tensor t : leaves) t.zero_grad();
  }
  set_bytes(st, kRows * kCols * 4);
}
Tensor leaf(Shape s, uint64_t seed, double scale = 1.0) {
  return mul_scalar(randn(s, DType::f32, seed), scale).detach().set_requires_grad();
}
// KDA's decay gate on [tokens, heads, K] = [1024, 6, 128] (K3's lower-bound form).
constexpr int64_t kHeads = 6, kHeadDim = kCols / kHeads;
void BM_fused_decay_gate(benchmark::State& st) {
  Tensor f = leaf({kRows, kHeads, kHeadDim}, 1), A = leaf({kHeads}, 2, 0.5), b = leaf({kHeads * kHeadDim}, 3);
  forward_backward(st, {f, A, b}, [&] { return decay_gate(f, A, b, -5.0); });
}
void BM_unfused_decay_gate(benchmark::State& st) {
  Tensor f = leaf({kRows, kHeads, kHeadDim}, 1), A = leaf({kHeads}, 2, 0.5), b = leaf({kHeads * kHeadDim}, 3);
  forward_backward(st, {f, A, b}, [&] {
    return mul_scalar(sigmoid(mul(exp(reshape(A, {kHeads, 1})), add(f, reshape(b, {kHeads, kHeadDim})))), -5.0);
  });
}
// GPT-2's residual add and LayerNorm, h = x + d and LN(h), both used after (here
// by one add, the same in both rows): the fused op against add then layer_norm.
void BM_fused_add_layer_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kCols}, 1), d = leaf({kRows, kCols}, 2), w = leaf({kCols}, 3), b = leaf({kCols}, 4);
  forward_backward(st, {x, d, w, b}, [&] {
    ResidualNorm r = add_layer_norm(x, d, w, b);
    return add(r.sum, r.normed);
  });
}
void BM_unfused_add_layer_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kCols}, 1), d = leaf({kRows, kCols}, 2), w = leaf({kCols}, 3), b = leaf({kCols}, 4);
  forward_backward(st, {x, d, w, b}, [&] {
    Tensor h = add(x, d);
    return add(h, layer_norm(h, w, b));
  });
}
// KDA's output: RMSNorm(o) ⊙ σ(z) per head.
void BM_fused_gated_rms_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kHeads, kHeadDim}, 1), z = leaf({kRows, kHeads, kHeadDim}, 2), w = leaf({kHeadDim}, 3);
  forward_backward(st, {x, z, w}, [&] { return gated_rms_norm(x, w, z); });
}
void BM_unfused_gated_rms_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kHeads, kHeadDim}, 1), z = leaf({kRows, kHeads, kHeadDim}, 2), w = leaf({kHeadDim}, 3);
  forward_backward(st, {x, z, w}, [&] { return mul(rms_norm(x, w), sigmoid(z)); });
}

// GPT-2 small's MLP on 1024 tokens, 768 -> 3072 -> 768: mlp_gelu against the
// matmul + add + gelu_tanh + matmul + add it replaces (the same bits on the CPU;
// the difference is the passes over the [1024, 3072] hidden and the bias sums).
void BM_fused_mlp_gelu(benchmark::State& st) {
  Tensor x = leaf({kRows, kCols}, 1), wf = leaf({4 * kCols, kCols}, 2, 0.02), bf = leaf({4 * kCols}, 3),
         wp = leaf({kCols, 4 * kCols}, 4, 0.02), bp = leaf({kCols}, 5);
  forward_backward(st, {x, wf, bf, wp, bp}, [&] { return mlp_gelu(x, wf, bf, wp, bp); });
}
void BM_unfused_mlp_gelu(benchmark::State& st) {
  Tensor x = leaf({kRows, kCols}, 1), wf = leaf({4 * kCols, kCols}, 2, 0.02), bf = leaf({4 * kCols}, 3),
         wp = leaf({kCols, 4 * kCols}, 4, 0.02), bp = leaf({kCols}, 5);
  forward_backward(st, {x, wf, bf, wp, bp}, [&] {
    return add(matmul(gelu_tanh(add(matmul(x, wf, false, true), bf)), wp, false, true), bp);
  });
}

// The router's top-16 of 896 experts for 8192 tokens on the CPU (K3's router):
// what a CUDA step paid on the host per MoE layer before the selection moved to
// the GPU (moetrain_bench_cuda times both there).
void BM_select_experts(benchmark::State& st) {
  Tensor scores = sigmoid(randn({8192, 896}, DType::f32, 3)), bias = zeros({896}, DType::f32);
  for (auto _ : st) benchmark::DoNotOptimize(select_experts(scores, bias, 16));
}

// AdamW over GPT-2 small's parameters (124M; f32, or bf16 with f32 masters,
// arg 1), gradients N(0, 0.01): a step, the check before a step
// (non_finite_update: a read-only pass over parameters, gradients and moments)
// and both. Bytes per element: the f32 step reads w, g, m, v and writes w, m, v
// (28), the check only reads (16); with bf16 masters the gradient is bf16 and the
// step also writes the bf16 parameter (28 again), the check reads 14. One model
// at a time (2 GB of state), kept across the cases of its dtype.
struct AdamWCase {
  bool mixed = false;
  std::unique_ptr<Gpt2> model;
  std::unique_ptr<AdamW> opt;
};
AdamW& adamw_case(bool mixed) {
  static AdamWCase c;
  if (c.opt && c.mixed == mixed) return *c.opt;
  c.opt.reset();
  c.model.reset();
  c.mixed = mixed;
  c.model = std::make_unique<Gpt2>(Gpt2Config{}, 1);
  c.opt = std::make_unique<AdamW>(c.model->parameters(), AdamWOptions{});
  if (mixed) c.opt->convert_to_bf16([](const NamedParameter&) { return true; });
  uint64_t seed = 100;
  for (const NamedParameter& p : c.model->parameters())
    p.tensor.set_grad(mul_scalar(randn(p.tensor.shape(), DType::f32, seed++), 0.01).to(p.tensor.dtype()));
  c.opt->step(1e-4);  // moments no longer zero
  return *c.opt;
}
constexpr double kAdamWLr = 1e-4;
void BM_adamw_step(benchmark::State& st) {
  AdamW& opt = adamw_case(st.range(0) == 1);
  for (auto _ : st) opt.step(kAdamWLr);
}
void BM_adamw_check(benchmark::State& st) {
  AdamW& opt = adamw_case(st.range(0) == 1);
  for (auto _ : st) benchmark::DoNotOptimize(opt.non_finite_update(kAdamWLr));
}
// Also times its two halves, so that check / step comes from the same
// iterations (steadier than two cases when other work shares the cores).
void BM_adamw_check_then_step(benchmark::State& st) {
  using Clock = std::chrono::steady_clock;
  AdamW& opt = adamw_case(st.range(0) == 1);
  double check_s = 0, step_s = 0;
  for (auto _ : st) {
    const auto t0 = Clock::now();
    const bool finite = !opt.non_finite_update(kAdamWLr);
    const auto t1 = Clock::now();
    if (finite) opt.step(kAdamWLr);
    check_s += std::chrono::duration<double>(t1 - t0).count();
    step_s += std::chrono::duration<double>(Clock::now() - t1).count();
  }
  st.counters["check/step"] = check_s / step_s;
}
// One optimizer step (train.optimizer adamw or muon, f32, one process, zero 0) over
// a whole model's parameters: GPT-2 small (124M, configs/gpt2-small.yaml) and
// k3-small (configs/k3-small.yaml), gradients N(0, 0.01). Arg 0: the model (0
// GPT-2, 1 k3-small); arg 1: 0 AdamW, 1 Muon (Muon on the hidden matrices, AdamW
// on the rest, as the trainer builds it). The counter muon_share is the fraction
// of the parameters Muon updates. Compare Muon's row with AdamW's of the same
// model in the same run.
struct OptimizerCase {
  int64_t model = -1, kind = -1;
  std::unique_ptr<LanguageModel> net;
  std::unique_ptr<Optimizer> opt;
  double muon_share = 0;
};
Optimizer& optimizer_case(int64_t model, int64_t kind, double& muon_share) {
  static OptimizerCase c;
  if (!c.opt || c.model != model || c.kind != kind) {
    c.opt.reset();
    c.net.reset();
    c.model = model;
    c.kind = kind;
    const Config config = Config::load(std::string(MOETRAIN_SOURCE_DIR) +
                                       (model == 0 ? "/configs/gpt2-small.yaml" : "/configs/k3-small.yaml"));
    c.net = build_model(config);
    OptimizerOptions o;
    o.kind = kind == 0 ? "adamw" : "muon";
    c.opt = make_optimizer(c.net->parameters(), o);
    uint64_t seed = 100;
    int64_t muon = 0, total = 0;
    for (const NamedParameter& p : c.net->parameters()) {
      p.tensor.set_grad(mul_scalar(randn(p.tensor.shape(), DType::f32, seed++), 0.01).to(p.tensor.dtype()));
      muon += uses_muon(o, p) ? p.tensor.numel() : 0;
      total += p.tensor.numel();
    }
    c.muon_share = static_cast<double>(muon) / static_cast<double>(total);
    c.opt->step(1e-4);  // state no longer zero
  }
  muon_share = c.muon_share;
  return *c.opt;
}
void BM_optimizer_step(benchmark::State& st) {
  double share = 0;
  Optimizer& opt = optimizer_case(st.range(0), st.range(1), share);
  for (auto _ : st) opt.step(kAdamWLr);
  st.counters["muon_share"] = share;
}
void BM_optimizer_check(benchmark::State& st) {
  double share = 0;
  Optimizer& opt = optimizer_case(st.range(0), st.range(1), share);
  for (auto _ : st) benchmark::DoNotOptimize(opt.non_finite_update(kAdamWLr));
}

void adamw_args(benchmark::internal::Benchmark* b) {
  b->ArgName("bf16")->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}

void gemm_args(benchmark::internal::Benchmark* b) {
  for (const auto& s : kGemmShapes) b->Args(s);
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinWarmUpTime(0.5);
}

BENCHMARK(BM_sgemm_openblas)->Apply(gemm_args);
BENCHMARK(BM_matmul)->Apply(gemm_args);
BENCHMARK(BM_linear)->Apply(gemm_args);
BENCHMARK(BM_memcpy)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_add)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_add_bias)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_gelu_tanh)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_layer_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_rms_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_softmax)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_select_experts)->Unit(benchmark::kMillisecond)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_unfused_decay_gate)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_fused_decay_gate)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_unfused_gated_rms_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_fused_gated_rms_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_unfused_add_layer_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_fused_add_layer_norm)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_unfused_mlp_gelu)->UseRealTime()->MinWarmUpTime(0.2);
BENCHMARK(BM_fused_mlp_gelu)->UseRealTime()->MinWarmUpTime(0.2);

// Grouped by dtype, so each model is built once.
BENCHMARK(BM_adamw_step)->Arg(0)->Apply(adamw_args);
BENCHMARK(BM_adamw_check)->Arg(0)->Apply(adamw_args);
BENCHMARK(BM_adamw_check_then_step)->Arg(0)->Apply(adamw_args);
BENCHMARK(BM_adamw_step)->Arg(1)->Apply(adamw_args);
BENCHMARK(BM_adamw_check)->Arg(1)->Apply(adamw_args);
BENCHMARK(BM_adamw_check_then_step)->Arg(1)->Apply(adamw_args);
// Grouped by (model, optimizer), so each is built once.
void optimizer_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"k3", "muon"})->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);
}
BENCHMARK(BM_optimizer_step)->Args({0, 0})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_check)->Args({0, 0})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_step)->Args({0, 1})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_check)->Args({0, 1})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_step)->Args({1, 0})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_check)->Args({1, 0})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_step)->Args({1, 1})->Apply(optimizer_args);
BENCHMARK(BM_optimizer_check)->Args({1, 1})->Apply(optimizer_args);

// The CUDA index_select backward's host plan (ops/view/view_simt.h: the indices
// bucketed by destination row on the host before each backward's upload; it runs
// without a GPU), at GPT-2's embedding (8,192 ids into 50,304 rows) and at k3's
// router gather (8,192 tokens x top-16 of 896 experts, positions in the flat
// [N x E] scores, row by row as the router names them); both have mid > 4 n, so
// both take the sorted plan. GB/s of the indices read and the plan written (8
// bytes a position, 16 a named row), against memcpy's.
void BM_index_add_plan(benchmark::State& st) {
  const int64_t n = st.range(0), mid = st.range(1), experts = st.range(2);
  Generator gen(5);
  std::vector<int64_t> index(static_cast<size_t>(n));
  const Tensor draws = randint({n}, experts > 0 ? experts : mid, DType::i64, gen);
  const int64_t* d = draws.data<int64_t>();
  const int64_t k = experts > 0 ? n / (mid / experts) : 0;  // positions per router row
  for (int64_t i = 0; i < n; ++i) index[static_cast<size_t>(i)] = experts > 0 ? (i / k) * experts + d[i] : d[i];
  int64_t bytes = 0;
  for (auto _ : st) {
    const simt::IndexAddPlan plan = simt::index_add_plan(index.data(), n, mid);
    benchmark::DoNotOptimize(plan.packed.data());
    bytes = 8 * n + 8 * static_cast<int64_t>(plan.packed.size());
  }
  set_bytes(st, bytes);
}
BENCHMARK(BM_index_add_plan)
    ->Args({8192, 50304, 0})
    ->Args({8192 * 16, 8192 * 896, 896})
    ->UseRealTime()
    ->MinWarmUpTime(0.2);

// Console output plus a record of each run's counters, for the ratio table.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> rate;  // name -> GFLOP/s or GB/s
  std::map<std::string, double> time;  // name -> real time per iteration, in the case's unit
  std::map<std::string, double> interleaved;  // BM_adamw_check_then_step: its halves' check / step
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
      time[r.benchmark_name()] = r.GetAdjustedRealTime();
      if (auto it = r.counters.find("check/step"); it != r.counters.end()) interleaved[r.benchmark_name()] = it->second;
      for (const char* key : {"GFLOP/s", "GB/s"}) {
        auto it = r.counters.find(key);
        if (it != r.counters.end()) rate[r.benchmark_name()] = it->second.value;
      }
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  cpu::init_threads();
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  fmt::print("\nratios to the same-run baseline ({} threads)\n", cpu::num_threads());
  for (const auto& [name, value] : reporter.rate) {
    std::string base;
    if (name.rfind("BM_matmul/", 0) == 0) base = "BM_sgemm_openblas/" + name.substr(10);
    else if (name.rfind("BM_linear/", 0) == 0) base = "BM_sgemm_openblas/" + name.substr(10);
    else if (name.rfind("BM_fused_", 0) == 0) base = "BM_unfused_" + name.substr(9);
    else if (name.rfind("BM_unfused_", 0) == 0) continue;  // the fused rows' baselines
    else if (name.rfind("BM_sgemm", 0) != 0 && name.rfind("BM_memcpy", 0) != 0) base = "BM_memcpy";
    if (base.empty()) continue;
    // The run's full name carries its options (BM_memcpy/min_warmup_time:0.200/real_time): match the prefix.
    auto it = reporter.rate.lower_bound(base);
    if (it == reporter.rate.end() || it->first.rfind(base, 0) != 0) continue;
    base = it->first;
    fmt::print("  {:<36} {:8.1f} vs {:8.1f} G/s  = {:.2f}x of {}\n", name, value / 1e9, it->second / 1e9,
               value / it->second, base);
  }
  // The check's cost as a fraction of the step it guards, per dtype.
  for (const char* arg : {"bf16:0", "bf16:1"}) {
    auto find = [&](const std::string& bench) {
      auto it = reporter.time.lower_bound(bench + "/" + arg);
      return it != reporter.time.end() && it->first.rfind(bench + "/" + arg, 0) == 0 ? it->second : -1.0;
    };
    const double step = find("BM_adamw_step"), check = find("BM_adamw_check"),
                 both = find("BM_adamw_check_then_step");
    double halves = -1;
    for (const auto& [name, ratio] : reporter.interleaved)
      if (name.rfind(std::string("BM_adamw_check_then_step/") + arg, 0) == 0) halves = ratio;
    if (step <= 0 || check <= 0) continue;
    fmt::print("  adamw ({}) ms per call: step {:.1f}, check {:.1f}, check + step {:.1f}: check / step = {:.2f} "
               "(within check + step: {:.2f}), (check + step) / step = {:.2f}\n",
               arg[5] == '1' ? "bf16 + f32 masters" : "f32", step, check, both, check / step, halves,
               both > 0 ? both / step : 0.0);
  }
  return 0;
}
