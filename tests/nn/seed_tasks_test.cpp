// Seed tasks of the KDA hybrid model (docs/model.md#kda-layer to #kda-chunked-form, docs/model.md#block-attnres to #full-decoder): a small
// all-KDA HybridModel, trained right here (no CLI) on the synthetic tasks of
// data/synthetic.h, learns associative recall and repeated-key replacement to
// > 95% held-out accuracy and, trained with context switches, forgets the
// pre-switch bindings while it keeps the new ones; decoding token by token with
// the constant-size KDA state gives the logits of the full forward; at
// T = 65,536 the f32 model stays close to f64.
//
// Settings (chosen by measurement on 2 cores):
//   model  2 KDA layers, d_model 64, 2 heads of 32 (K = V = 32, P = 64), SiTU-GLU
//          FFN 128, Block AttnRes with blocks of one layer, f32. With AttnRes
//          assoc_recall reached 99% after 150 steps; with the plain residual
//          stream 95% after 250.
//   gate   the lower-bound gate with the default dt_bias init (KdaDtBiasInit::spread:
//          g starts at -dt, dt ~ log U(1e-3, 1e-1) per channel). With the TT-K3
//          init dt_bias = 0 (g = -2.5, α ≈ 0.08: about one token of memory) the
//          same runs stayed below 10% accuracy after 300 steps, with or without
//          AttnRes (docs/hybrid.md, "Initial decays").
//   tasks  32 keys, 32 values; 16 pairs per row for recall and replacement (half
//          the key vocabulary bound in each row, 16 associations in a 32-dim key
//          space per head), 8 + 8 around a context switch. With 64 keys and 64
//          values (each key in fewer rows) 16-pair recall needed ~600 steps.
//   train  AdamW (0.9, 0.95, no weight decay), lr 3e-3, 30 warmup steps, cosine to
//          3e-4, gradient clip 1, 32 rows per step, data stream Generator(1);
//          held-out rows come from Generator(1000).
//   One thread (restored afterwards): the summation order of the parallel kernels
//   follows the thread count, so the trained weights and the measured accuracies
//   do not depend on the machine's core count, and on a busy 2-core machine one
//   thread avoids OpenMP barrier stalls.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>

#include <catch2/catch.hpp>

#include "backend/cpu/parallel.h"
#include "core/grad_mode.h"
#include "data/synthetic.h"
#include "moetrain.h"
#include "nn/hybrid.h"
#include "nn/kda_layer.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/view/view.h"
#include "optim/adamw.h"
#include "optim/schedule.h"
#include "testing.h"

using namespace moetrain;
using namespace moetrain::data;
using moetrain::testing::rel_error;

namespace {

struct ThreadCountGuard {
  int saved = cpu::num_threads();
  explicit ThreadCountGuard(int n) { cpu::set_num_threads(n); }
  ~ThreadCountGuard() { cpu::set_num_threads(saved); }
};

HybridConfig seed_model_config(int64_t vocab, DType dtype = DType::f32) {
  HybridConfig c;
  c.vocab_size = vocab;
  c.d_model = 64;
  c.n_ctx = 65536;
  c.mixers = {MixerKind::kda, MixerKind::kda};
  c.kda.n_head = 2;
  c.kda.head_dim = 32;
  c.kda.chunk_size = 64;
  c.ffn.d_ff = 128;
  c.attn_res = true;
  c.attn_res_block_size = 1;
  c.dtype = dtype;
  return c;
}

SyntheticOptions task_options(SyntheticTask task) {
  SyntheticOptions o;
  o.task = task;
  o.num_keys = 32;
  o.num_values = 32;
  o.num_pairs = task == SyntheticTask::context_switch ? 8 : 16;
  o.num_queries = task == SyntheticTask::repeated_key ? 6 : 8;
  o.num_rebinds = task == SyntheticTask::repeated_key ? 6 : 2;  // unused by assoc_recall
  return o;
}

struct TrainSettings {
  int64_t steps = 300, batch = 32, warmup = 30;
  double lr = 3e-3, min_lr = 3e-4, clip = 1.0;
};

// Trains in place; returns the wall time in seconds.
double train(HybridModel& model, const SyntheticOptions& task, const TrainSettings& s) {
  AdamW opt(model.parameters(), {0.9, 0.95, 1e-8, 0.0});
  const LrSchedule schedule{ScheduleKind::cosine, s.lr, s.min_lr, s.warmup, s.steps};
  Generator gen(1);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t step = 0; step < s.steps; ++step) {
    SyntheticBatch batch = synthetic_batch(task, s.batch, gen);
    opt.zero_grad();
    Tensor loss = model.loss(batch.inputs, batch.targets, true);
    REQUIRE(std::isfinite(loss.item<double>()));
    loss.backward();
    clip_grad_norm(model.parameters(), s.clip);
    opt.step(schedule.at(step));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The model's argmax at every answer position (target != kIgnoreIndex) of
// held-out rows, with the target and the stale value there.
struct Answers {
  std::vector<int32_t> predicted, target, stale;

  // Fraction of the answers selected by `counted` that satisfy `hit`.
  double fraction(const std::function<bool(size_t)>& counted, const std::function<bool(size_t)>& hit) const {
    int64_t n = 0, h = 0;
    for (size_t i = 0; i < target.size(); ++i)
      if (counted(i)) {
        ++n;
        h += hit(i);
      }
    REQUIRE(n > 0);
    return static_cast<double>(h) / static_cast<double>(n);
  }
  double accuracy() const {
    return fraction([](size_t) { return true; }, [&](size_t i) { return predicted[i] == target[i]; });
  }
};

Answers held_out_answers(HybridModel& model, const SyntheticOptions& task, int64_t rows) {
  Generator held_out(1000);
  SyntheticBatch batch = synthetic_batch(task, rows, held_out);
  NoGradGuard no_grad;
  Tensor logits = model.forward(batch.inputs, false);  // [B, T, V]
  const int64_t V = logits.size(2), positions = logits.numel() / V;
  const std::vector<double> l = logits.to_vector(), tg = batch.targets.to_vector(), st = batch.stale.to_vector();
  Answers a;
  for (int64_t r = 0; r < positions; ++r) {
    if (tg[r] == kIgnoreIndex) continue;
    int64_t best = 0;
    for (int64_t v = 1; v < V; ++v)
      if (l[r * V + v] > l[r * V + best]) best = v;
    a.predicted.push_back(static_cast<int32_t>(best));
    a.target.push_back(static_cast<int32_t>(tg[r]));
    a.stale.push_back(static_cast<int32_t>(st[r]));
  }
  return a;
}

// max |a - b| / max |b|
bool all_finite(const Tensor& t) {
  for (double x : t.to_vector())
    if (!std::isfinite(x)) return false;
  return true;
}

// A model of the same config in `dtype` holding `src`'s weights (rounded to dtype).
std::unique_ptr<HybridModel> converted(HybridModel& src, DType dtype) {
  HybridConfig c = src.config();
  c.dtype = dtype;
  auto dst = std::make_unique<HybridModel>(c, 0);
  NoGradGuard no_grad;
  ParameterList &a = dst->parameters(), &b = src.parameters();
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].name == b[i].name);
    copy_(a[i].tensor, b[i].tensor.to(dtype));
  }
  return dst;
}

// Logits of ids [B, T] fed one token at a time through forward_cached.
Tensor decode_token_by_token(HybridModel& model, const Tensor& ids) {
  std::unique_ptr<DecodeCache> cache = model.new_cache();
  Tensors parts;
  for (int64_t t = 0; t < ids.size(1); ++t) parts.push_back(model.forward_cached(slice(ids, 1, t, t + 1), *cache));
  REQUIRE(cache->length() == ids.size(1));
  return concat(parts, 1);
}

// Decode = forward on a model in f32 and its f64 copy, on held-out rows of `task`
// (chunk size 16, so the full forward runs the chunked WY/UT form over several
// chunks while decoding runs one recurrent step per token).
//   f64: the two paths differ by rounding only: 1e-10 relative to max |logit|.
//   f32: both paths round at 6e-8 per operation; the difference is that of two
//   summation orders through 2 layers (the KDA kernels agree to ~1e-6 relative,
//   tests/ops/kda/kda_test.cpp), RMSNorm and the LM head, without compounding (every
//   KDA step is non-expansive). Measured 0.8e-6 (random weights) and 1.1e-6
//   (trained); 1e-5 relative to max |logit| leaves ~10x and is far below what a
//   wrong term would give. The argmax must also agree at every answer position.
void check_decode_equals_forward(HybridModel& trained, const SyntheticOptions& task) {
  HybridConfig c = trained.config();
  Generator gen(2000);
  const SyntheticBatch batch = synthetic_batch(task, 3, gen);
  for (DType dtype : {DType::f64, DType::f32}) {
    std::unique_ptr<HybridModel> model = converted(trained, dtype);
    // The same weights with chunks of 16 for the full forward.
    c.dtype = dtype;
    c.kda.chunk_size = 16;
    HybridModel chunked16(c, 0);
    {
      NoGradGuard no_grad;
      for (size_t i = 0; i < chunked16.parameters().size(); ++i)
        copy_(chunked16.parameters()[i].tensor, model->parameters()[i].tensor);
    }
    Tensor full;
    {
      NoGradGuard no_grad;
      full = chunked16.forward(batch.inputs, false);
    }
    const Tensor decoded = decode_token_by_token(*model, batch.inputs);
    const double e = rel_error(decoded, full);
    INFO(dtype_name(dtype) << ": decode vs forward, max |difference| / max |logit| = " << e);
    CHECK(e < (dtype == DType::f64 ? 1e-10 : 1e-5));
    WARN(dtype_name(dtype) << " decode vs forward (T = " << batch.inputs.size(1) << ", chunks of 16): relative "
                           << e);
    // Same decisions at the answer positions.
    const std::vector<double> a = decoded.to_vector(), b = full.to_vector(), tg = batch.targets.to_vector();
    const int64_t V = full.size(2);
    for (size_t r = 0; r < tg.size(); ++r) {
      if (tg[r] == kIgnoreIndex) continue;
      auto argmax = [&](const std::vector<double>& l) {
        return std::max_element(l.begin() + static_cast<int64_t>(r) * V, l.begin() + (static_cast<int64_t>(r) + 1) * V) -
               l.begin();
      };
      CHECK(argmax(a) == argmax(b));
    }
  }
}

// Layer 0's per-channel decay α = e^g for every token of the vocabulary:
// [vocab, HV·K]. Layer 0's mixer reads RMSNorm(embedding) (with AttnRes there is
// nothing but the embedding to read at layer 0), and the gate has no conv, so
// its decay is a function of the current token alone.
std::vector<double> layer0_decay(HybridModel& model) {
  auto param = [&](const std::string& name) {
    for (NamedParameter& p : model.parameters())
      if (p.name == name) return p.tensor;
    FAIL("no parameter " << name);
    return Tensor();
  };
  const std::string p = "model.layers.0.";
  NoGradGuard no_grad;
  const int64_t V = model.config().vocab_size, HV = model.config().kda.value_heads(), K = model.config().kda.head_dim;
  Tensor x = rms_norm(param("model.embed_tokens.weight"), param(p + "input_layernorm.weight"),
                      model.config().rms_norm_eps);  // [V, D]
  Tensor f = linear(linear(x, param(p + "self_attn.f_a_proj.weight")), param(p + "self_attn.f_b_proj.weight"));
  Tensor g = kda_gate(reshape(f, {V, HV, K}), param(p + "self_attn.A_log"), param(p + "self_attn.dt_bias"),
                      model.config().kda.gate, model.config().kda.lower_bound);
  return exp(g).to_vector();
}

}  // namespace

TEST_CASE("seed tasks: associative recall to > 95% held-out accuracy; decoding equals the forward",
          "[nn][seed][slow]") {
  ThreadCountGuard one_thread(1);
  const SyntheticOptions task = task_options(SyntheticTask::assoc_recall);
  HybridModel model(seed_model_config(task.vocab_size()), 1);
  const double before = held_out_answers(model, task, 256).accuracy();
  const double seconds = train(model, task, {.steps = 250});
  const double acc = held_out_answers(model, task, 1024).accuracy();
  WARN("assoc_recall (16 pairs of 32 keys and 32 values, 8 queries): held-out accuracy " << before << " -> " << acc
       << " after 250 steps, " << seconds << " s");
  CHECK(acc > 0.95);
  check_decode_equals_forward(model, task);
}

TEST_CASE("seed tasks: repeated-key replacement (the later value wins) to > 95% held-out accuracy",
          "[nn][seed][slow]") {
  // 16 pairs: 10 distinct keys, 6 of them bound twice; the 6 queries ask the rebound keys.
  ThreadCountGuard one_thread(1);
  const SyntheticOptions task = task_options(SyntheticTask::repeated_key);
  HybridModel model(seed_model_config(task.vocab_size()), 1);
  const double seconds = train(model, task, {.steps = 250});
  const Answers a = held_out_answers(model, task, 1024);
  const double acc = a.accuracy();
  const double earlier = a.fraction([](size_t) { return true; }, [&](size_t i) { return a.predicted[i] == a.stale[i]; });
  WARN("repeated_key (16 pairs, 6 keys rebound, 32 keys and 32 values): held-out accuracy " << acc
       << ", earlier value answered " << earlier << "; 250 steps, " << seconds << " s");
  CHECK(acc > 0.95);
  CHECK(earlier < 0.03);  // below a uniform guess among the 32 values (1/32)
}

TEST_CASE("seed tasks: decoding a random all-KDA model token by token gives the forward's logits", "[nn][seed]") {
  // Untrained weights moved off their init, so every path carries signal; fast
  // enough for the sanitizer run (the trained model is checked in the recall test).
  HybridModel model(seed_model_config(task_options(SyntheticTask::context_switch).vocab_size()), 3);
  {
    NoGradGuard no_grad;
    uint64_t seed = 200;
    for (NamedParameter& p : model.parameters()) add_(p.tensor, randn(p.tensor.shape(), DType::f32, seed++), 0.1);
  }
  check_decode_equals_forward(model, task_options(SyntheticTask::context_switch));
}

TEST_CASE("seed tasks: after a context switch pre-switch bindings are forgotten, new ones recalled",
          "[nn][seed][slow]") {
  // Rows: 8 pairs, the switch token, 8 pairs of which 2 rebind pre-switch keys, then
  // 8 queries: 4 on post-switch keys (answer: the new value) and 4 on pre-switch-only
  // keys (answer: kUnknownToken, "not bound in this context"). Training on these
  // asks the model to drop the old context at the marker.
  // 600 steps: with 400, two of four other model seeds were still on the plateau
  // where every query gets kUnknownToken (post-switch recall 74% and 41%); with 600
  // all of them passed (post-switch recall 98.2-99.9%).
  // Measured on held-out rows: post-switch recall (the new value, rebound keys
  // included) must exceed 95%, and the recall of pre-switch keys (answering their
  // old value) must fall below 5%: a model that kept the old bindings and answered
  // them would score ~100% there, one that guessed a value uniformly ~3% (1/32).
  ThreadCountGuard one_thread(1);
  const SyntheticOptions task = task_options(SyntheticTask::context_switch);
  HybridModel model(seed_model_config(task.vocab_size()), 1);
  const double seconds = train(model, task, {.steps = 600});
  const Answers a = held_out_answers(model, task, 1024);
  auto post = [&](size_t i) { return a.target[i] != kUnknownToken; };
  auto pre_only = [&](size_t i) { return a.target[i] == kUnknownToken; };
  auto rebound = [&](size_t i) { return post(i) && a.stale[i] != kIgnoreIndex; };
  auto correct = [&](size_t i) { return a.predicted[i] == a.target[i]; };
  auto says_stale = [&](size_t i) { return a.predicted[i] == a.stale[i]; };
  const double post_recall = a.fraction(post, correct), rebound_recall = a.fraction(rebound, correct);
  const double pre_recall = a.fraction(pre_only, says_stale), unknown = a.fraction(pre_only, correct);
  const double rebound_stale = a.fraction(rebound, says_stale);
  WARN("context_switch (8 + 8 pairs, 2 rebound): post-switch recall " << post_recall << " (rebound keys "
       << rebound_recall << ", their old value " << rebound_stale << "); pre-switch-only keys: old value "
       << pre_recall << ", kUnknown " << unknown << "; 600 steps, " << seconds << " s");
  // How: layer 0's decay at the switch token against the other tokens.
  const std::vector<double> alpha = layer0_decay(model);
  const int64_t C = static_cast<int64_t>(alpha.size()) / task.vocab_size();
  double switch_max = 0, switch_mean = 0, other_mean = 0;
  for (int64_t d = 0; d < C; ++d) {
    switch_max = std::max(switch_max, alpha[kSwitchToken * C + d]);
    switch_mean += alpha[kSwitchToken * C + d] / static_cast<double>(C);
  }
  for (int64_t v = 2; v < task.vocab_size(); ++v)
    for (int64_t d = 0; d < C; ++d) other_mean += alpha[v * C + d] / static_cast<double>(C * (task.vocab_size() - 2));
  WARN("layer 0 decay e^g at the switch token: mean " << switch_mean << ", max " << switch_max
       << "; at key and value tokens: mean " << other_mean);
  CHECK(post_recall > 0.95);
  CHECK(rebound_recall > 0.9);
  CHECK(pre_recall < 0.05);
  CHECK(unknown > 0.95);
}

TEST_CASE("seed tasks: the model in f32 at T = 65536 stays close to f64", "[nn][seed][slow]") {
  // Random weights moved off their init (0.1 randn on every parameter) with the
  // long-memory gate, so states build up over hundreds of tokens; f32 against an
  // f64 copy of the same weights on one row of 65,536 random tokens.
  // Tolerance: the KDA op alone keeps f32 within ~3e-7 of f64 at this length
  // (tests/ops/kda/kda_long_test.cpp); through 2 layers, norms and the LM head the
  // logits measured 1.2e-6 relative to max |logit|; 1e-5 leaves ~8x while a drift
  // with T, a NaN or a lost chunk state would not pass. The error over the last
  // 4,096 tokens must also stay within 10x that of the first 4,096.
  ThreadCountGuard one_thread(1);
  const int64_t T = 65536, W = 4096, vocab = 66;
  HybridModel m32(seed_model_config(vocab), 5);
  {
    NoGradGuard no_grad;
    uint64_t seed = 100;
    for (NamedParameter& p : m32.parameters()) add_(p.tensor, randn(p.tensor.shape(), DType::f32, seed++), 0.1);
  }
  std::unique_ptr<HybridModel> m64 = converted(m32, DType::f64);
  Generator gen(6);
  const Tensor ids = randint({1, T}, vocab, DType::i32, gen);
  NoGradGuard no_grad;
  const auto start = std::chrono::steady_clock::now();
  const Tensor l32 = m32.forward(ids, false), l64 = m64->forward(ids, false);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  REQUIRE(all_finite(l32));
  const std::vector<double> a = l32.to_vector(), b = l64.to_vector();
  double scale = 0, err = 0, first = 0, last = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t t = static_cast<int64_t>(i) / vocab;
    const double e = std::abs(a[i] - b[i]);
    scale = std::max(scale, std::abs(b[i]));
    err = std::max(err, e);
    if (t < W) first = std::max(first, e);
    if (t >= T - W) last = std::max(last, e);
  }
  CHECK(err / scale < 1e-5);
  CHECK(last <= 10 * first);
  WARN("model f32 vs f64 at T = " << T << ": logits relative error " << err / scale << " (first " << W << " tokens "
                                  << first / scale << ", last " << last / scale << "), both forwards " << seconds
                                  << " s");
}
