// Expert and data parallelism of the MoE model (issue 5). Under mpirun (the
// comm_mpi_np2 / np4 ctest entries) every rank computes the one-process
// reference itself (the whole global batch, unsharded experts) and compares the
// distributed run with it: EP = 1 (pure DP), 2, 4 and DP x EP where the world
// allows. Run by one process these cases check the EP = 1 path against itself.
#include <catch2/catch.hpp>

#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "comm/communicator.h"
#include "comm/process_grid.h"
#include "moetrain.h"
#include "nn/hybrid.h"
#include "testing.h"
#include "train/distributed.h"

using namespace moetrain;

namespace {

HybridConfig moe_model(DType dtype) {
  HybridConfig c;
  c.vocab_size = 19;
  c.d_model = 8;
  c.n_ctx = 64;
  c.mixers = {MixerKind::kda, MixerKind::attention, MixerKind::kda};
  c.attention_n_head = 2;
  c.kda.n_head = 2;
  c.kda.head_dim = 4;
  c.kda.chunk_size = 4;
  c.ffn.d_ff = 12;
  c.moe.num_experts = 8;
  c.moe.top_k = 3;
  c.moe.expert_d_ff = 5;
  c.moe.latent_dim = 6;
  c.moe.num_shared_experts = 1;
  c.moe.first_dense_layers = 1;
  c.attn_res = true;
  c.attn_res_block_size = 2;
  c.init_std = 0.3;
  c.dtype = dtype;
  return c;
}

const NamedParameter& find(const ParameterList& params, const std::string& name) {
  for (const NamedParameter& p : params)
    if (p.name == name) return p;
  FAIL("no parameter " << name);
  return params.front();
}

double abs_max(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector()) m = std::max(m, std::abs(v));
  return m;
}

// Worst relative difference between the synchronised gradients of `m` (this rank's
// expert rows) and those of the one-process reference.
std::pair<double, std::string> grad_error(HybridModel& m, HybridModel& ref, const Distributed& d) {
  double worst = 0;
  std::string where;
  const int64_t experts_here = m.config().moe.num_experts / d.grid.ep;
  for (const NamedParameter& p : m.parameters()) {
    Tensor want = find(ref.parameters(), p.name).tensor.grad();
    if (p.group == "experts")
      want = slice(want, 0, d.grid.ep_index * experts_here, (d.grid.ep_index + 1) * experts_here).contiguous();
    REQUIRE(p.tensor.grad().defined());
    REQUIRE(p.tensor.grad().shape() == want.shape());
    const Tensor got = p.tensor.grad().to(kCpu);  // a CUDA model's gradients are compared on the host
    const double err = testing::max_abs_diff(got, want) / std::max(1e-3, abs_max(want));
    if (err > worst) {
      worst = err;
      where = p.name;
    }
  }
  return {worst, where};
}

}  // namespace

TEST_CASE("moe parallel: loss and every gradient equal one process (EP 1, 2, 4; DP x EP)", "[nn][moe][mpi]") {
  comm::Communicator& world = comm::world();
  const int W = world.size(), rank = world.rank();
  const int64_t rows = 2, T = 7;  // per rank
  Generator gen(1);
  Tensor ids = randint({W * rows, T}, 19, DType::i32, gen), targets = randint({W * rows, T}, 19, DType::i32, gen);
  HybridModel ref(moe_model(DType::f64), 5);
  Tensor ref_loss = ref.loss(ids, targets);
  ref_loss.backward();
  Tensor my_ids = slice(ids, 0, rank * rows, (rank + 1) * rows).contiguous();
  Tensor my_targets = slice(targets, 0, rank * rows, (rank + 1) * rows).contiguous();
  for (int ep : {1, 2, 4}) {
    if (W % ep != 0) continue;
    INFO("world " << W << " ep " << ep << " rank " << rank);
    Distributed d;
    d.world = &world;
    d.grid = comm::make_process_grid(world, ep);
    HybridModel m(moe_model(DType::f64), 5, true, expert_shard(d));
    if (ep > 1) m.set_expert_group(d.grid.ep_group.get());
    Tensor loss = m.loss(my_ids, my_targets);
    loss.backward();
    sync_gradients(d, m);
    CHECK(std::abs(mean_over_world(d, loss.item<double>()) - ref_loss.item<double>()) <
          1e-12 * std::abs(ref_loss.item<double>()));
    auto [worst, where] = grad_error(m, ref, d);
    INFO("worst " << where);
    CHECK(worst < 1e-10);
    // The bias update from world-summed counts leaves the same router biases on every rank.
    all_reduce_moe_stats(d, m);
    for (MoeLayer* layer : m.moe_layers()) {
      layer->update_bias(layer->stats().tokens_per_expert);
      Tensor all = world.all_gather(reshape(layer->router.bias, {1, 8}));
      for (int r = 1; r < W; ++r) CHECK(testing::bitwise_equal(slice(all, 0, r, r + 1), slice(all, 0, 0, 1)));
      double moved = 0;
      for (double b : layer->router.bias.to_vector()) moved += std::abs(b);
      CHECK(moved > 0);
    }
  }
}

TEST_CASE("moe parallel: on CUDA (NCCL), loss and every gradient equal one CPU process (EP 1, 2, 4)",
          "[nn][moe][cuda][mpi]") {
  // The case above with each rank's model on its GPU: KDA, attention, AttnRes and the
  // latent MoE on CUDA, the expert dispatch and the gradient sums through NCCL; the
  // reference stays on the CPU. One process checks the model on one GPU (EP 1).
  if (!testing::gpu_available()) return;
  comm::Communicator& world = comm::world();
  const int W = world.size(), rank = world.rank();
  const Device gpu{DeviceKind::cuda, cuda::select_device(cpu::launcher_local_rank())};
  const int64_t rows = 2, T = 7;
  Generator gen(1);
  Tensor ids = randint({W * rows, T}, 19, DType::i32, gen), targets = randint({W * rows, T}, 19, DType::i32, gen);
  HybridModel ref(moe_model(DType::f64), 5);
  Tensor ref_loss = ref.loss(ids, targets);
  ref_loss.backward();
  Tensor my_ids = slice(ids, 0, rank * rows, (rank + 1) * rows).contiguous().to(gpu);
  Tensor my_targets = slice(targets, 0, rank * rows, (rank + 1) * rows).contiguous().to(gpu);
  for (int ep : {1, 2, 4}) {
    if (W % ep != 0) continue;
    INFO("world " << W << " ep " << ep << " rank " << rank);
    Distributed d;
    d.world = &world;
    d.grid = comm::make_process_grid(world, ep);
    HybridModel m(moe_model(DType::f64), 5, true, expert_shard(d));
    for (const NamedParameter& p : m.parameters()) move_to_device_(p.tensor, gpu);
    if (ep > 1) m.set_expert_group(d.grid.ep_group.get());
    Tensor loss = m.loss(my_ids, my_targets);
    REQUIRE(loss.is_cuda());
    loss.backward();
    sync_gradients(d, m);
    CHECK(std::abs(mean_over_world(d, loss.to(kCpu).item<double>()) - ref_loss.item<double>()) <
          1e-10 * std::abs(ref_loss.item<double>()));
    auto [worst, where] = grad_error(m, ref, d);
    INFO("worst " << where);
    CHECK(worst < 1e-9);
  }
}

TEST_CASE("moe parallel: a rank whose tokens all go elsewhere, and experts without tokens, work", "[nn][moe][mpi]") {
  // Every router row is steered to experts 6 and 7 (the last rank's shard at EP =
  // world): the other ranks receive nothing, the last rank everything.
  comm::Communicator& world = comm::world();
  const int W = world.size();
  if (8 % W != 0) return;
  Distributed d;
  d.world = &world;
  d.grid = comm::make_process_grid(world, W);
  HybridConfig c = moe_model(DType::f64);
  c.moe.top_k = 2;
  HybridModel m(c, 5, true, expert_shard(d));
  HybridModel ref(c, 5);
  if (W > 1) m.set_expert_group(d.grid.ep_group.get());
  {
    NoGradGuard g;
    for (HybridModel* model : {&m, &ref})
      for (MoeLayer* layer : model->moe_layers()) {
        layer->router.bias.data<float>()[6] = 10.0f;
        layer->router.bias.data<float>()[7] = 10.0f;
      }
  }
  Generator gen(3);
  Tensor ids = randint({W * 2, 5}, 19, DType::i32, gen), targets = randint({W * 2, 5}, 19, DType::i32, gen);
  Tensor ref_loss = ref.loss(ids, targets);
  Tensor loss = m.loss(slice(ids, 0, d.rank() * 2, d.rank() * 2 + 2).contiguous(),
                       slice(targets, 0, d.rank() * 2, d.rank() * 2 + 2).contiguous());
  loss.backward();
  sync_gradients(d, m);
  CHECK(std::abs(mean_over_world(d, loss.item<double>()) - ref_loss.item<double>()) < 1e-12);
  ref_loss.backward();
  auto [worst, where] = grad_error(m, ref, d);
  INFO("worst " << where);
  CHECK(worst < 1e-10);
  for (MoeLayer* layer : m.moe_layers()) {
    const MoeStats& st = layer->stats();
    for (int e = 0; e < 6; ++e) CHECK(st.tokens_per_expert[e] == 0);
    CHECK(st.tokens_per_expert[6] == 10);  // this rank's 10 tokens, slots 6 and 7
  }
}

TEST_CASE("moe parallel: dispatch delivers stamped rows to their experts; identity experts return the input",
          "[nn][moe][mpi]") {
  // Rank s sends (s + e) % 3 rows for expert e (some none), each stamped
  // [source, expert, index]; the expert function sees the rows of its local
  // experts grouped by expert, sources in rank order, and returns them: the
  // combine must give back the input, and the gradient must flow back unchanged.
  comm::Communicator& world = comm::world();
  const int W = world.size(), rank = world.rank();
  const int64_t E = 8;
  if (E % W != 0) return;
  comm::ProcessGrid grid = comm::make_process_grid(world, W);
  MoeConfig c;
  c.num_experts = E;
  c.top_k = 2;
  c.expert_d_ff = 2;
  c.num_shared_experts = 0;
  ParamFactory f(true, DType::f64, 1);
  MoeLayer layer(c, 4, FfnConfig{}, 0.1, f, "mlp.", {grid.ep_index, W});
  if (W > 1) layer.set_expert_group(grid.ep_group.get());
  std::vector<int64_t> counts(E);
  std::vector<double> stamps;
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = (rank + e) % 3;
    for (int64_t i = 0; i < counts[e]; ++i) stamps.insert(stamps.end(), {double(rank), double(e), double(i)});
  }
  const int64_t M = static_cast<int64_t>(stamps.size() / 3);
  Tensor rows = empty({M, 3}, DType::f64);
  std::copy(stamps.begin(), stamps.end(), rows.data<double>());
  rows.set_requires_grad(true);
  const int64_t El = E / W, first = grid.ep_index * El;
  int calls = 0;
  Tensor out = layer.dispatch(rows, counts, [&](const Tensor& got, const std::vector<int64_t>& local) {
    ++calls;
    REQUIRE(static_cast<int64_t>(local.size()) == El);
    const double* g = got.data<double>();
    int64_t row = 0;
    for (int64_t e = 0; e < El; ++e) {
      int64_t want = 0;
      for (int s = 0; s < W; ++s) want += (s + first + e) % 3;
      CHECK(local[e] == want);
      for (int s = 0; s < W; ++s)
        for (int64_t i = 0; i < (s + first + e) % 3; ++i, ++row) {
          CHECK(g[row * 3 + 0] == s);
          CHECK(g[row * 3 + 1] == first + e);
          CHECK(g[row * 3 + 2] == i);
        }
    }
    CHECK(row == got.size(0));
    return got;
  });
  CHECK(calls == 1);
  CHECK(testing::bitwise_equal(out.detach(), rows.detach()));
  Tensor up = randn({M, 3}, DType::f64, 10 + static_cast<uint64_t>(rank));
  sum(mul(out, up)).backward();
  CHECK(testing::bitwise_equal(rows.grad(), up));
}
