// The schema table. One entry per key, grouped by section; a later issue adds
// its options here (and its consistency checks in its own code, via
// Config::fail). Defaults of the model section are GPT-2 small (124M).
#include "config/schema.h"

#include <unordered_map>

#include <fmt/format.h>

namespace moetrain {
namespace {

// Bounds of a numeric key, spelled like the maths: at_least(1) is [1, inf),
// in(0, 1) is [0, 1], in_half_open(0, 1) is [0, 1), above(0) is (0, inf).
struct Range {
  std::optional<double> min, max;
  bool min_exclusive = false, max_exclusive = false;
};
Range at_least(double lo) { return {lo, std::nullopt, false, false}; }
Range above(double lo) { return {lo, std::nullopt, true, false}; }
Range in(double lo, double hi) { return {lo, hi, false, false}; }
Range in_half_open(double lo, double hi) { return {lo, hi, false, true}; }

KeySpec spec(ConfigType type, std::string key, std::string def, std::string doc) {
  KeySpec s{};
  s.key = std::move(key);
  s.type = type;
  s.default_yaml = std::move(def);
  s.doc = std::move(doc);
  return s;
}
KeySpec numeric(ConfigType type, std::string key, std::string def, Range r, std::string doc) {
  KeySpec s = spec(type, std::move(key), std::move(def), std::move(doc));
  s.min = r.min;
  s.max = r.max;
  s.min_exclusive = r.min_exclusive;
  s.max_exclusive = r.max_exclusive;
  return s;
}
KeySpec integer(std::string key, std::string def, Range r, std::string doc) {
  return numeric(ConfigType::integer, std::move(key), std::move(def), r, std::move(doc));
}
KeySpec number(std::string key, std::string def, Range r, std::string doc) {
  return numeric(ConfigType::number, std::move(key), std::move(def), r, std::move(doc));
}
KeySpec boolean(std::string key, std::string def, std::string doc) {
  return spec(ConfigType::boolean, std::move(key), std::move(def), std::move(doc));
}
KeySpec string(std::string key, std::string def, std::string doc) {
  return spec(ConfigType::string, std::move(key), std::move(def), std::move(doc));
}
KeySpec choice(std::string key, std::string def, std::vector<std::string> choices, std::string doc) {
  KeySpec s = spec(ConfigType::choice, std::move(key), std::move(def), std::move(doc));
  s.choices = std::move(choices);
  return s;
}

std::vector<KeySpec> make_schema() {
  // clang-format off
  return {
    // model: the network. Defaults are GPT-2 small (124M).
    choice ("model.arch",           "gpt2",  {"gpt2"},     "model architecture (gpt2 only for now)"),
    integer("model.vocab_size",     "50257", at_least(1),  "rows of the token embedding; must cover every id the tokenizer produces"),
    integer("model.n_layer",        "12",    in(1, 4096),  "number of transformer blocks"),
    integer("model.n_head",         "12",    at_least(1),  "attention heads per block; must divide model.d_model"),
    integer("model.d_model",        "768",   at_least(1),  "width of the residual stream (GPT-2's n_embd); a multiple of model.n_head"),
    integer("model.n_ctx",          "1024",  at_least(1),  "number of learned positions: the longest sequence the model accepts"),
    integer("model.d_ff",           "0",     at_least(0),  "hidden width of the MLP; 0 means 4 * model.d_model"),
    number ("model.layer_norm_eps", "1e-5",  above(0),     "epsilon added to the variance in every LayerNorm"),
    number ("model.dropout",        "0.0",   in_half_open(0, 1), "dropout probability while training; 0 turns dropout off"),
    number ("model.init_std",       "0.02",  above(0),     "standard deviation of the normal weight initialization"),
    string ("model.init_from",      "''",                  "pretrained weights to start from: a Hugging Face GPT-2 directory or a .safetensors file; empty = random init"),

    // data: token shards and the tokenizer.
    string ("data.train",           "''",                  "glob of tokenized training shards, e.g. data/shakespeare/train_*.bin"),
    string ("data.val",             "''",                  "glob of tokenized validation shards, e.g. data/shakespeare/val_*.bin"),
    choice ("data.tokenizer",       "gpt2",  {"gpt2", "byte"}, "gpt2 = GPT-2 byte-level BPE (files in data.tokenizer_dir); byte = one token per byte"),
    string ("data.tokenizer_dir",   "data/gpt2",           "directory of the GPT-2 tokenizer files, used when data.tokenizer is gpt2"),

    // train: optimization, schedule, evaluation, sampling and logging.
    integer("train.seed",           "1337",  at_least(0),  "random seed of initialization, data order and sampling"),
    integer("train.batch_size",     "8",     at_least(1),  "sequences per micro-batch"),
    integer("train.seq_len",        "256",   at_least(1),  "tokens per training sequence; at most model.n_ctx"),
    integer("train.grad_accum",     "1",     at_least(1),  "micro-batches per optimizer step (tokens per step = batch_size * seq_len * grad_accum)"),
    integer("train.max_steps",      "1000",  at_least(0),  "optimizer steps to train for"),
    number ("train.lr",             "6e-4",  above(0),     "peak learning rate, reached at the end of warmup"),
    number ("train.min_lr",         "6e-5",  at_least(0),  "learning rate at the end of the decay; at most train.lr"),
    choice ("train.schedule",       "cosine", {"cosine", "wsd", "linear", "constant"},
                                                           "learning-rate shape after warmup: cosine, wsd (warmup-stable-decay), linear or constant"),
    integer("train.warmup_steps",   "100",   at_least(0),  "steps of linear warmup from 0 to train.lr"),
    number ("train.wsd_decay_frac", "0.2",   in(0, 1),     "wsd schedule: fraction of train.max_steps spent decaying to train.min_lr at the end"),
    number ("train.weight_decay",   "0.1",   at_least(0),  "AdamW decoupled weight decay of the weight matrices"),
    boolean("train.decay_embeddings", "false",             "also apply weight decay to the token and position embeddings"),
    number ("train.beta1",          "0.9",   in_half_open(0, 1), "AdamW decay rate of the first moment"),
    number ("train.beta2",          "0.95",  in_half_open(0, 1), "AdamW decay rate of the second moment"),
    number ("train.eps",            "1e-8",  above(0),     "AdamW epsilon, added to the square root of the second moment"),
    number ("train.grad_clip",      "1.0",   at_least(0),  "clip the global gradient norm to this value; 0 = no clipping"),
    integer("train.eval_every",     "100",   at_least(0),  "evaluate the validation loss every N steps; 0 = never"),
    integer("train.eval_batches",   "20",    at_least(1),  "validation batches per evaluation"),
    integer("train.sample_every",   "0",     at_least(0),  "print a generated sample every N steps; 0 = never"),
    integer("train.sample_tokens",  "128",   at_least(1),  "tokens generated per sample"),
    string ("train.sample_prompt",  R"("\n")",             "text that samples continue"),
    number ("train.sample_temperature", "0.8", at_least(0), "sampling temperature; 0 = greedy (always the most likely token)"),
    integer("train.sample_top_k",   "40",    at_least(0),  "sample among the k most likely tokens; 0 = among all tokens"),
    integer("train.log_every",      "1",     at_least(1),  "print a step line every N steps"),
    integer("train.threads",        "0",     at_least(0),  "CPU threads; 0 = automatic"),
    choice ("train.dtype",          "f32",   {"f32", "f64"}, "dtype of parameters and activations; f64 for exact checks"),
    boolean("train.activation_checkpointing", "false",     "recompute each block's activations in backward instead of storing them"),

    // run: where a run's outputs go.
    string ("run.dir",              "runs/default",        "directory of checkpoints, metrics.jsonl and config.resolved.yaml"),
  };
  // clang-format on
}

}  // namespace

const std::vector<KeySpec>& config_schema() {
  static const std::vector<KeySpec> schema = make_schema();
  return schema;
}

const KeySpec* find_key_spec(const std::string& key) {
  static const std::unordered_map<std::string, const KeySpec*> index = [] {
    std::unordered_map<std::string, const KeySpec*> m;
    for (const KeySpec& s : config_schema()) m.emplace(s.key, &s);
    return m;
  }();
  auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}

const char* config_type_name(ConfigType type) {
  switch (type) {
    case ConfigType::integer: return "integer";
    case ConfigType::number: return "number";
    case ConfigType::boolean: return "boolean";
    case ConfigType::string: return "string";
    case ConfigType::choice: return "choice";
  }
  return "?";
}

std::string allowed_values_text(const KeySpec& spec) {
  if (spec.type == ConfigType::choice) return fmt::format("one of {}", fmt::join(spec.choices, ", "));
  if (spec.min && spec.max)
    return fmt::format("{}{}, {}{}", spec.min_exclusive ? "(" : "[", *spec.min, *spec.max,
                       spec.max_exclusive ? ")" : "]");
  if (spec.min) return fmt::format("{} {}", spec.min_exclusive ? ">" : ">=", *spec.min);
  if (spec.max) return fmt::format("{} {}", spec.max_exclusive ? "<" : "<=", *spec.max);
  return "";
}

}  // namespace moetrain
