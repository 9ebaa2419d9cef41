// KDA core op, forward + backward in f32 at B = 1, H = HV = 4, K = V = 64, T = 2048 and 8192:
// chunked (C = 64) vs recurrent, as time, as GFLOP/s against the same-run OpenBLAS sgemm
// rate on the chunk tiles (64x64 by 64x64, one tile product per task in parallel; the
// chunked kernel now multiplies such tiles with its own tile_gemm), and as the
// chunked / recurrent time ratio.
// Then, for T = 2048 and 8192, the same chunked algorithm in plain PyTorch (bench/kda_torch.py,
// autograd backward, same thread count, run by /usr/bin/python3 after our runs) and the
// PyTorch / moetrain time ratio.
// Run: build/moetrain_bench_kda [--no-torch] [--torch-steps N] [--benchmark_filter=...]; the
// ratio table is printed last.
//
// FLOP models: bench/kda_case.h.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "bench/harness.h"
#include "bench/kda_case.h"
#include "moetrain.h"
#include "ops/kda/kda.h"

using namespace moetrain;

namespace {

constexpr int64_t kB = bench::kKdaB, kH = bench::kKdaH, kK = bench::kKdaK, kV = bench::kKdaV, kC = bench::kKdaC;

void set_flops(benchmark::State& st, double flops) {
  st.counters["GFLOP/s"] =
      benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1000);
}

// One 64x64 by 64x64 product per task, B·H tasks in parallel, 64 products per task per iteration.
void BM_sgemm_tiles(benchmark::State& st) {
  const int64_t tasks = kB * kH, reps = 64;
  Tensor a = randn({tasks, kC, kK}, DType::f32, 1), b = randn({tasks, kK, kV}, DType::f32, 2),
         c = empty({tasks, kC, kV});
  for (auto _ : st) {
    cpu::parallel_for(tasks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        for (int64_t r = 0; r < reps; ++r)
          cpu::gemm(false, false, kC, kV, kK, 1.f, a.data<float>() + t * kC * kK, kK, b.data<float>() + t * kK * kV, kV,
                    r == 0 ? 0.f : 1.f, c.data<float>() + t * kC * kV, kV);
    });
    benchmark::ClobberMemory();
  }
  set_flops(st, 2.0 * kC * kK * kV * tasks * reps);
}

void run_kda(benchmark::State& st, KdaMode mode) {
  int64_t T = st.range(0);
  bench::KdaInputs in = bench::make_kda_inputs(T);
  const Tensors& x = in.leaves;
  for (auto _ : st) {
    KdaResult r = kda(x[0], x[1], x[2], x[3], x[4], Tensor(), 0.125, mode, kC);
    autograd::backward({r.o, r.final_state}, {in.grad_o, in.grad_state});
    for (const Tensor& t : x) t.zero_grad();
  }
  set_flops(st, mode == KdaMode::chunked ? bench::kda_chunked_flops(T) : bench::kda_recurrent_flops(T));
}

void BM_kda_recurrent(benchmark::State& st) { run_kda(st, KdaMode::recurrent); }
void BM_kda_chunked(benchmark::State& st) { run_kda(st, KdaMode::chunked); }

BENCHMARK(BM_sgemm_tiles)->Unit(benchmark::kMillisecond)->UseRealTime()->MinWarmUpTime(0.3);
BENCHMARK(BM_kda_recurrent)->Arg(2048)->Arg(8192)->Unit(benchmark::kMillisecond)->UseRealTime()->MinWarmUpTime(0.3);
BENCHMARK(BM_kda_chunked)->Arg(2048)->Arg(8192)->Unit(benchmark::kMillisecond)->UseRealTime()->MinWarmUpTime(0.3);

class RatioReporter : public benchmark::ConsoleReporter {
 public:
  std::map<std::string, double> rate, ms;  // "BM_x/arg" -> GFLOP/s, ms per iteration
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration) continue;
      std::string name = r.run_name.function_name + (r.run_name.args.empty() ? "" : "/" + r.run_name.args);
      auto it = r.counters.find("GFLOP/s");
      if (it != r.counters.end()) rate[name] = it->second.value;
      ms[name] = r.GetAdjustedRealTime();  // in the benchmark's unit (ms)
    }
  }
};

// Mean ms per forward+backward step of bench/kda_torch.py at this shape and thread count; -1 if it failed.
double torch_ms(int64_t T, int steps) {
  return bench::torch_ms(fmt::format("kda_torch.py --seq {} --heads {} --dim {} --chunk {} --batch {} --threads {} "
                                     "--steps {}",
                                     T, kH, kK, kC, kB, cpu::num_threads(), steps));
}

}  // namespace

int main(int argc, char** argv) {
  bool with_torch = true;
  int torch_steps = 3;
  int kept = 1;  // our flags out, Google Benchmark's in
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--no-torch") with_torch = false;
    else if (a == "--torch-steps" && i + 1 < argc) torch_steps = std::atoi(argv[++i]);
    else argv[kept++] = argv[i];
  }
  argc = kept;
  cpu::init_threads();
  benchmark::Initialize(&argc, argv);
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  fmt::print("\nKDA forward+backward, f32, B={} H={} K=V={} C={} ({} threads, {})\n", kB, kH, kK, kC,
             cpu::num_threads(), cpu::blas_name());
  const std::string base = "BM_sgemm_tiles";
  double sgemm = reporter.rate.count(base) ? reporter.rate[base] : 0.0;
  fmt::print("  sgemm on 64x64 tiles: {:.1f} GFLOP/s\n", sgemm / 1e9);
  for (int64_t T : {2048, 8192}) {
    std::string rec = fmt::format("BM_kda_recurrent/{}", T), chk = fmt::format("BM_kda_chunked/{}", T);
    for (const std::string& name : {rec, chk}) {
      if (!reporter.rate.count(name)) continue;
      fmt::print("  {:<22} {:9.2f} ms {:7.1f} GFLOP/s = {:.2f}x of sgemm\n", name, reporter.ms[name],
                 reporter.rate[name] / 1e9, sgemm > 0 ? reporter.rate[name] / sgemm : 0.0);
    }
    if (reporter.ms.count(rec) && reporter.ms.count(chk))
      fmt::print("  T={}: chunked / recurrent time = {:.2f}\n", T, reporter.ms[chk] / reporter.ms[rec]);
  }
  if (!with_torch) return 0;
  fmt::print("PyTorch {} (bench/kda_torch.py, chunked, autograd backward, warm-up + mean of {} steps)\n",
             "/usr/bin/python3", torch_steps);
  for (int64_t T : {2048, 8192}) {
    std::string chk = fmt::format("BM_kda_chunked/{}", T);
    double tms = torch_ms(T, torch_steps);
    if (tms <= 0) {
      fmt::print("  T={}: PyTorch run failed\n", T);
      continue;
    }
    fmt::print("  T={}: PyTorch {:9.2f} ms", T, tms);
    if (reporter.ms.count(chk))
      fmt::print(", moetrain chunked {:.2f} ms: PyTorch / moetrain time = {:.1f}x", reporter.ms[chk], tms / reporter.ms[chk]);
    fmt::print("\n");
  }
  return 0;
}
