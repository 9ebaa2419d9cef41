// Core-op benchmarks, as ratios to same-run baselines:
//   matmul (GPT-2-small shapes)      vs raw cblas_sgemm on the same buffers
//   elementwise / norm / softmax     vs memcpy of the same bytes (GB/s)
//   fused KDA gates (fwd + bwd)      vs the unfused ops they replace
// Run: build/moetrain_bench_ops [--benchmark_filter=...]; the ratio table is printed last.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <cstring>
#include <map>
#include <string>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "nn/moe.h"

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
// KDA's output: RMSNorm(o) ⊙ σ(z) per head.
void BM_fused_gated_rms_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kHeads, kHeadDim}, 1), z = leaf({kRows, kHeads, kHeadDim}, 2), w = leaf({kHeadDim}, 3);
  forward_backward(st, {x, z, w}, [&] { return gated_rms_norm(x, w, z); });
}
void BM_unfused_gated_rms_norm(benchmark::State& st) {
  Tensor x = leaf({kRows, kHeads, kHeadDim}, 1), z = leaf({kRows, kHeads, kHeadDim}, 2), w = leaf({kHeadDim}, 3);
  forward_backward(st, {x, z, w}, [&] { return mul(rms_norm(x, w), sigmoid(z)); });
}

// The router's top-16 of 896 experts for 8192 tokens on the CPU (K3's router):
// what a CUDA step paid on the host per MoE layer before the selection moved to
// the GPU (moetrain_bench_cuda times both there).
void BM_select_experts(benchmark::State& st) {
  Tensor scores = sigmoid(randn({8192, 896}, DType::f32, 3)), bias = zeros({896}, DType::f32);
  for (auto _ : st) benchmark::DoNotOptimize(select_experts(scores, bias, 16));
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

// Console output plus a record of each run's counters, for the ratio table.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> rate;  // name -> GFLOP/s or GB/s
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
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
  return 0;
}
