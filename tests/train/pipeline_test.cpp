// Pipeline parallelism (issue 26): a stage-built model holds the whole model's
// values; the 1F1B schedule's loss and every gradient (after the replica and tied-
// embedding sums) equal one process's on the same global batch, in f64. Under
// mpirun (comm_mpi_np2 / np4) every rank computes the one-process reference itself
// and runs pp = 2 and pp = 4 with ep 2 or dp 2 where the world allows: AttnRes
// blocks that cross stage boundaries, MoE layers in several stages, tied and
// untied embeddings. Run by one process, the stage split is checked alone.
#include <catch2/catch.hpp>

#include <set>

#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "comm/communicator.h"
#include "comm/process_grid.h"
#include "moetrain.h"
#include "nn/hybrid.h"
#include "testing.h"
#include "train/distributed.h"
#include "train/pipeline.h"

using namespace moetrain;

namespace {

// 6 layers (KDA and MLA, MoE from layer 1), AttnRes blocks of 4: at pp 2 the
// boundary (layer 3) is inside block 0; at pp 4 (layers 2|2|1|1) block 1 opens on
// stage 2; at pp 3 (2|2|2) on stage 2 too, the block list of 1 + 1 crossing each boundary.
HybridConfig pipeline_model(bool tied) {
  HybridConfig c;
  c.vocab_size = 23;
  c.d_model = 8;
  c.n_ctx = 64;
  c.mixers = {MixerKind::kda, MixerKind::mla, MixerKind::kda, MixerKind::kda, MixerKind::mla, MixerKind::kda};
  c.kda.n_head = 2;
  c.kda.head_dim = 4;
  c.kda.chunk_size = 4;
  c.mla.n_head = 2;
  c.mla.q_lora_rank = 6;
  c.mla.kv_lora_rank = 4;
  c.mla.qk_nope_head_dim = 4;
  c.mla.qk_rope_head_dim = 2;
  c.mla.v_head_dim = 4;
  c.ffn.d_ff = 12;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.expert_d_ff = 5;
  c.moe.latent_dim = 6;
  c.moe.num_shared_experts = 1;
  c.moe.first_dense_layers = 1;
  c.attn_res = true;
  c.attn_res_block_size = 4;
  c.tie_embeddings = tied;
  c.init_std = 0.3;
  c.dtype = DType::f64;
  return c;
}

const NamedParameter* find(const ParameterList& params, const std::string& name) {
  for (const NamedParameter& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

double abs_max(const Tensor& t) {
  double m = 0;
  for (double v : t.to_vector()) m = std::max(m, std::abs(v));
  return m;
}

}  // namespace

TEST_CASE("pipeline: a stage holds exactly the whole model's parameters of its layers", "[train][pipeline]") {
  for (bool tied : {false, true}) {
    const HybridConfig c = pipeline_model(tied);
    HybridModel whole(c, 7);
    for (int64_t pp : {2, 3, 4, 6}) {
      std::set<std::string> seen;
      int64_t copies = 0;
      for (int64_t s = 0; s < pp; ++s) {
        INFO("tied " << tied << " pp " << pp << " stage " << s);
        HybridModel stage(c, 7, true, {}, PipelineStage{s, pp});
        const StageLayers layers = stage_layers(c.n_layer(), pp, s);
        CHECK(stage.pipeline_stage_layers().first == layers.first);
        CHECK(stage.pipeline_stage_layers().end == layers.end);
        for (const NamedParameter& p : stage.parameters()) {
          const NamedParameter* w = find(whole.parameters(), p.name);
          REQUIRE(w);
          CHECK(testing::bitwise_equal(p.tensor, w->tensor));
          if (!seen.insert(p.name).second) {
            CHECK((tied && p.name == "model.embed_tokens.weight" && s == pp - 1));
            ++copies;
          }
          // A layer parameter belongs to this stage's layers.
          if (p.name.rfind("model.layers.", 0) == 0) {
            const int64_t l = std::stoll(p.name.substr(13));
            CHECK((l >= layers.first && l < layers.end));
          }
        }
        CHECK(stage.buffers().size() == stage.moe_layers().size());  // a router bias per MoE layer of the stage
      }
      CHECK(seen.size() == whole.parameters().size());
      CHECK(copies == (tied ? 1 : 0));
    }
  }
  // What crosses each boundary: the blocks opened below it and the open sum.
  HybridModel s3(pipeline_model(false), 7, true, {}, PipelineStage{1, 2});  // layers 3-5
  CHECK(s3.stage_input_count() == 2);  // block 0 (the embedding) and the running sum
  HybridModel s4(pipeline_model(false), 7, true, {}, PipelineStage{3, 4});  // layer 5
  CHECK(s4.stage_input_count() == 3);  // the embedding, block 0's sum, block 1's running sum
  CHECK_THROWS_WITH(HybridModel(pipeline_model(false), 7, true, {}, PipelineStage{0, 7}),
                    Catch::Contains("each stage needs at least one layer"));
}

TEST_CASE("pipeline: 1F1B loss and every gradient equal one process (pp 2, 4; with ep 2 or dp 2; virtual stages)",
          "[train][pipeline][mpi]") {
  comm::Communicator& world = comm::world();
  const int W = world.size();
  if (W == 1) return;  // the stage split alone, above
  const int64_t B = 2, T = 6;  // rows per micro-batch, tokens
  struct Layout {
    int pp, ep;
    int64_t V, M;  // chunks per rank (train.pp_virtual), micro-batches per replica
  };
  for (bool tied : {false, true}) {
    const HybridConfig c = pipeline_model(tied);
    // Virtual stages: pp 2 x V 2 (layers 0-1 | 2 | 3-4 | 5: rank 0 holds 0-1 and 3-4, block 1 opens in
    // rank 0's second chunk after crossing the ring), pp 2 x V 3 (one layer per virtual stage), with ep 2.
    for (Layout layout : {Layout{2, 1, 1, 3}, Layout{2, 2, 1, 3}, Layout{4, 1, 1, 3}, Layout{W, 1, 1, 3},
                          Layout{2, 1, 2, 4}, Layout{2, 2, 2, 2}, Layout{2, 1, 3, 2}}) {
      const int64_t M = layout.M;
      if (layout.pp > W || W % (layout.pp * layout.ep) != 0) continue;
      Distributed d;
      d.world = &world;
      d.grid = comm::make_process_grid(world, layout.ep, "ep", layout.pp, "pp");
      d.tied_pipeline = tied;
      const int R = d.grid.replicas();
      INFO("world " << W << " pp " << layout.pp << " V " << layout.V << " ep " << layout.ep << " dp " << d.grid.dp
                    << " tied " << tied << " rank " << d.rank());
      // The global batch: M x R micro-batches; replica q takes q, q + R, ... (as the trainer's stream).
      Generator gen(11);
      std::vector<data::Batch> all;
      for (int64_t i = 0; i < M * R; ++i)
        all.push_back({randint({B, T}, c.vocab_size, DType::i32, gen), randint({B, T}, c.vocab_size, DType::i32, gen)});
      HybridModel ref(c, 5);
      double ref_loss = 0;
      for (const data::Batch& b : all) {
        Tensor l = ref.loss(b.inputs, b.targets);
        ref_loss += l.item<double>() / static_cast<double>(all.size());
        mul_scalar(l, 1.0 / static_cast<double>(all.size())).backward();
      }
      std::vector<data::Batch> mine;
      for (int64_t i = d.grid.local_index(); i < M * R; i += R) mine.push_back(all[static_cast<size_t>(i)]);
      HybridModel m(c, 5, true, expert_shard(d), PipelineStage{d.grid.pp_index, d.grid.pp, layout.V});
      if (layout.ep > 1) m.set_expert_group(d.grid.ep_group.get());
      const PipelineStepResult r = pipeline_train_step(d, m, mine, kCpu);
      if (layout.V == 1) CHECK(r.max_in_flight == std::min<int64_t>(layout.pp - d.grid.pp_index, M));
      // Interleaved, pp 2 x V 2, M 4: rank 0 runs 4 warm-up forwards and holds 5 (micro-batch, chunk) pairs.
      if (layout.V == 2 && layout.M == 4) CHECK(r.max_in_flight == (d.grid.pp_index == 0 ? 5 : 3));
      sync_gradients(d, m);
      const double loss = mean_loss(d, r.loss_sum / M);
      CHECK(std::abs(loss - ref_loss) < 1e-12 * std::abs(ref_loss));
      double worst = 0;
      std::string where;
      const int64_t experts_here = c.moe.num_experts / layout.ep;
      for (const NamedParameter& p : m.parameters()) {
        const NamedParameter* w = find(ref.parameters(), p.name);
        REQUIRE(w);
        Tensor want = w->tensor.grad();
        if (p.group == "experts")
          want = slice(want, 0, d.grid.ep_index * experts_here, (d.grid.ep_index + 1) * experts_here).contiguous();
        INFO(p.name);
        REQUIRE(p.tensor.grad().defined());
        const double err = testing::max_abs_diff(p.tensor.grad(), want) / std::max(1e-3, abs_max(want));
        if (err > worst) {
          worst = err;
          where = p.name;
        }
      }
      INFO("worst " << where << ": " << worst);
      CHECK(worst < 1e-10);
      // The global gradient norm is the whole model's (the tied table counted once).
      const double norm = clip_grad_norm(d, m, 0.0);
      double ref_sq = 0;
      for (const NamedParameter& p : ref.parameters())
        for (double v : p.tensor.grad().to_vector()) ref_sq += v * v;
      CHECK(std::abs(norm - std::sqrt(ref_sq)) < 1e-10 * std::sqrt(ref_sq));
      // The pipelined view's logits are the whole model's, on every stage.
      std::unique_ptr<LanguageModel> view = pipelined_model(d, m);
      const Tensor logits = view->forward(all[0].inputs, false);
      Tensor want;
      {
        NoGradGuard no_grad;
        want = ref.forward(all[0].inputs, false);
      }
      CHECK(testing::max_abs_diff(logits, want) < 1e-12 * std::max(1.0, abs_max(want)));
    }
  }
}

TEST_CASE("pipeline: on CUDA (NCCL send/recv), 1F1B gradients equal one CPU process (pp = world)",
          "[train][pipeline][cuda][mpi]") {
  // The case above with each stage on its GPU: activations and gradients through
  // NCCL's grouped send/recv, the logits' broadcast too; the reference on the CPU.
  if (!testing::gpu_available()) return;
  comm::Communicator& world = comm::world();
  const int W = world.size();
  if (W == 1 || W > 6) return;
  const Device gpu{DeviceKind::cuda, cuda::select_device(cpu::launcher_local_rank())};
  const HybridConfig c = pipeline_model(true);
  Distributed d;
  d.world = &world;
  d.grid = comm::make_process_grid(world, 1, "ep", W, "pp");
  d.tied_pipeline = true;
  const int64_t M = 3;
  Generator gen(11);
  std::vector<data::Batch> batches;
  for (int64_t i = 0; i < M; ++i)
    batches.push_back({randint({2, 6}, c.vocab_size, DType::i32, gen), randint({2, 6}, c.vocab_size, DType::i32, gen)});
  HybridModel ref(c, 5);
  for (const data::Batch& b : batches) mul_scalar(ref.loss(b.inputs, b.targets), 1.0 / M).backward();
  HybridModel m(c, 5, true, {}, PipelineStage{d.grid.pp_index, d.grid.pp});
  for (const NamedParameter& p : m.parameters()) move_to_device_(p.tensor, gpu);
  pipeline_train_step(d, m, batches, gpu);
  sync_gradients(d, m);
  for (const NamedParameter& p : m.parameters()) {
    INFO(p.name);
    const Tensor want = find(ref.parameters(), p.name)->tensor.grad();
    REQUIRE(p.tensor.grad().defined());
    CHECK(testing::max_abs_diff(p.tensor.grad().to(kCpu), want) < 1e-9 * std::max(1.0, abs_max(want)));
  }
}
