// QK-Clip in the trainer (src/train/qk_clip_step.h, docs/model.md#qk-clip), on
// whole models in f64: after apply_qk_clip with τ below some heads' largest
// logit, the same forward again gives exactly τ for every clipped head of the
// first clipped layer (whose input no clip changed) and the old bits for every
// other head of it; the rows of unclipped heads keep their bits. For GPT-2's
// fused c_attn (with its bias), the hybrid's MLA with and without RoPE, and the
// hybrid's plain attention. Then the optimizer's views: under a sharded
// optimizer (element ranges that cut rows, simulated ranks) each rank scales only
// what it owns and the exchange gives the unsharded result bit for bit; with bf16
// masters the master is scaled and the bf16 copy is its rounding.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "comm/grad_sync.h"
#include "core/grad_mode.h"
#include "moetrain.h"
#include "optim/make_optimizer.h"
#include "testing.h"
#include "train/distributed.h"
#include "train/model_source.h"
#include "train/qk_clip_step.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using std::string;

namespace {

Config gpt2_config(const std::string& dtype = "f64") {
  return Config::load_string(
      "model:\n  vocab_size: 64\n  n_layer: 1\n  n_head: 4\n  d_model: 32\n  n_ctx: 32\n"
      "data:\n  tokenizer: byte\ntrain:\n  dtype: " + dtype + "\n  batch_size: 2\n  seq_len: 16\n",
      "qk.yaml");
}

Config hybrid_config(const std::vector<string>& sets) {
  std::vector<string> all{"model.n_layer=4", "model.attn_res_block_size=2", "train.dtype=f64",
                          "model.vocab_size=64"};
  all.insert(all.end(), sets.begin(), sets.end());
  return Config::load(string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml", all);
}

// The sites' largest logits, per site, in f64 on the host (-inf where none).
std::vector<std::vector<double>> site_logits(LanguageModel& model) {
  std::vector<std::vector<double>> out;
  for (QkClipSite* s : model.qk_clip_sites()) {
    std::vector<double> v(static_cast<size_t>(s->n_head), -std::numeric_limits<double>::infinity());
    if (s->max_logit.defined()) v = s->max_logit.to(kCpu).to(DType::f64).to_vector();
    out.push_back(v);
  }
  return out;
}

// A forward with grad mode on (what records), on fixed ids.
void record_forward(LanguageModel& model, int64_t vocab) {
  Generator g(7);
  const Tensor fixed = randint({2, 16}, vocab, DType::i64, g), targets = randint({2, 16}, vocab, DType::i64, g);
  model.reset_max_logits();
  (void)model.loss(fixed, targets, true);
}

// Scales every query-like weight so that logits grow well past the initial ones.
void inflate(LanguageModel& model, double factor) {
  NoGradGuard no_grad;
  for (QkClipSite* s : model.qk_clip_sites())
    for (const NamedParameter& p : model.parameters())
      if (p.name == s->q_weight) copy_(p.tensor.detach(), mul_scalar(p.tensor.detach(), factor));
}

void check_clip_on_model(const Config& config, double inflate_by) {
  std::unique_ptr<LanguageModel> model = build_model(config);
  const int64_t vocab = config.get_int("model.vocab_size");
  model->set_track_max_logits(true);
  REQUIRE(!model->qk_clip_sites().empty());
  inflate(*model, inflate_by);
  record_forward(*model, vocab);
  const std::vector<std::vector<double>> before = site_logits(*model);
  // τ: between the smallest and the largest head of the first site, so some clip and some do not.
  const std::vector<double>& first = before.front();
  const double lo = *std::min_element(first.begin(), first.end()), hi = *std::max_element(first.begin(), first.end());
  REQUIRE(hi > lo);
  const double tau = (lo + hi) / 2;
  INFO("first site's logits " << lo << " .. " << hi << ", tau " << tau);
  std::vector<Tensor> weights_before;
  for (const NamedParameter& p : model->parameters()) weights_before.push_back(p.tensor.detach().clone());
  const std::unique_ptr<Optimizer> opt = make_optimizer(model->parameters(), {});
  Distributed d = make_distributed(config);
  const QkClipSummary summary = apply_qk_clip(d, *model, *opt, tau);
  int64_t expected_clipped = 0;
  for (const std::vector<double>& site : before)
    expected_clipped += std::count_if(site.begin(), site.end(), [&](double s) { return s > tau; });
  CHECK(summary.clipped_heads == expected_clipped);
  double overall = -std::numeric_limits<double>::infinity();
  for (const std::vector<double>& site : before) overall = std::max(overall, *std::max_element(site.begin(), site.end()));
  CHECK(summary.max_logit == overall);
  CHECK(summary.layers.size() == before.size());
  // The statistics were reset for the next step.
  for (QkClipSite* s : model->qk_clip_sites()) CHECK(!s->max_logit.defined());
  record_forward(*model, vocab);
  const std::vector<double> after = site_logits(*model).front();
  for (size_t h = 0; h < first.size(); ++h) {
    INFO("head " << h << ": before " << first[h] << ", after " << after[h]);
    if (first[h] > tau)
      CHECK(std::abs(after[h] - tau) <= 1e-10 * tau);
    else
      CHECK(after[h] == first[h]);
  }
  // Weights: only the q/k (and bias) tensors of the sites changed.
  std::vector<string> touched;
  for (QkClipSite* s : model->qk_clip_sites())
    for (const string& n : {s->q_weight, s->k_weight, s->q_bias, s->k_bias})
      if (!n.empty()) touched.push_back(n);
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    const NamedParameter& p = model->parameters()[i];
    if (std::find(touched.begin(), touched.end(), p.name) == touched.end())
      CHECK(bitwise_equal(p.tensor.detach(), weights_before[i]));
  }
}

}  // namespace

TEST_CASE("qk_clip step: clipped heads of GPT-2's fused c_attn reach exactly tau, the others keep their bits",
          "[train][qk_clip]") {
  check_clip_on_model(gpt2_config(), 40.0);
}

TEST_CASE("qk_clip step: the hybrid's MLA (with and without RoPE) and plain attention", "[train][qk_clip]") {
  for (const std::vector<string>& sets : {std::vector<string>{}, std::vector<string>{"model.mla.rope=true"},
                                          std::vector<string>{"model.attn_mixer=attention", "model.n_head=4"}}) {
    INFO((sets.empty() ? string("mla") : sets.front()));
    check_clip_on_model(hybrid_config(sets), 60.0);
  }
}

TEST_CASE("qk_clip step: sharded optimizers scale only their owned elements (ranges cutting rows); the exchange "
          "gives the unsharded clip bit for bit", "[train][qk_clip]") {
  const Config config = gpt2_config();
  auto make = [&] {
    std::unique_ptr<LanguageModel> m = build_model(config);
    m->set_track_max_logits(true);
    return m;
  };
  std::unique_ptr<LanguageModel> whole = make();
  std::vector<std::unique_ptr<LanguageModel>> ranks;
  for (int r = 0; r < 3; ++r) ranks.push_back(make());
  std::vector<int64_t> numels;
  for (const NamedParameter& p : whole->parameters()) numels.push_back(p.tensor.numel());
  const comm::FlatShards shards = comm::make_flat_shards(numels, 3);  // element ranges: cuts inside rows
  Distributed d = make_distributed(config);
  // Every copy sees the same statistic: heads 0 and 2 above τ = 10.
  auto set_logits = [](LanguageModel& m) {
    for (QkClipSite* s : m.qk_clip_sites()) s->max_logit = from_vector({25.0, 3.0, 10.5, -1.0}, {4}, DType::f64);
  };
  set_logits(*whole);
  const std::unique_ptr<Optimizer> ref = make_optimizer(whole->parameters(), {});
  CHECK(apply_qk_clip(d, *whole, *ref, 10.0).clipped_heads == 2);
  std::vector<std::unique_ptr<Optimizer>> opts;
  for (int r = 0; r < 3; ++r) {
    std::vector<ElementRange> own;
    for (size_t i = 0; i < numels.size(); ++i) {
      const auto [a, b] = shards.owned(i, r);
      own.push_back({a, b});
    }
    opts.push_back(make_optimizer(ranks[r]->parameters(), {}, own));
    set_logits(*ranks[r]);
    apply_qk_clip(d, *ranks[r], *opts[r], 10.0);
  }
  for (int from = 0; from < 3; ++from)
    for (int to = 0; to < 3; ++to)
      if (from != to)
        for (size_t i = 0; i < numels.size(); ++i)
          copy_(opts[from]->owned_part(i, ranks[to]->parameters()[i].tensor.detach()),
                opts[from]->owned_part(i, ranks[from]->parameters()[i].tensor.detach()));
  for (size_t i = 0; i < numels.size(); ++i) {
    INFO(whole->parameters()[i].name);
    for (int r = 0; r < 3; ++r)
      CHECK(bitwise_equal(ranks[r]->parameters()[i].tensor.detach(), whole->parameters()[i].tensor.detach()));
  }
}

TEST_CASE("qk_clip step: with bf16 masters the f32 master is scaled and the bf16 weight is its rounding",
          "[train][qk_clip][bf16]") {
  const Config config = gpt2_config("f32");
  std::unique_ptr<LanguageModel> model = build_model(config);
  model->set_track_max_logits(true);
  const std::unique_ptr<Optimizer> opt = make_optimizer(model->parameters(), {});
  opt->convert_to_bf16([](const NamedParameter&) { return true; });
  size_t c_attn = 0;
  while (model->parameters()[c_attn].name != "h.0.attn.c_attn.weight") ++c_attn;
  const Tensor master_before = opt->master(c_attn).clone();
  for (QkClipSite* s : model->qk_clip_sites()) s->max_logit = from_vector({400.0, 3.0, 99.0, 100.5}, {4}, DType::f32);
  Distributed d = make_distributed(config);
  CHECK(apply_qk_clip(d, *model, *opt, 100.0).clipped_heads == 2);
  const Tensor master = opt->master(c_attn), w = model->parameters()[c_attn].tensor.detach();
  CHECK(bitwise_equal(w, master.to(DType::bf16)));
  // Head 0's query rows (0..7 of D = 32, hd = 8) by sqrt(100 / 400) = 0.5, exactly; head 1's untouched.
  const int64_t D = 32;
  const std::vector<double> a = master.to_vector(), b = master_before.to_vector();
  for (int64_t row : {0L, 7L, D + 0, D + 7})
    for (int64_t c = 0; c < D; ++c) CHECK(a[row * D + c] == b[row * D + c] * 0.5);
  for (int64_t row : {8L, 15L, 2 * D + 0})  // head 1's query rows, a value row of head 0
    for (int64_t c = 0; c < D; ++c) CHECK(a[row * D + c] == b[row * D + c]);
}
