// Expert-parallel MoE dispatch under MPI (issue 5). Run with mpirun, e.g.
//   mpirun --oversubscribe -np 2 build/moetrain_bench_moe_dispatch
//   mpirun --oversubscribe -np 4 build/moetrain_bench_moe_dispatch [--tokens N]
// All ranks form one expert-parallel group (EP = world size). Reports, as the
// median of the timed repetitions on rank 0:
//   1. dispatch + combine (the MoE layer's two all_to_all_v exchanges, with the
//      count exchange and the local re-grouping by expert, identity experts) vs
//      the raw Communicator::all_to_all_v (MPI_Alltoallv) of the same rows, twice:
//      the ratio is the overhead of our dispatch over the bare exchange;
//   2. one MoE layer forward + backward (f32) split into routing, permute
//      (plan + gathers), communication and expert GEMMs, timed as separate phases
//      with the layer's own functions, and the whole layer for comparison.
// Shape: k3-small's MoE experts (latent 128, 64 experts top-8, F 112) at D 512 (k3-small: 256), 2048
// tokens per rank.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "backend/cpu/parallel.h"
#include "comm/collectives.h"
#include "comm/communicator.h"
#include "moetrain.h"
#include "nn/moe.h"
#include "ops/moe/moe.h"

using namespace moetrain;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kD = 512, kL = 128, kE = 64, kTopK = 8, kF = 112;
constexpr int kWarmup = 2, kReps = 7;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times fn (collective: every rank calls it) kReps times after kWarmup; the
// time of one repetition is the slowest rank's.
template <class F>
double time_ms(comm::Communicator& c, F&& fn) {
  std::vector<double> ts;
  for (int i = 0; i < kWarmup + kReps; ++i) {
    c.barrier();
    auto t0 = Clock::now();
    fn();
    Tensor dt = full({1}, std::chrono::duration<double, std::milli>(Clock::now() - t0).count(), DType::f64);
    Tensor all = c.all_gather(dt);
    std::vector<double> v = all.to_vector();
    if (i >= kWarmup) ts.push_back(*std::max_element(v.begin(), v.end()));
  }
  return median(ts);
}

Tensor index_tensor(const std::vector<int64_t>& v) {
  Tensor t = empty({static_cast<int64_t>(v.size())}, DType::i64);
  std::copy(v.begin(), v.end(), t.data<int64_t>());
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t tokens = 2048;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string(argv[i]) == "--tokens") tokens = std::stoll(argv[i + 1]);
  cpu::init_threads();
  comm::Communicator& world = comm::world();
  const int P = world.size(), rank = world.rank();
  if (kE % P != 0) {
    if (rank == 0) std::fprintf(stderr, "moe_dispatch: %d ranks do not divide %lld experts\n", P, (long long)kE);
    return 2;
  }
  MoeConfig c;
  c.num_experts = kE;
  c.top_k = kTopK;
  c.expert_d_ff = kF;
  c.latent_dim = kL;
  c.num_shared_experts = 2;
  FfnConfig ffn;
  ParamFactory f(true, DType::f32, 1);
  MoeLayer layer(c, kD, ffn, 0.02, f, "mlp.", {rank, P});
  if (P > 1) layer.set_expert_group(&world);
  Tensor x = randn({1, tokens, kD}, DType::f32, 100 + static_cast<uint64_t>(rank));
  x.set_requires_grad(true);

  // Routing and the plan as the layer does them (NoGrad parts timed separately below).
  Tensor xf = reshape(x.detach(), {tokens, kD});
  Routing r = route(xf, layer.router.gate_weight, layer.router.bias, c);
  ExpertPlan plan = plan_experts(r.experts, kE);
  const int64_t El = kE / P, M = static_cast<int64_t>(plan.order.size());
  std::vector<int64_t> send_rows(P, 0);
  for (int q = 0; q < P; ++q)
    for (int64_t e = q * El; e < (q + 1) * El; ++e) send_rows[q] += plan.counts[e];
  std::vector<int64_t> recv_rows = world.all_to_all_counts(send_rows);
  std::vector<int64_t> token(plan.order.size());
  for (int64_t i = 0; i < M; ++i) token[i] = plan.order[i] / kTopK;
  Tensor z = linear(xf, layer.down_proj);
  Tensor z_sorted = index_select(z, 0, index_tensor(token));

  // 1. Raw exchange of the same rows, there and back, vs the layer's dispatch + combine
  //    (count exchange, re-grouping) around identity experts.
  const double raw = time_ms(world, [&] {
    Tensor there = world.all_to_all_v(z_sorted, send_rows, recv_rows);
    Tensor back = world.all_to_all_v(there, recv_rows, send_rows);
  });
  const double ours = time_ms(world, [&] {
    NoGradGuard g;
    layer.dispatch(z_sorted, plan.counts, [](const Tensor& rows, const std::vector<int64_t>&) { return rows; });
  });

  // 2. Phases of forward + backward.
  const double routing = time_ms(world, [&] {
    Routing rr = route(reshape(x, {tokens, kD}), layer.router.gate_weight, layer.router.bias, c);
    sum(rr.weights).backward();
  });
  const double permute = time_ms(world, [&] {
    ExpertPlan p = plan_experts(r.experts, kE);
    Tensor zz = linear(reshape(x, {tokens, kD}), layer.down_proj);
    Tensor s = index_select(zz, 0, index_tensor(token));
    sum(s).backward();
  });
  const double communication = time_ms(world, [&] {
    Tensor zs = z_sorted.detach();
    zs.set_requires_grad(true);
    Tensor there = comm::all_to_all_v(world, zs, send_rows, recv_rows);
    Tensor back = comm::all_to_all_v(world, there, recv_rows, send_rows);
    sum(back).backward();
  });
  int64_t local_rows = 0;
  for (int64_t v : recv_rows) local_rows += v;
  std::vector<int64_t> local_counts(El, local_rows / El);
  local_counts[0] += local_rows - (local_rows / El) * El;
  Tensor zl = randn({local_rows, kL}, DType::f32, 7);
  const double experts = time_ms(world, [&] {
    Tensor g = grouped_linear(zl, layer.w1, local_counts), u = grouped_linear(zl, layer.w3, local_counts);
    Tensor h = situ_glu(g, u, 4.0, 25.0);
    sum(grouped_linear(h, layer.w2, local_counts)).backward();
  });
  const double whole = time_ms(world, [&] { sum(layer.forward(x, true)).backward(); });

  if (rank == 0) {
    const double mib = static_cast<double>(M * kL * 4) / (1 << 20);
    std::printf("moe dispatch, EP = %d ranks, %lld tokens/rank, top-%lld of %lld experts, latent %lld (f32), %d threads/rank\n",
                P, (long long)tokens, (long long)kTopK, (long long)kE, (long long)kL, cpu::num_threads());
    std::printf("  rows sent per rank %lld (%.2f MiB)\n", (long long)M, mib);
    std::printf("  raw all_to_all_v there + back   %8.3f ms\n", raw);
    std::printf("  dispatch + combine (ours)        %8.3f ms   = %.2fx raw\n", ours, ours / raw);
    std::printf("  MoE layer forward + backward, phases (each timed alone):\n");
    std::printf("    routing        %8.3f ms\n", routing);
    std::printf("    permute        %8.3f ms\n", permute);
    std::printf("    communication  %8.3f ms\n", communication);
    std::printf("    experts        %8.3f ms\n", experts);
    std::printf("    sum            %8.3f ms vs the whole layer %8.3f ms (shared experts and latent norm/up only in the latter)\n",
                routing + permute + communication + experts, whole);
  }
  return 0;
}
