// Config: defaults, files, includes, overrides, set(), the error messages
// (file:line:column, key, expectation, fix), the resolved YAML, its hash, saving,
// and the configs shipped in configs/. Expected messages are spelled out whole.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "config/config.h"
#include "config/temp_dir.h"

using namespace moetrain;
using moetrain::testing::config_error;
using moetrain::testing::TempDir;
using moetrain::testing::error_of;
using moetrain::testing::run_command;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The message of loading `yaml` as bad.yaml in `dir`, with `overrides`.
std::string load_error(const TempDir& dir, const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  std::string path = dir.write("bad.yaml", yaml);
  return config_error([&] { Config::load(path, overrides); });
}

}  // namespace

TEST_CASE("config: defaults fill every key and say so", "[config]") {
  Config c = Config::defaults();
  CHECK(c.get_int("model.n_layer") == 12);
  CHECK(c.get_int("model.vocab_size") == 50257);
  CHECK(c.get_number("model.layer_norm_eps") == 1e-5);
  CHECK(c.get_number("train.lr") == 6e-4);
  CHECK(c.get_bool("train.decay_embeddings") == false);
  CHECK(c.get_string("data.tokenizer") == "gpt2");
  CHECK(c.get_string("train.sample_prompt") == "\n");
  CHECK(c.get_string("model.init_from").empty());
  CHECK(c.where("model.n_layer") == "default");
  CHECK_FALSE(c.is_set_explicitly("model.n_layer"));
}

TEST_CASE("config: a file sets values; where() names file:line:column of the key", "[config]") {
  TempDir dir;
  std::string path = dir.write("run.yaml",
                               "# a comment\n"
                               "model:\n"
                               "  n_layer: 4\n"
                               "  d_model: 192\n"
                               "train: {lr: 1.0e-3, decay_embeddings: true}\n"
                               "data:\n"
                               "  train: 'data/x/train_*.bin'\n"
                               "  val: data/x/val_*.bin\n"
                               "run.dir: runs/x    # a dotted key at the top level\n");
  Config c = Config::load(path);
  CHECK(c.get_int("model.n_layer") == 4);
  CHECK(c.get_int("model.d_model") == 192);
  CHECK(c.get_number("train.lr") == 1e-3);
  CHECK(c.get_bool("train.decay_embeddings"));
  CHECK(c.get_string("data.train") == "data/x/train_*.bin");
  CHECK(c.get_string("data.val") == "data/x/val_*.bin");
  CHECK(c.get_string("run.dir") == "runs/x");
  CHECK(c.where("model.n_layer") == path + ":3:3");
  CHECK(c.where("train.lr") == path + ":5:9");
  CHECK(c.where("run.dir") == path + ":9:1");
  CHECK(c.is_set_explicitly("model.n_layer"));
  CHECK_FALSE(c.is_set_explicitly("model.n_head"));
  CHECK(c.where("model.n_head") == "default");
  CHECK(c.get_int("model.n_head") == 12);
}

TEST_CASE("config: empty files and empty sections are fine", "[config]") {
  TempDir dir;
  CHECK(Config::load(dir.write("empty.yaml", "")).to_yaml() == Config::defaults().to_yaml());
  CHECK(Config::load(dir.write("comments.yaml", "# nothing yet\n")).to_yaml() == Config::defaults().to_yaml());
  Config c = Config::load(dir.write("sections.yaml", "model:\n  # n_layer: 4\ntrain:\n"));
  CHECK(c.get_int("model.n_layer") == 12);
}

TEST_CASE("config: includes merge deeply; defaults < includes < file < overrides", "[config]") {
  TempDir dir;
  std::string base = dir.write("base.yaml",
                               "model:\n"
                               "  n_layer: 2\n"
                               "  n_head: 2\n"
                               "  d_model: 64\n"
                               "train:\n"
                               "  lr: 1.0e-3\n"
                               "  batch_size: 4\n");
  // parts/mid.yaml reaches base.yaml relative to itself, not to the top file.
  std::string mid = dir.write("parts/mid.yaml",
                              "include: [../base.yaml, extra.yaml]\n"
                              "model:\n"
                              "  n_layer: 3\n"
                              "  d_model: 128\n");
  std::string extra = dir.write("parts/extra.yaml",
                                "train:\n"
                                "  batch_size: 5\n"
                                "  seed: 7\n");
  std::string top = dir.write("top.yaml",
                              "model:\n"
                              "  n_layer: 6\n"
                              "train:\n"
                              "  seed: 8\n"
                              "include: parts/mid.yaml   # read first wherever it stands\n");
  Config c = Config::load(top, {"train.seed=9"});
  CHECK(c.get_int("model.n_layer") == 6);    // top file over mid over base
  CHECK(c.where("model.n_layer") == top + ":2:3");
  CHECK(c.get_int("model.d_model") == 128);  // mid over base
  CHECK(c.where("model.d_model") == mid + ":4:3");
  CHECK(c.get_int("model.n_head") == 2);     // only base sets it: the model maps merge
  CHECK(c.where("model.n_head") == base + ":3:3");
  CHECK(c.get_number("train.lr") == 1e-3);
  CHECK(c.get_int("train.batch_size") == 5);  // the later include of a list wins
  CHECK(c.where("train.batch_size") == extra + ":2:3");
  CHECK(c.get_int("train.seed") == 9);        // the override wins over all files
  CHECK(c.where("train.seed") == "--set train.seed=9");
  CHECK(c.get_int("model.n_ctx") == 1024);    // nobody sets it
  CHECK(c.where("model.n_ctx") == "default");

  // The same file included twice along different paths is no cycle.
  std::string diamond = dir.write("diamond.yaml", "include: [base.yaml, parts/../base.yaml]\n");
  CHECK(Config::load(diamond).get_int("model.n_layer") == 2);
}

TEST_CASE("config: overrides parse YAML scalars; the last one wins", "[config]") {
  TempDir dir;
  std::string path = dir.write("run.yaml", "model:\n  n_layer: 4\ndata:\n  val: data/v.bin\n");
  Config c = Config::load(path, {"model.n_layer=6", "model.n_layer = 8", "train.lr=3e-4", "data.val=",
                                 "train.sample_prompt='To be: or not'", "train.decay_embeddings=true",
                                 "data.tokenizer_dir=a=b"});
  CHECK(c.get_int("model.n_layer") == 8);
  CHECK(c.where("model.n_layer") == "--set model.n_layer = 8");
  CHECK(c.get_number("train.lr") == 3e-4);
  CHECK(c.get_string("data.val").empty());  // an empty value clears a string
  CHECK(c.is_set_explicitly("data.val"));
  CHECK(c.get_string("train.sample_prompt") == "To be: or not");
  CHECK(c.get_bool("train.decay_embeddings"));
  CHECK(c.get_string("data.tokenizer_dir") == "a=b");  // split at the first '='

  Config d = Config::defaults();
  d.apply_overrides({"model.n_head=8", "model.d_model=512"});  // checked together
  CHECK(d.get_int("model.d_model") == 512);
  CHECK(d.where("model.n_head") == "--set model.n_head=8");
}

TEST_CASE("config: set() validates like an override and records its origin", "[config]") {
  Config c = Config::defaults();
  c.set("model.n_layer", "24", "huggingface config.json");
  CHECK(c.get_int("model.n_layer") == 24);
  CHECK(c.where("model.n_layer") == "huggingface config.json");
  CHECK(c.is_set_explicitly("model.n_layer"));

  // d_model and n_head only agree together: one at a time fails, both at once work.
  CHECK(config_error([&] { c.set("model.d_model", "1024", "huggingface config.json"); }) ==
        "huggingface config.json: model.d_model = 1024: must be a multiple of model.n_head = 12 (default); "
        "use e.g. 1020 or 1032, or change model.n_head");
  CHECK(c.get_int("model.d_model") == 768);  // a failed set changes nothing
  CHECK(c.where("model.d_model") == "default");
  c.set({{"model.d_model", "1024"}, {"model.n_head", "16"}}, "huggingface config.json");
  CHECK(c.get_int("model.d_model") == 1024);
  CHECK(c.get_int("model.n_head") == 16);

  CHECK(config_error([&] { c.set("model.n_embd", "1024", "huggingface config.json"); }) ==
        "huggingface config.json: unknown key 'model.n_embd'; section 'model' has: arch, vocab_size, vocab_pad_multiple, n_layer, "
        "n_head, d_model, n_ctx, d_ff, layer_norm_eps, dropout, init_std, init_from, mixer, attn_mixer, "
            "attn_every, attn_offset, attn_last, layer_mixers, ffn, situ_beta, situ_linear_beta, "
            "situ_learnable_beta, attn_res, attn_res_block_size, tie_embeddings, rms_norm_eps, embed_init_std, "
            "kda, mla, moe");
  CHECK(config_error([&] { c.set("train.dtype", "int8", "checkpoint"); }) ==
        "checkpoint: train.dtype: expected one of f32, f64, bf16, got 'int8'");
}

TEST_CASE("config: unknown keys suggest the nearest key, also across sections", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  n_layre: 4\n") ==
        bad + ":2:3: unknown key 'model.n_layre' (did you mean 'model.n_layer'?)");
  CHECK(load_error(dir, "model:\n  n_layers: 4\n") ==
        bad + ":2:3: unknown key 'model.n_layers' (did you mean 'model.n_layer'?)");
  CHECK(load_error(dir, "n_layer: 4\n") == bad + ":1:1: unknown key 'n_layer' (did you mean 'model.n_layer'?)");
  CHECK(load_error(dir, "train:\n  n_layer: 4\n") ==
        bad + ":2:3: unknown key 'train.n_layer' (did you mean 'model.n_layer'?)");
  CHECK(load_error(dir, "train:\n  warmup: 4\n") ==
        bad + ":2:3: unknown key 'train.warmup' (did you mean 'train.warmup_steps'?)");
  CHECK(load_error(dir, "modle:\n  n_layer: 4\n") == bad + ":1:1: unknown section 'modle' (did you mean 'model'?)");
  CHECK(load_error(dir, "optimizer:\n  lr: 1\n") ==
        bad + ":1:1: unknown section 'optimizer'; the sections are: model, data, train, run, ckpt, dist, fault");
  CHECK(load_error(dir, "model:\n  d_model: 64\n  attention_kind: flash\n") ==
        bad + ":3:3: unknown key 'model.attention_kind'; section 'model' has: arch, vocab_size, vocab_pad_multiple, n_layer, n_head, "
              "d_model, n_ctx, d_ff, layer_norm_eps, dropout, init_std, init_from, mixer, attn_mixer, attn_every, "
                "attn_offset, attn_last, layer_mixers, ffn, situ_beta, situ_linear_beta, situ_learnable_beta, "
                "attn_res, attn_res_block_size, tie_embeddings, rms_norm_eps, embed_init_std, kda, mla, moe");
}

TEST_CASE("config: wrong types say what was expected and what was found", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  n_layer: twelve\n") == bad + ":2:3: model.n_layer: expected an integer, got 'twelve'");
  CHECK(load_error(dir, "model:\n  n_layer: 12.5\n") == bad + ":2:3: model.n_layer: expected an integer, got '12.5'");
  CHECK(load_error(dir, "model:\n  n_layer: 99999999999999999999\n") ==
        bad + ":2:3: model.n_layer: expected an integer, got '99999999999999999999' (outside the 64-bit range)");
  CHECK(load_error(dir, "model:\n  n_layer: \"12\"\n") ==
        bad + ":2:3: model.n_layer: expected an integer, got the quoted string '12' (remove the quotes)");
  CHECK(load_error(dir, "model:\n  n_layer:\n") == bad + ":2:3: model.n_layer: expected an integer, got an empty value");
  CHECK(load_error(dir, "model:\n  n_layer: [1, 2]\n") == bad + ":2:3: model.n_layer: expected an integer, got a list");
  CHECK(load_error(dir, "train:\n  lr: fast\n") == bad + ":2:3: train.lr: expected a number, got 'fast'");
  CHECK(load_error(dir, "train:\n  lr: .inf\n") == bad + ":2:3: train.lr: expected a number, got '.inf'");
  CHECK(load_error(dir, "train:\n  lr: nan\n") == bad + ":2:3: train.lr: expected a finite number, got 'nan'");
  CHECK(load_error(dir, "train:\n  decay_embeddings: yes\n") ==
        bad + ":2:3: train.decay_embeddings: expected true or false, got 'yes'");
  CHECK(load_error(dir, "data:\n  val:\n") ==
        bad + ":2:3: data.val: expected a string, got an empty value (write '' for an empty string)");
  CHECK(load_error(dir, "data:\n  val: {a: 1}\n") == bad + ":2:3: data.val: expected a string, got a map");
}

TEST_CASE("config: values out of range name the range", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  n_layer: 0\n") == bad + ":2:3: model.n_layer = 0: must be in [1, 4096]");
  CHECK(load_error(dir, "model:\n  n_layer: 5000\n") == bad + ":2:3: model.n_layer = 5000: must be in [1, 4096]");
  CHECK(load_error(dir, "model:\n  vocab_size: -3\n") == bad + ":2:3: model.vocab_size = -3: must be in [1, 2147483647]");
  CHECK(load_error(dir, "model:\n  dropout: 1.0\n") == bad + ":2:3: model.dropout = 1.0: must be in [0, 1)");
  CHECK(load_error(dir, "train:\n  lr: 0\n") == bad + ":2:3: train.lr = 0: must be > 0");
  CHECK(load_error(dir, "train:\n  wsd_decay_frac: 1.5\n") == bad + ":2:3: train.wsd_decay_frac = 1.5: must be in [0, 1]");
  // The bounds themselves, where they are allowed.
  TempDir ok;
  Config c = Config::load(ok.write("edges.yaml",
                                   "model: {n_layer: 4096, dropout: 0, d_ff: 0}\n"
                                   "train: {wsd_decay_frac: 1, beta1: 0, min_lr: 0, grad_clip: 0}\n"));
  CHECK(c.get_int("model.n_layer") == 4096);
  CHECK(c.get_number("train.wsd_decay_frac") == 1.0);
}

TEST_CASE("config: choices are listed when the value is not one of them", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  arch: bpe\n") == bad + ":2:3: model.arch: expected one of gpt2, hybrid, got 'bpe'");
  CHECK(load_error(dir, "model:\n  arch: GPT2\n") ==
        bad + ":2:3: model.arch: expected one of gpt2, hybrid, got 'GPT2' (did you mean 'gpt2'?)");
  CHECK(load_error(dir, "train:\n  schedule: cosin\n") ==
        bad + ":2:3: train.schedule: expected one of cosine, wsd, linear, constant, got 'cosin' (did you mean 'cosine'?)");
}

TEST_CASE("config: the structure of the file is checked", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model: 5\n") == bad + ":1:1: model is a section and needs its keys indented below it "
                                               "(e.g. '  arch: ...'), got '5'");
  CHECK(load_error(dir, "train:\n  - lr: 1\n") == bad + ":1:1: train is a section and needs its keys indented "
                                                        "below it (e.g. '  seed: ...'), got a list");
  CHECK(load_error(dir, "- model\n") ==
        bad + ":1:1: expected a map of sections (model, data, train, run, ckpt, dist, fault) at the top of the file, got a list");
  CHECK(load_error(dir, "model:\n  n_layer: 4\n  n_layer: 5\n") ==
        bad + ":3:3: model.n_layer appears twice in this file (first at " + bad + ":2:3); keep one");
  CHECK(load_error(dir, "model:\n  n_layer: 4\ntrain: {}\nmodel:\n  n_head: 4\n") ==
        bad + ":4:1: model appears twice in this file (first at " + bad + ":1:1); keep one");
  CHECK(load_error(dir, "model.n_layer: 4\nmodel:\n  n_layer: 5\n") ==
        bad + ":3:3: model.n_layer appears twice in this file (first at " + bad + ":1:1); keep one");
}

TEST_CASE("config: bad YAML syntax names the place the parser stopped", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  n_layer: 4\n   n_head: 2\n") == bad + ":3:10: invalid YAML: illegal map value");
  CHECK(load_error(dir, "model:\n  n_layer: [4\ntrain:\n  lr: 1\n") ==
        bad + ":3:6: invalid YAML: end of sequence flow not found");
  CHECK(load_error(dir, "model:\n\tn_layer: 2\n") == bad + ":2:9: invalid YAML: illegal map value");  // a tab
  CHECK(load_error(dir, "run:\n  dir: @x\n") == bad + ":2:8: invalid YAML: unknown token");
  CHECK(load_error(dir, "run:\n  dir: *x\n") == bad + ":2:8: invalid YAML: the referenced anchor is not defined");
}

TEST_CASE("config: includes that are missing, malformed or cyclic", "[config][errors]") {
  TempDir dir;
  std::string a = dir.write("a.yaml", "include: b.yaml\nmodel: {n_layer: 2}\n");
  std::string b = dir.write("b.yaml", "train: {lr: 1.0e-3}\ninclude:\n  - c.yaml\n");
  std::string c = dir.write("c.yaml", "include: a.yaml\n");
  CHECK(config_error([&] { Config::load(a); }) ==
        c + ":1:10: include cycle: " + a + " -> " + b + " -> " + c + " -> " + a + "; remove one of these includes");
  std::string self = dir.write("self.yaml", "include: ./self.yaml\n");
  CHECK(config_error([&] { Config::load(self); }) ==
        self + ":1:10: include cycle: " + self + " -> " + self + "; remove one of these includes");

  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "include: [base.yaml]\n") ==
        bad + ":1:11: include file '" + dir.path() + "/base.yaml' not found (include paths are relative to the "
              "including file)");
  CHECK(load_error(dir, "include: {file: base.yaml}\n") ==
        bad + ":1:1: include: expected a file name or a list of file names, got a map");
  CHECK(load_error(dir, "include:\n") == bad + ":1:1: include: expected a file name or a list of file names, got an empty value");
  // An error inside an included file names that file.
  std::string inc = dir.write("inc.yaml", "include: broken.yaml\n");
  std::string broken = dir.write("broken.yaml", "model:\n  n_head: many\n");
  CHECK(config_error([&] { Config::load(inc); }) == broken + ":2:3: model.n_head: expected an integer, got 'many'");

  CHECK(config_error([&] { Config::load(dir.path() + "/none.yaml"); })
            .starts_with("config file '" + dir.path() + "/none.yaml' not found (relative paths start at the current directory, "));
  CHECK(config_error([&] { Config::load(dir.path()); }) ==
        dir.path() + ": not a regular file (a directory); expected a YAML config file");
}

TEST_CASE("config: bad overrides", "[config][errors]") {
  TempDir dir;
  std::string path = dir.write("ok.yaml", "model: {n_layer: 2}\n");
  auto override_error = [&](const std::string& o) { return config_error([&] { Config::load(path, {o}); }); };
  CHECK(override_error("foo") == "--set expects key=value, got 'foo' (e.g. --set model.n_layer=4)");
  CHECK(override_error("=4") == "--set expects key=value, got '=4' (e.g. --set model.n_layer=4)");
  CHECK(override_error("model.n_layr=4") ==
        "--set model.n_layr=4: unknown key 'model.n_layr' (did you mean 'model.n_layer'?)");
  CHECK(override_error("n_head=4") == "--set n_head=4: unknown key 'n_head' (did you mean 'model.n_head'?)");
  CHECK(override_error("model=4") == "--set model=4: model is a section; set one of its keys, e.g. model.arch");
  CHECK(override_error("model.n_layer=four") == "--set model.n_layer=four: model.n_layer: expected an integer, got 'four'");
  CHECK(override_error("model.n_layer=") == "--set model.n_layer=: model.n_layer: expected an integer, got an empty value");
  CHECK(override_error("model.n_layer=0") == "--set model.n_layer=0: model.n_layer = 0: must be in [1, 4096]");
  CHECK(override_error("data.val=a: b") ==
        "--set data.val=a: b: data.val: expected a single value, got a map (quote the value to make it a string)");
  CHECK(override_error("data.val=[x") .starts_with("--set data.val=[x: data.val: cannot read '[x' as a YAML value ("));
  // A good override does not excuse a bad value in the file: that is still reported.
  std::string bad = dir.write("bad.yaml", "model: {n_layer: 0}\n");
  CHECK(config_error([&] { Config::load(bad, {"model.n_layer=2"}); }) ==
        bad + ":1:9: model.n_layer = 0: must be in [1, 4096]");
}

TEST_CASE("config: cross-key checks report at the key to change, naming the other", "[config][errors]") {
  TempDir dir;
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "model:\n  d_model: 100\n") ==
        bad + ":2:3: model.d_model = 100: must be a multiple of model.n_head = 12 (default); use e.g. 96 or 108, "
              "or change model.n_head");
  CHECK(load_error(dir, "model:\n  n_head: 32\n  d_model: 16\n") ==
        bad + ":3:3: model.d_model = 16: must be a multiple of model.n_head = 32 (" + bad +
              ":2:3); use e.g. 32, or change model.n_head");
  CHECK(load_error(dir, "train:\n  seq_len: 2048\n") ==
        bad + ":2:3: train.seq_len = 2048: must be <= model.n_ctx = 1024 (default); lower train.seq_len or raise "
              "model.n_ctx");
  CHECK(load_error(dir, "model:\n  n_ctx: 128\n") ==
        "train.seq_len = 256 (default): must be <= model.n_ctx = 128 (" + bad +
            ":2:3); lower train.seq_len or raise model.n_ctx");
  CHECK(load_error(dir, "train:\n  min_lr: 1.0e-3\n") ==
        bad + ":2:3: train.min_lr = 0.001: must be <= train.lr = 0.0006 (default); lower train.min_lr or raise "
              "train.lr");
  CHECK(load_error(dir, "train:\n  min_lr: 1.0e-3\n", {"train.lr=1e-4"}) ==
        bad + ":2:3: train.min_lr = 0.001: must be <= train.lr = 0.0001 (--set train.lr=1e-4); lower train.min_lr "
              "or raise train.lr");
  // The checks see the final values: an override can repair the file.
  std::string path = dir.write("fixed.yaml", "train:\n  seq_len: 2048\n");
  CHECK(Config::load(path, {"model.n_ctx=2048"}).get_int("train.seq_len") == 2048);
}

TEST_CASE("config: fail() prefixes where the value came from", "[config][errors]") {
  TempDir dir;
  std::string path = dir.write("run.yaml", "model:\n  n_layer: 4\n  d_model: 256\n");
  Config c = Config::load(path, {"model.n_head=8"});
  CHECK(config_error([&] { c.fail("model.d_model", "too wide for this GPU; lower it"); }) ==
        path + ":3:3: model.d_model = 256: too wide for this GPU; lower it");
  CHECK(config_error([&] { c.fail("model.n_head", "msg"); }) == "--set model.n_head=8: model.n_head = 8: msg");
  CHECK(config_error([&] { c.fail("train.sample_prompt", "msg"); }) == "train.sample_prompt = \"\\n\" (default): msg");
}

TEST_CASE("config: asking for a key outside the schema or of another type is an internal error", "[config][errors]") {
  Config c = Config::defaults();
  CHECK_THROWS_WITH(c.get_int("model.dropout"),
                    Catch::Contains("internal error") && Catch::Contains("get_int(\"model.dropout\")") &&
                        Catch::Contains("number"));
  CHECK_THROWS_WITH(c.get_number("model.n_layer"), Catch::Contains("internal error"));
  CHECK_THROWS_WITH(c.get_bool("train.dtype"), Catch::Contains("internal error"));
  CHECK_THROWS_WITH(c.get_string("model.nope"),
                    Catch::Contains("internal error") && Catch::Contains("no such config key"));
  CHECK(c.get_string("train.dtype") == "f32");  // get_string serves choices
}

TEST_CASE("config: to_yaml is nested, in schema order, and loads back to the same values", "[config]") {
  Config c = Config::defaults();
  c.set({{"train.sample_prompt", R"("a \"quoted\" line: # not a comment\n\tand a tab, a backslash \\, \x01 and é")"},
         {"data.train", "'123'"},
         {"data.val", "'true'"},
         {"model.init_from", "'-leading dash'"},
         {"run.dir", "runs/x-1/y.z"},
         {"model.init_std", "0.30000000000000004"},
         {"model.layer_norm_eps", "1e-30"},  // (1e-300: beyond f32, refused)
         {"train.lr", "123456789.123456789"},
         {"train.seed", "9223372036854775807"},
         {"train.decay_embeddings", "true"}},
        "test");
  std::string yaml = c.to_yaml();
  CHECK(yaml.starts_with("model:\n  arch: gpt2\n  vocab_size: 50257\n  vocab_pad_multiple: 1\n  n_layer: 12\n"));
  CHECK(yaml.find("\n\ndata:\n  train: \"123\"\n  val: \"true\"\n") != std::string::npos);
  CHECK(yaml.find("  init_from: \"-leading dash\"\n") != std::string::npos);
  CHECK(yaml.find("  layer_norm_eps: 1.0e-30\n") != std::string::npos);
  CHECK(yaml.find("  init_std: 0.30000000000000004\n") != std::string::npos);
  CHECK(yaml.find("  seed: 9223372036854775807\n") != std::string::npos);
  CHECK(yaml.find("\n\nrun:\n  dir: runs/x-1/y.z\n") != std::string::npos);
  CHECK(yaml.find("  dir: runs/x-1/y.z\n  overwrite: false\n\nckpt:\n  every: 0\n") != std::string::npos);
  CHECK(yaml.ends_with("\n\nfault:\n  kind: none\n  phase: before_commit\n  rank: 0\n  step: 0\n  signal: TERM\n"
                       "  signal_at: step\n  signal_count: 1\n"));

  TempDir dir;
  std::string path = dir.path() + "/resolved.yaml";
  c.save(path);
  CHECK(read_file(path) == yaml);
  Config back = Config::load(path);
  CHECK(back.to_yaml() == yaml);
  for (const KeySpec& spec : config_schema()) {
    INFO(spec.key);
    CHECK(back.value_yaml(spec.key) == c.value_yaml(spec.key));
    CHECK(back.is_set_explicitly(spec.key));  // everything is written out
  }
  CHECK(back.get_string("train.sample_prompt") == "a \"quoted\" line: # not a comment\n\tand a tab, a backslash \\, \x01 and é");
  CHECK(back.get_number("model.init_std") == 0.30000000000000004);
  CHECK(back.get_number("model.layer_norm_eps") == 1e-30);
  CHECK(back.get_number("train.lr") == 123456789.123456789);
  CHECK(back.get_int("train.seed") == 9223372036854775807);
  CHECK(back.get_string("data.train") == "123");
  size_t line = 1 + std::count(yaml.begin(), yaml.begin() + yaml.find("  sample_prompt:"), '\n');
  CHECK(back.where("train.sample_prompt") == path + ":" + std::to_string(line) + ":3");
}

TEST_CASE("config: sha256 is that of to_yaml, stable, and changes with any value", "[config]") {
  Config a = Config::defaults(), b = Config::defaults();
  CHECK(a.sha256().size() == 64);
  CHECK(a.sha256() == b.sha256());
  // Same values from another source: same hash (origins are not part of it).
  b.set("model.n_layer", "12", "test");
  CHECK(a.sha256() == b.sha256());
  b.set("model.init_std", "0.020000000000000004", "test");  // one ulp away
  CHECK(a.sha256() != b.sha256());

  // Checked against coreutils' sha256sum of the saved file.
  TempDir dir;
  std::string path = dir.path() + "/config.resolved.yaml";
  a.save(path);
  std::FILE* p = ::popen(("sha256sum '" + path + "'").c_str(), "r");
  REQUIRE(p);
  char line[256] = {};
  REQUIRE(std::fgets(line, sizeof line, p));
  ::pclose(p);
  CHECK(std::string(line).substr(0, 64) == a.sha256());
}

TEST_CASE("config: save replaces the file whole and leaves nothing behind on error", "[config]") {
  TempDir dir;
  Config c = Config::defaults();
  std::string path = dir.path() + "/config.yaml";
  {
    std::ofstream(path) << "old contents that are longer than nothing\n";
  }
  c.save(path);
  CHECK(read_file(path) == c.to_yaml());

  auto entries = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(dir.path())) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  };
  CHECK(entries() == std::vector<std::string>{"config.yaml"});  // no temp file left

  std::string missing = dir.path() + "/no/such/dir/config.yaml";
  CHECK_THROWS_AS(c.save(missing), Error);
  CHECK_THROWS_WITH(c.save(missing), Catch::StartsWith("cannot save the config to '" + missing + "': cannot create") &&
                                         Catch::EndsWith("No such file or directory (create the directory first)"));
  CHECK_FALSE(std::filesystem::exists(missing));

  // The target is a directory: refused before anything is written (io/paths.h check_output_file).
  std::filesystem::create_directory(dir.path() + "/taken");
  std::ofstream(dir.path() + "/taken/keep") << "x";
  CHECK_THROWS_WITH(c.save(dir.path() + "/taken"), Catch::Contains("exists and is not a regular file (a directory)"));
  CHECK(std::filesystem::is_directory(dir.path() + "/taken"));
  CHECK(entries() == std::vector<std::string>{"config.yaml", "taken"});
}

TEST_CASE("config: load_string reads YAML text under a given name", "[config]") {
  Config c = Config::load_string("model:\n  n_layer: 3\n", "checkpoint step 40", {"model.n_head=4", "model.d_model=64"});
  CHECK(c.get_int("model.n_layer") == 3);
  CHECK(c.where("model.n_layer") == "checkpoint step 40:2:3");
  CHECK(config_error([] { Config::load_string("model: {n_layer: x}\n", "ckpt"); }) ==
        "ckpt:1:9: model.n_layer: expected an integer, got 'x'");
}

TEST_CASE("config: the shipped configs load; gpt2-small is GPT-2 124M", "[config]") {
  const std::string dir = std::string(MOETRAIN_SOURCE_DIR) + "/configs";
  Config small = Config::load(dir + "/gpt2-small.yaml");
  CHECK(small.get_string("model.arch") == "gpt2");
  CHECK(small.get_int("model.n_layer") == 12);
  CHECK(small.get_int("model.n_head") == 12);
  CHECK(small.get_int("model.d_model") == 768);
  CHECK(small.get_int("model.n_ctx") == 1024);
  CHECK(small.get_int("model.vocab_size") == 50257);
  CHECK(small.get_int("model.d_ff") == 0);  // 4 * d_model
  CHECK(small.get_number("model.layer_norm_eps") == 1e-5);
  CHECK(small.get_string("data.train") == "data/shakespeare/train_*.bin");
  CHECK(small.get_string("data.val") == "data/shakespeare/val_*.bin");
  CHECK(small.get_string("data.tokenizer") == "gpt2");
  // Parameters with tied embeddings: wte + wpe + per block (ln 2d + qkv 3d^2+3d +
  // proj d^2+d + ln 2d + fc 4d^2+4d + proj 4d^2+d) + final ln 2d; GPT-2 small
  // has 124,439,808.
  int64_t V = small.get_int("model.vocab_size"), C = small.get_int("model.n_ctx"), d = small.get_int("model.d_model"),
          L = small.get_int("model.n_layer");
  CHECK(V * d + C * d + L * (12 * d * d + 13 * d) + 2 * d == 124439808);

  Config shakespeare = Config::load(dir + "/gpt2-shakespeare.yaml");
  CHECK(shakespeare.get_int("model.n_layer") == 4);
  CHECK(shakespeare.get_int("model.d_model") % shakespeare.get_int("model.n_head") == 0);
  CHECK(shakespeare.get_int("train.seq_len") <= shakespeare.get_int("model.n_ctx"));
  CHECK(shakespeare.get_string("run.dir") == "runs/gpt2-shakespeare");
  CHECK(shakespeare.get_string("data.train") == "data/shakespeare/train_*.bin");  // from gpt2-small.yaml
  CHECK(shakespeare.where("data.train").starts_with(dir + "/gpt2-small.yaml:"));
  CHECK(shakespeare.where("model.n_layer").starts_with(dir + "/gpt2-shakespeare.yaml:"));
  CHECK(shakespeare.get_int("train.sample_every") > 0);
}

TEST_CASE("config: numbers outside what f32 can hold are refused, naming the key", "[config][errors]") {
  TempDir dir;
  std::string path = dir.write("ok.yaml", "model: {n_layer: 2}\n");
  auto override_error = [&](const std::string& o) { return config_error([&] { Config::load(path, {o}); }); };
  const std::string f32 = "outside what f32 can hold; must be 0 or of magnitude in [1.1754944e-38, 3.4028235e38]";
  CHECK(override_error("train.lr=1e39") == "--set train.lr=1e39: train.lr = 1e39: " + f32);
  CHECK(override_error("train.lr=1e-39") == "--set train.lr=1e-39: train.lr = 1e-39: " + f32);
  CHECK(override_error("train.grad_clip=-1e39") == "--set train.grad_clip=-1e39: train.grad_clip = -1e39: must be >= 0");
  CHECK(override_error("train.grad_clip=1e-39") == "--set train.grad_clip=1e-39: train.grad_clip = 1e-39: " + f32);
  CHECK(override_error("model.kda.lower_bound=-1e-40") ==
        "--set model.kda.lower_bound=-1e-40: model.kda.lower_bound = -1e-40: must be in [-1000000000, -1e-09]");
  // Beyond a double as well, and just past the f32 limits as they round.
  CHECK(override_error("train.lr=1e400") == "--set train.lr=1e400: train.lr = 1e400: " + f32);
  CHECK(override_error("train.lr=1e-400") == "--set train.lr=1e-400: train.lr = 1e-400: " + f32);
  CHECK(override_error("train.lr=3.4028236e38") == "--set train.lr=3.4028236e38: train.lr = 3.4028236e38: " + f32);
  CHECK(override_error("train.lr=1.1754942e-38") ==
        "--set train.lr=1.1754942e-38: train.lr = 1.1754942e-38: " + f32);
  // YAML's NaN and infinities are not numbers here.
  CHECK(override_error("train.lr=.nan") == "--set train.lr=.nan: train.lr: expected a number, got '.nan'");
  CHECK(override_error("train.lr=-.inf") == "--set train.lr=-.inf: train.lr: expected a number, got '-.inf'");
  CHECK(override_error("train.lr=inf") == "--set train.lr=inf: train.lr: expected a finite number, got 'inf'");

  // In a file: file:line:column of the key.
  std::string bad = dir.path() + "/bad.yaml";
  CHECK(load_error(dir, "train:\n  lr: 1e39\n") == bad + ":2:3: train.lr = 1e39: " + f32);
  CHECK(load_error(dir, "model:\n  init_std: 0.02\ntrain: {eps: 1e-39}\n") == bad + ":3:9: train.eps = 1e-39: " + f32);

  // What f32 holds passes, the printed limits included.
  Config c = Config::load(path, {"train.lr=3e38", "train.eps=1e-30", "train.grad_clip=0", "model.init_std=3.4028235e38",
                                 "model.layer_norm_eps=1.1754944e-38", "model.kda.lower_bound=-1e-9"});
  CHECK(c.get_number("train.lr") == 3e38);
  CHECK(c.get_number("train.eps") == 1e-30);
  CHECK(c.get_number("train.grad_clip") == 0);
  CHECK(c.get_number("model.init_std") == 3.4028235e38);
  CHECK(c.get_number("model.layer_norm_eps") == 1.1754944e-38);
  CHECK(c.where("train.lr") == "--set train.lr=3e38");
}

TEST_CASE("config: save onto a full or read-only file system throws IoError naming the path and the system's message",
          "[config][errors]") {
  TempDir dir;
  const Config c = Config::defaults();
  for (const char* options : {"size=1m", "ro,size=1m"}) {
    DYNAMIC_SECTION(options) {
      const std::string mnt = dir.path() + "/mnt";
      std::filesystem::create_directories(mnt);
      if (run_command(std::string("mount -t tmpfs -o ") + options + " tmpfs " + mnt + " 2>/dev/null") != 0) {
        WARN("skipped: cannot mount a tmpfs here (needs root)");
        return;
      }
      struct Unmount {
        std::string path;
        ~Unmount() { run_command("umount " + path); }
      } unmount{mnt};
      const bool full = std::string(options) == "size=1m";
      if (full) {  // fill it up
        std::ofstream filler(mnt + "/filler", std::ios::binary);
        const std::string block(4096, 'x');
        while (filler.write(block.data(), static_cast<std::streamsize>(block.size())) && filler.flush()) {
        }
      }
      const std::string path = mnt + "/config.resolved.yaml";
      const std::string err = error_of<IoError>([&] { c.save(path); });
      CHECK(err.find("cannot save the config to '" + path + "'") != std::string::npos);
      CHECK(err.find(full ? "No space left on device" : "Read-only file system") != std::string::npos);
      std::vector<std::string> names;
      for (const auto& e : std::filesystem::directory_iterator(mnt)) names.push_back(e.path().filename().string());
      CHECK(names == (full ? std::vector<std::string>{"filler"} : std::vector<std::string>{}));
    }
  }
}
