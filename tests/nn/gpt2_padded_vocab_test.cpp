// GPT-2 on a padded vocabulary (model.vocab_pad_multiple, docs/model.md#padded-vocabulary):
// the model against the unpadded one of the same seed (parameters, logits, loss,
// gradients; padding rows 0 with gradient 0), training the way a user runs it (the
// CLI: the same loss trajectory to rounding, padding rows still 0), the export's
// vocab_size rows read back by generate, sampling never picking a padding id, and a
// checkpoint resumed with another padding refused with a message saying what to do.
#include <catch2/catch.hpp>

#include <filesystem>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "nn/fixtures.h"
#include "nn/gpt2.h"
#include "nn/gpt2_hf.h"
#include "testing.h"
#include "train/sampling.h"
#include "train/trainer.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;

namespace {

Gpt2Config tiny(int64_t pad_multiple, DType dtype = DType::f64) { return testing::tiny_gpt2(dtype, pad_multiple); }
using testing::random_ids;

using testing::rows_of;

// `moetrain train` of a byte-level GPT-2 with vocab_size 300 (padded to 320 with
// pad = 64), f32, on the shards of prepare_byte_shards(dir).
string train_args(const string& dir, const string& run, int steps, int64_t pad, const string& extra = "") {
  return "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml --set model.vocab_size=300 "
         "--set model.vocab_pad_multiple=" + std::to_string(pad) +
         " --set model.n_layer=2 --set model.n_head=2 --set model.d_model=32 --set model.n_ctx=64 "
         "--set data.tokenizer=byte --set data.train=" + dir + "/data/train_*.bin --set data.val= "
         "--set train.batch_size=4 --set train.seq_len=32 --set train.max_steps=" + std::to_string(steps) +
         " --set train.warmup_steps=2 --set train.eval_every=0 --set train.sample_every=0 --set train.threads=1 "
         "--set train.log_every=1000 --set run.dir=" + run + extra;
}

}  // namespace

TEST_CASE("gpt2 padded vocabulary: the unpadded model's parameters, logits, loss and gradients; padding rows 0",
          "[nn][gpt2][padded_vocab]") {
  Gpt2 plain(tiny(1), 5), padded(tiny(64), 5);
  CHECK(padded.vocab_size() == 37);
  CHECK(padded.padded_vocab_size() == 64);
  CHECK(padded.describe().find("vocab 37 (padded to 64)") != string::npos);
  REQUIRE(plain.parameters().size() == padded.parameters().size());
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    const NamedParameter &a = plain.parameters()[i], &b = padded.parameters()[i];
    INFO(a.name);
    if (a.name == "wte.weight") {
      CHECK(b.tensor.shape() == Shape{64, 8});
      CHECK(rows_of(b.tensor, 0, 37) == rows_of(a.tensor, 0, 37));
      CHECK(rows_of(b.tensor, 37, 64) == std::vector<double>(27 * 8, 0.0));
    } else {
      CHECK(moetrain::testing::bitwise_equal(a.tensor, b.tensor));
    }
  }
  const Tensor ids = random_ids(2, 7, 37, 1), targets = random_ids(2, 7, 37, 2);
  {
    NoGradGuard no_grad;
    const Tensor la = plain.forward(ids, false), lb = padded.forward(ids, false);
    REQUIRE(lb.shape() == Shape{2, 7, 37});
    CHECK(moetrain::testing::max_abs_diff(la, lb) < 1e-12);
    CHECK(padded.forward_padded(ids, false).shape() == Shape{2, 7, 64});
  }
  Tensor loss_a = plain.loss(ids, targets), loss_b = padded.loss(ids, targets);
  CHECK(loss_b.item<double>() == Approx(loss_a.item<double>()).epsilon(1e-13));
  loss_a.backward();
  loss_b.backward();
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    const NamedParameter &a = plain.parameters()[i], &b = padded.parameters()[i];
    INFO(a.name);
    if (a.name == "wte.weight") {
      const std::vector<double> ga = rows_of(a.tensor.grad(), 0, 37), gb = rows_of(b.tensor.grad(), 0, 37);
      for (size_t k = 0; k < ga.size(); ++k) REQUIRE(gb[k] == Approx(ga[k]).margin(1e-13));
      CHECK(rows_of(b.tensor.grad(), 37, 64) == std::vector<double>(27 * 8, 0.0));
    } else {
      CHECK(moetrain::testing::max_abs_diff(a.tensor.grad(), b.tensor.grad()) < 1e-13);
    }
  }
}

TEST_CASE("gpt2 padded vocabulary: sampling never picks a padding id", "[nn][gpt2][padded_vocab]") {
  Gpt2 model(tiny(64, DType::f32), 3);
  {
    // Padding rows far larger than the real ones: a padding logit would win every draw.
    NoGradGuard no_grad;
    Tensor& wte = model.parameters()[0].tensor;
    REQUIRE(model.parameters()[0].name == "wte.weight");
    float* w = wte.data<float>();
    for (int64_t i = 37 * 8; i < 64 * 8; ++i) w[i] = 50.0f;
  }
  for (double temperature : {0.0, 1.0, 5.0}) {
    SamplingOptions o;
    o.max_new_tokens = 12;
    o.temperature = temperature;
    o.seed = 9;
    const std::vector<int32_t> out = generate(model, {1, 2, 3}, o);
    REQUIRE(out.size() == 12);
    for (int32_t id : out) CHECK((id >= 0 && id < 37));
  }
}

TEST_CASE("gpt2 padded vocabulary: HF export writes vocab_size rows and reads back bit for bit",
          "[nn][gpt2][padded_vocab][hf]") {
  TempDir tmp;
  Gpt2 a(tiny(64, DType::f32), 4);
  ExportOptions options;
  options.replace = true;
  export_model_dir(a, {}, tmp.path(), options);
  SafetensorsFile f = SafetensorsFile::open(tmp.path() + "/model.safetensors");
  CHECK(f.entry("wte.weight").shape == Shape{37, 8});
  CHECK(read_gpt2_hf_config(tmp.path() + "/config.json", Gpt2Config{}).vocab_size == 37);
  // Into a padded model (padding rows come back 0) and an unpadded one.
  for (int64_t pad : {64, 1}) {
    DYNAMIC_SECTION("pad " << pad) {
      Gpt2 b(tiny(pad, DType::f32), 8);
      load_hf_weights(b, gpt2_hf_weights_path(tmp.path()));
      for (size_t i = 0; i < a.parameters().size(); ++i) {
        const Tensor &x = a.parameters()[i].tensor, &y = b.parameters()[i].tensor;
        INFO(a.parameters()[i].name);
        if (x.shape() == y.shape()) CHECK(moetrain::testing::bitwise_equal(x, y));
        else CHECK(rows_of(x, 0, 37) == rows_of(y, 0, 37));
      }
    }
  }
}

TEST_CASE("gpt2 padded vocabulary: trained with the CLI it follows the unpadded run; export, generate, and a "
          "resume with another padding", "[nn][gpt2][padded_vocab][cli]") {
  TempDir tmp;
  const string dir = tmp.path();
  moetrain::testing::prepare_byte_shards(dir);
  const int steps = 6;
  const auto plain = moetrain::testing::run_moetrain(train_args(dir, dir + "/plain", steps, 1, " --set ckpt.every=3"));
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  const auto padded = moetrain::testing::run_moetrain(train_args(dir, dir + "/padded", steps, 64));
  INFO(padded.output);
  REQUIRE(padded.code == 0);
  const std::vector<double> want = moetrain::testing::metrics_losses(dir + "/plain"),
                            got = moetrain::testing::metrics_losses(dir + "/padded");
  REQUIRE(want.size() == static_cast<size_t>(steps));
  REQUIRE(got.size() == want.size());
  // The same arithmetic up to the head GEMM's blocking over 300 or 320 columns: f32 rounding.
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-5));
  CHECK(got.back() < got.front());

  // The export holds the 300 real rows; generate reads it into the padded model.
  SafetensorsFile f = SafetensorsFile::open(dir + "/padded/model/model.safetensors");
  CHECK(f.entry("wte.weight").shape == Shape{300, 32});
  const auto gen = moetrain::testing::run_moetrain("generate --checkpoint " + dir +
                                                   "/padded/model --prompt 'ROMEO:' --temperature 0 "
                                                   "--max-new-tokens 8");
  INFO(gen.output);
  CHECK(gen.code == 0);

  // The padding rows are still 0 after training (read through the trainer, in-process).
  {
    Config config = Config::load(dir + "/padded/model/config.resolved.yaml",
                                      {"run.dir=" + dir + "/padded-inproc", "train.max_steps=3"});
    Trainer trainer(config);
    trainer.resume();
    while (!trainer.done()) trainer.train_step();
    const NamedParameter& wte = trainer.model().parameters()[0];
    REQUIRE(wte.name == "wte.weight");
    REQUIRE(wte.tensor.shape() == Shape{320, 32});
    CHECK(rows_of(wte.tensor, 300, 320) == std::vector<double>(20 * 32, 0.0));
    CHECK(rows_of(wte.tensor, 0, 300) != std::vector<double>(300 * 32, 0.0));
  }

  // The unpadded run's checkpoint resumed with padding: refused, saying what to do.
  const auto resumed = moetrain::testing::run_moetrain(
      train_args(dir, dir + "/plain", steps + 3, 64, " --set ckpt.every=3 --set ckpt.resume=auto --set ckpt.schedule_change=apply"));
  INFO(resumed.output);
  CHECK(resumed.code != 0);
  CHECK(resumed.output.find("wte.weight") != string::npos);
  CHECK(resumed.output.find("model.vocab_pad_multiple") != string::npos);
  CHECK(resumed.output.find("model.init_from") != string::npos);
}

TEST_CASE("gpt2 padded vocabulary: model.vocab_pad_multiple 0 is refused by the schema, naming the file, line and key",
          "[nn][gpt2][padded_vocab][errors]") {
  const string zero = moetrain::testing::error_of<ConfigError>(
      [] { Config::load_string("model:\n  vocab_pad_multiple: 0\n", "zero.yaml"); });
  CHECK(zero.find("zero.yaml:2") != string::npos);
  CHECK(zero.find("model.vocab_pad_multiple") != string::npos);
}

TEST_CASE("gpt2 padded vocabulary: GPT-2 small at vocab_pad_multiple 64 (and 128) has 50304 rows and "
          "124,475,904 parameters", "[nn][gpt2][padded_vocab]") {
  for (int64_t pad : {64, 128}) {
    Gpt2Config c;  // GPT-2 small
    c.vocab_pad_multiple = pad;
    Gpt2 model(c, 1, /*allocate=*/false);  // shapes only
    CHECK(model.padded_vocab_size() == 50304);
    int64_t n = 0;
    for (const ParamSpec& s : model.param_specs()) n += s.shape.numel();
    CHECK(n == 124439808 + (50304 - 50257) * 768);  // docs/model.md: 124,475,904
  }
}
