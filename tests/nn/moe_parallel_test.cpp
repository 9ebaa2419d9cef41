// Expert and data parallelism of the MoE model (issue 5). Under mpirun (the
// comm_mpi_np2 / np4 ctest entries) every rank computes the one-process
// reference itself (the whole global batch, unsharded experts) and compares the
// distributed run with it: EP = 1 (pure DP), 2, 4 and DP x EP where the world
// allows. Run by one process these cases check the EP = 1 path against itself.
#include <catch2/catch.hpp>

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
    const double err = testing::max_abs_diff(p.tensor.grad(), want) / std::max(1e-3, abs_max(want));
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
    HybridModel m(moe_model(DType::f64), 5, true, d.shard());
    if (ep > 1) m.set_expert_group(d.grid.ep_group.get());
    Tensor loss = m.loss(my_ids, my_targets);
    loss.backward();
    sync_gradients(d, m);
    CHECK(std::abs(mean_over_world(d, loss.item<double>()) - ref_loss.item<double>()) <
          1e-12 * std::abs(ref_loss.item<double>()));
    auto [worst, where] = grad_error(m, ref, d);
    INFO("worst " << where);
    CHECK(worst < 1e-10);
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
  HybridModel m(c, 5, true, d.shard());
  HybridModel ref(c, 5);
  if (W > 1) m.set_expert_group(d.grid.ep_group.get());
  {
    NoGradGuard g;
    for (HybridModel* model : {&m, &ref})
      for (MoeLayer* layer : model->moe_layers()) {
        layer->bias.data<float>()[6] = 10.0f;
        layer->bias.data<float>()[7] = 10.0f;
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
