// The hybrid on a padded vocabulary (model.vocab_pad_multiple, docs/model.md#padded-vocabulary):
// the model against the unpadded one of the same seed, tied and untied head (parameters,
// logits, loss, gradients; padding rows 0 with gradient 0), decoding and sampling on the
// real columns, the pipeline's last stage (loss over the real classes, logits without
// padding), the HF export's vocab_size rows read back into padded and unpadded models,
// training with the Trainer (the unpadded run's losses, padding rows still 0) and the
// CLI (export, generate), a checkpoint resumed with another padding refused, the
// parameter count of k3-small padded, and the key read and range-checked.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "nn/fixtures.h"
#include "nn/hybrid.h"
#include "nn/hybrid_hf.h"
#include "testing.h"
#include "train/sampling.h"
#include "train/trainer.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;

namespace {

// 23 tokens; pad 16 gives 32 rows (9 of padding).
constexpr int64_t kV = 23, kVp = 32, kD = 12;

HybridConfig tiny_padded(int64_t pad_multiple, bool tied, DType dtype = DType::f64) {
  HybridConfig c = testing::tiny_hybrid(dtype, true, true, pad_multiple);
  c.tie_embeddings = tied;
  return c;
}

bool is_vocab_table(const string& name) { return name == "model.embed_tokens.weight" || name == "lm_head.weight"; }


std::vector<double> zero_rows(int64_t n, int64_t width) { return std::vector<double>(static_cast<size_t>(n * width), 0.0); }

const NamedParameter& named(const ParameterList& params, const string& name) {
  for (const NamedParameter& p : params)
    if (p.name == name) return p;
  FAIL("no parameter " << name);
  return params.front();
}

}  // namespace

TEST_CASE("hybrid padded vocabulary: the unpadded model's parameters, logits, loss and gradients; padding rows 0",
          "[nn][hybrid][padded_vocab]") {
  for (bool tied : {false, true}) {
    DYNAMIC_SECTION((tied ? "tied" : "untied") << " head") {
      HybridModel plain(tiny_padded(1, tied), 5), padded(tiny_padded(16, tied), 5);
      CHECK(padded.vocab_size() == kV);
      CHECK(padded.padded_vocab_size() == kVp);
      CHECK(plain.padded_vocab_size() == kV);
      CHECK(padded.describe().find("vocab 23 (padded to 32)") != string::npos);
      REQUIRE(plain.parameters().size() == padded.parameters().size());
      int tables = 0;
      for (size_t i = 0; i < plain.parameters().size(); ++i) {
        const NamedParameter &a = plain.parameters()[i], &b = padded.parameters()[i];
        INFO(a.name);
        REQUIRE(a.name == b.name);
        if (is_vocab_table(a.name)) {
          ++tables;
          CHECK(b.tensor.shape() == Shape{kVp, kD});
          CHECK(testing::rows_of(b.tensor, 0, kV) == testing::rows_of(a.tensor, 0, kV));
          CHECK(testing::rows_of(b.tensor, kV, kVp) == zero_rows(kVp - kV, kD));
        } else {
          CHECK(testing::bitwise_equal(a.tensor, b.tensor));
        }
      }
      CHECK(tables == (tied ? 1 : 2));

      const Tensor ids = testing::random_ids(2, 7, kV, 1), targets = testing::random_ids(2, 7, kV, 2);
      {
        NoGradGuard no_grad;
        const Tensor la = plain.forward(ids, false), lb = padded.forward(ids, false);
        REQUIRE(lb.shape() == Shape{2, 7, kV});
        CHECK(testing::max_abs_diff(la, lb) < 1e-12);
        const Tensor full = padded.forward_padded(ids, false);
        REQUIRE(full.shape() == Shape{2, 7, kVp});
        // The padding columns are x · 0 = 0: the head's rows past V.
        CHECK(slice(full, 2, kV, kVp).contiguous().to_vector() == std::vector<double>(2 * 7 * (kVp - kV), 0.0));
      }
      Tensor loss_a = plain.loss(ids, targets), loss_b = padded.loss(ids, targets);
      CHECK(loss_b.item<double>() == Approx(loss_a.item<double>()).epsilon(1e-13));
      loss_a.backward();
      loss_b.backward();
      for (size_t i = 0; i < plain.parameters().size(); ++i) {
        const NamedParameter &a = plain.parameters()[i], &b = padded.parameters()[i];
        INFO(a.name);
        REQUIRE(b.tensor.grad().defined());
        if (is_vocab_table(a.name)) {
          const std::vector<double> ga = testing::rows_of(a.tensor.grad(), 0, kV), gb = testing::rows_of(b.tensor.grad(), 0, kV);
          for (size_t k = 0; k < ga.size(); ++k) REQUIRE(gb[k] == Approx(ga[k]).margin(1e-13));
          CHECK(testing::rows_of(b.tensor.grad(), kV, kVp) == zero_rows(kVp - kV, kD));
        } else {
          CHECK(testing::max_abs_diff(a.tensor.grad(), b.tensor.grad()) < 1e-13);
        }
      }
    }
  }
}

TEST_CASE("hybrid padded vocabulary: decoding returns the V real columns, as the unpadded model's",
          "[nn][hybrid][padded_vocab]") {
  HybridModel plain(tiny_padded(1, false), 3), padded(tiny_padded(16, false), 3);
  const Tensor ids = testing::random_ids(2, 9, kV, 4);
  std::unique_ptr<DecodeCache> ca = plain.new_cache(), cb = padded.new_cache();
  // A prompt of 5 tokens, then one at a time.
  for (auto [lo, hi] : std::vector<std::pair<int64_t, int64_t>>{{0, 5}, {5, 6}, {6, 7}, {7, 9}}) {
    INFO("tokens " << lo << ".." << hi);
    const Tensor step = slice(ids, 1, lo, hi).contiguous();
    const Tensor la = plain.forward_cached(step, *ca), lb = padded.forward_cached(step, *cb);
    REQUIRE(lb.shape() == Shape{2, hi - lo, kV});
    CHECK(testing::max_abs_diff(la, lb) < 1e-12);
  }
  CHECK(cb->length() == 9);
}

TEST_CASE("hybrid padded vocabulary: sampling never picks a padding id", "[nn][hybrid][padded_vocab]") {
  for (bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied"));
    HybridModel model(tiny_padded(16, tied, DType::f32), 3);
    {
      // Padding rows of the head far larger than the real ones: a padding logit would win every draw.
      NoGradGuard no_grad;
      const Tensor& head = named(model.parameters(), tied ? "model.embed_tokens.weight" : "lm_head.weight").tensor;
      float* w = head.data<float>();
      for (int64_t i = kV * kD; i < kVp * kD; ++i) w[i] = 50.0f;
    }
    for (double temperature : {0.0, 1.0, 5.0}) {
      SamplingOptions o;
      o.max_new_tokens = 10;
      o.temperature = temperature;
      o.seed = 9;
      const std::vector<int32_t> out = generate(model, {1, 2, 3}, o);
      REQUIRE(out.size() == 10);
      for (int32_t id : out) CHECK((id >= 0 && id < kV));
    }
  }
}

TEST_CASE("hybrid padded vocabulary: the pipeline's last stage computes the loss over the real classes and gives "
          "V logits", "[nn][hybrid][padded_vocab]") {
  const HybridConfig c = tiny_padded(16, false);
  HybridModel whole(c, 6), first(c, 6, true, {}, PipelineStage{0, 2}), last(c, 6, true, {}, PipelineStage{1, 2});
  const Tensor ids = testing::random_ids(2, 6, kV, 7), targets = testing::random_ids(2, 6, kV, 8);
  NoGradGuard no_grad;
  const StageOutput a = first.stage_forward(ids, {}, Tensor(), false);
  const StageOutput with_targets = last.stage_forward(Tensor(), a.activations, targets, false);
  const StageOutput logits = last.stage_forward(Tensor(), a.activations, Tensor(), false);
  CHECK(with_targets.loss.item<double>() == Approx(whole.loss(ids, targets, false).item<double>()).epsilon(1e-13));
  REQUIRE(logits.logits.shape() == Shape{2, 6, kV});
  CHECK(testing::max_abs_diff(logits.logits, whole.forward(ids, false)) < 1e-12);
}

TEST_CASE("hybrid padded vocabulary: HF export writes vocab_size rows; padded and unpadded models read it back",
          "[nn][hybrid][padded_vocab][hf]") {
  for (bool tied : {false, true}) {
    DYNAMIC_SECTION((tied ? "tied" : "untied") << " head") {
      TempDir tmp;
      HybridModel a(tiny_padded(16, tied, DType::f32), 4);
      ExportOptions options;
      options.replace = true;
      export_model_dir(a, {}, tmp.path(), options);
      SafetensorsFile f = SafetensorsFile::open(tmp.path() + "/model.safetensors");
      CHECK(f.entry("model.embed_tokens.weight").shape == Shape{kV, kD});
      CHECK(f.entry("lm_head.weight").shape == Shape{kV, kD});  // a tied model's is a copy
      CHECK(read_hybrid_hf_config(tmp.path() + "/config.json").vocab_size == kV);
      const Tensor ids = testing::random_ids(2, 6, kV, 5);
      const Tensor want = a.forward(ids, false);
      for (int64_t pad : {16, 1}) {
        INFO("pad " << pad);
        HybridModel b(tiny_padded(pad, tied, DType::f32), 8);
        if (pad > 1) {
          // Padding rows made non-zero first: the import must set them to 0.
          NoGradGuard no_grad;
          for (const NamedParameter& p : b.parameters())
            if (is_vocab_table(p.name)) copy_(slice(p.tensor.detach(), 0, kV, kVp), ones({kVp - kV, kD}, DType::f32));
        }
        load_hf_weights(b, tmp.path());
        for (size_t i = 0; i < a.parameters().size(); ++i) {
          const Tensor &x = a.parameters()[i].tensor, &y = b.parameters()[i].tensor;
          INFO(a.parameters()[i].name);
          if (is_vocab_table(a.parameters()[i].name)) {
            CHECK(testing::rows_of(y, 0, kV) == testing::rows_of(x, 0, kV));
            if (pad > 1) CHECK(testing::rows_of(y, kV, kVp) == zero_rows(kVp - kV, kD));
          } else {
            CHECK(testing::bitwise_equal(x, y));
          }
        }
        CHECK(testing::bitwise_equal(b.forward(ids, false), want));
      }
      // A model of another vocabulary: the error names the tensor and both row counts.
      HybridConfig other = tiny_padded(16, tied, DType::f32);
      other.vocab_size = 24;
      HybridModel c(other, 8);
      const string what = testing::error_of([&] { load_hf_weights(c, tmp.path()); });
      CHECK(what.find("model.embed_tokens.weight is [23, 12] but the model expects [24, 12]") != string::npos);
      CHECK(what.find("model.vocab_size 24; the model pads it to 32 rows") != string::npos);
    }
  }
}

TEST_CASE("hybrid padded vocabulary: trained with the Trainer it follows the unpadded run, padding rows stay 0; a "
          "resume with another padding is refused", "[nn][hybrid][padded_vocab]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  // k3-tiny cut to 4 layers, vocab_size 300 (the bytes use 256) padded to 320 with 64; f64.
  auto config = [&](int64_t pad, const string& run, const std::vector<string>& extra = {}) {
    std::vector<string> sets = {
        "data.train=" + dir + "/data/train_*.bin", "data.val=", "train.max_steps=4", "train.warmup_steps=1",
        "train.batch_size=2", "train.seq_len=16", "train.eval_every=0", "train.threads=1", "train.log_every=100",
        "model.n_layer=4", "model.attn_res_block_size=2", "model.vocab_size=300", "train.dtype=f64",
        "model.vocab_pad_multiple=" + std::to_string(pad), "ckpt.every=2", "run.dir=" + dir + "/" + run};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return Config::load(string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml", sets);
  };
  std::vector<double> losses[2];
  for (int64_t pad : {1, 64}) {
    INFO("pad " << pad);
    Trainer trainer(config(pad, pad == 1 ? "plain" : "padded"));
    trainer.resume();
    while (!trainer.done()) {
      losses[pad == 1 ? 0 : 1].push_back(trainer.train_step().loss);
      trainer.poll_saves();
      if (trainer.checkpoint_due()) trainer.save();  // steps 2 and 4, as train() saves them
    }
    trainer.finish();
    const ParameterList& params = trainer.model().parameters();
    CHECK(trainer.model().padded_vocab_size() == (pad == 1 ? 300 : 320));
    for (const char* name : {"model.embed_tokens.weight", "lm_head.weight"}) {
      INFO(name);
      const Tensor& t = named(params, name).tensor;
      REQUIRE(t.shape() == Shape{trainer.model().padded_vocab_size(), 64});
      if (pad > 1) CHECK(testing::rows_of(t, 300, 320) == zero_rows(20, 64));
      CHECK(testing::rows_of(t, 0, 300) != zero_rows(300, 64));
    }
  }
  REQUIRE(losses[0].size() == 4);
  REQUIRE(losses[1].size() == 4);
  // The same arithmetic up to the head GEMM's blocking over 300 or 320 columns: f64 rounding.
  for (size_t i = 0; i < 4; ++i) CHECK(losses[1][i] == Approx(losses[0][i]).epsilon(1e-10));
  CHECK(losses[0].back() < losses[0].front());

  // The unpadded run's checkpoint resumed with padding: refused, saying what to do.
  const string what = testing::error_of([&] {
    Trainer trainer(config(64, "plain", {"ckpt.resume=auto", "train.max_steps=6", "ckpt.schedule_change=apply"}));
    trainer.resume();
  });
  CHECK(what.find("params/model.embed_tokens.weight") != string::npos);
  CHECK(what.find("model.vocab_pad_multiple sets the rows of model.embed_tokens.weight and lm_head.weight") !=
        string::npos);
  CHECK(what.find("model.init_from") != string::npos);
  // The padded run's checkpoint (300 ids in 320 rows) resumed as an unpadded 320-id
  // vocabulary: the same shapes, so only the saved vocab_size can tell.
  const string silent = testing::error_of([&] {
    Trainer trainer(config(1, "padded", {"ckpt.resume=auto", "train.max_steps=6", "ckpt.schedule_change=apply",
                                         "model.vocab_size=320"}));
    trainer.resume();
  });
  CHECK(silent.find("model.vocab_size") != string::npos);
  CHECK(silent.find("is 320 but") != string::npos);
  CHECK(silent.find("saved with 300") != string::npos);
}

TEST_CASE("hybrid padded vocabulary: the CLI trains a padded k3-tiny, exports vocab_size rows and generates from "
          "the export", "[nn][hybrid][padded_vocab][cli]") {
  TempDir tmp;
  const string dir = tmp.path();
  testing::prepare_byte_shards(dir);
  const auto trained = testing::run_moetrain(
      "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set model.vocab_size=300 "
      "--set model.vocab_pad_multiple=64 --set model.n_layer=4 --set model.attn_res_block_size=2 --set data.train=" +
      dir + "/data/train_*.bin --set data.val= --set train.batch_size=2 --set train.seq_len=16 "
      "--set train.max_steps=20 --set train.warmup_steps=1 --set train.eval_every=0 --set train.threads=1 "
      "--set run.dir=" + dir + "/run");
  INFO(trained.output);
  REQUIRE(trained.code == 0);
  CHECK(trained.output.find("vocab 300 (padded to 320)") != string::npos);
  SafetensorsFile f = SafetensorsFile::open(dir + "/run/model/model.safetensors");
  CHECK(f.entry("model.embed_tokens.weight").shape == Shape{300, 64});
  CHECK(f.entry("lm_head.weight").shape == Shape{300, 64});
  // generate builds the padded model of config.resolved.yaml and reads the 300 rows into it
  // (20 steps push the logits of the ids the bytes never use, 256..299, below the bytes').
  const auto gen = testing::run_moetrain("generate --checkpoint " + dir +
                                         "/run/model --prompt 'ROMEO:' --temperature 0 --max-new-tokens 8");
  INFO(gen.output);
  CHECK(gen.code == 0);
  CHECK(gen.output.find("ROMEO:") != string::npos);
}

TEST_CASE("hybrid padded vocabulary: k3-small's vocabulary as 50257 padded to 50304 has k3-small's 67,105,636 "
          "parameters", "[nn][hybrid][padded_vocab]") {
  const Config config = Config::load(string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml",
                                     {"model.vocab_size=50257", "model.vocab_pad_multiple=64"});
  HybridModel model(HybridConfig::from(config), 1, /*allocate=*/false);  // shapes only
  CHECK(model.vocab_size() == 50257);
  CHECK(model.padded_vocab_size() == 50304);
  int64_t n = 0;
  for (const ParamSpec& s : model.param_specs()) n += s.shape.numel();
  CHECK(n == 67105636);  // docs/model.md#shipped-configs, k3-small (vocab_size 50304)
}

TEST_CASE("hybrid padded vocabulary: model.vocab_pad_multiple is read; 0 and -3 are errors naming the key",
          "[nn][hybrid][padded_vocab][errors]") {
  const Config config = Config::load_string("model:\n  arch: hybrid\n  vocab_size: 300\n  vocab_pad_multiple: 64\n",
                                            "pad.yaml");
  const HybridConfig c = HybridConfig::from(config);
  CHECK(c.vocab_size == 300);
  CHECK(c.vocab_pad_multiple == 64);
  CHECK(c.padded_vocab_size() == 320);
  CHECK(HybridConfig::from(Config::load_string("model:\n  arch: hybrid\n  vocab_size: 256\n", "default.yaml"))
            .padded_vocab_size() == 256);
  for (const char* bad : {"0", "-3"}) {
    INFO(bad);
    const string what = testing::error_of<ConfigError>([&] {
      HybridConfig::from(Config::load_string(
          string("model:\n  arch: hybrid\n  vocab_size: 300\n  vocab_pad_multiple: ") + bad + "\n", "bad.yaml"));
    });
    CHECK(what.find("bad.yaml:4") != string::npos);
    CHECK(what.find("model.vocab_pad_multiple") != string::npos);
  }
}
