// The distributed optimizer's gradient sums against zero 0's (train.zero,
// docs/parallelism.md "What is bitwise"). Run with mpirun, e.g.
//   mpirun --oversubscribe -np 2 build/moetrain_bench_grad_sum_order
//   mpirun --oversubscribe -np 4 build/moetrain_bench_grad_sum_order
// For flat f64 vectors of several sizes (random normal values, another stream on
// every rank), rank 0 reports:
//   1. how many elements of Communicator::reduce_scatter_sum_v (MPI_Reduce_scatter,
//      what zero 1 sums gradients with) differ in any bit from the same elements
//      of all_reduce_sum (MPI_Allreduce, zero 0's): MPI's algorithms may add the
//      ranks' values in different trees; with 2 ranks a + b is the same either way;
//   2. the median time of the all-reduce against reduce-scatter + all_gather_v
//      (what zero 1 does per step with gradients and then parameters), same run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "comm/communicator.h"
#include "moetrain.h"

using namespace moetrain;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kReps = 7;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

int main() {
  comm::Communicator& world = comm::world();
  const int r = world.rank(), n = world.size();
  if (r == 0)
    std::printf("%d rank(s); f64; counts: the ranks' equal shares (floor(total r / ranks))\n"
                "%12s %12s %10s %14s %14s %7s\n",
                n, "elements", "bits differ", "fraction", "all-reduce ms", "rs+gather ms", "ratio");
  for (int64_t total : {int64_t{8}, int64_t{1000}, int64_t{100000}, int64_t{1} << 20, int64_t{1} << 22}) {
    std::vector<double> values(static_cast<size_t>(total));
    std::mt19937_64 gen(static_cast<uint64_t>(1000 * r + 7));
    std::normal_distribution<double> normal;
    for (double& v : values) v = normal(gen) * 1e-3;
    const Tensor mine = from_span<double>(values, Shape{total});
    std::vector<int64_t> counts;
    int64_t at = 0, begin = 0;
    for (int q = 0; q < n; ++q) {
      const int64_t end = total * (q + 1) / n;
      if (q == r) begin = at;
      counts.push_back(end - at);
      at = end;
    }
    Tensor summed = mine.clone();
    world.all_reduce_sum(summed);
    const Tensor part = world.reduce_scatter_sum_v(mine, counts);
    int64_t differ = 0;
    for (int64_t i = 0; i < part.numel(); ++i)
      differ += std::memcmp(part.data<double>() + i, summed.data<double>() + begin + i, sizeof(double)) != 0;
    Tensor count = full({1}, static_cast<double>(differ), DType::f64);
    world.all_reduce_sum(count);
    std::vector<double> t_all, t_zero;
    for (int rep = 0; rep < kReps + 1; ++rep) {
      world.barrier();
      auto t0 = Clock::now();
      Tensor s = mine.clone();
      world.all_reduce_sum(s);
      const double a = seconds_since(t0);
      world.barrier();
      t0 = Clock::now();
      const Tensor p = world.reduce_scatter_sum_v(mine, counts);
      const Tensor g = world.all_gather_v(p, counts);
      const double z = seconds_since(t0);
      if (rep > 0) {  // the first is a warm-up
        t_all.push_back(a);
        t_zero.push_back(z);
      }
    }
    if (r == 0)
      std::printf("%12lld %12.0f %10.3f %14.3f %14.3f %7.2f\n", static_cast<long long>(total), count.data<double>()[0],
                  count.data<double>()[0] / static_cast<double>(total), 1e3 * median(t_all), 1e3 * median(t_zero),
                  median(t_zero) / median(t_all));
  }
  return 0;
}
