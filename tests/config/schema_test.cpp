// The schema table itself: well-formed entries, so a new key cannot break
// loading, to_yaml() or the generated docs; and the defaults issue 3 asks for.
#include <catch2/catch.hpp>

#include <map>
#include <regex>
#include <set>

#include "config/config.h"
#include "config/schema.h"

using namespace moetrain;

TEST_CASE("schema: every entry is well formed", "[config][schema]") {
  const std::regex dotted_snake_case("[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)+");
  std::set<std::string> keys, closed_sections;
  std::string current_section;
  for (const KeySpec& s : config_schema()) {
    INFO(s.key);
    CHECK(std::regex_match(s.key, dotted_snake_case));
    CHECK(keys.insert(s.key).second);  // unique
    CHECK(find_key_spec(s.key) == &s);
    CHECK_FALSE(s.doc.empty());
    CHECK(s.doc.find('\n') == std::string::npos);
    // A section's keys are contiguous, so to_yaml() writes each section once.
    std::string section = s.key.substr(0, s.key.rfind('.'));
    if (section != current_section) {
      CHECK(closed_sections.count(section) == 0);
      closed_sections.insert(current_section);
      current_section = section;
    }
    if (s.type == ConfigType::choice) {
      CHECK(s.choices.size() >= 1);
      CHECK(std::find(s.choices.begin(), s.choices.end(), s.default_yaml) != s.choices.end());
    } else {
      CHECK(s.choices.empty());
    }
    if (s.type != ConfigType::integer && s.type != ConfigType::number) CHECK((!s.min && !s.max));
    if (s.min && s.max) CHECK(*s.min < *s.max);
  }
  // No key is also a section ("model" both a value and a map).
  for (const KeySpec& s : config_schema())
    for (size_t dot = s.key.find('.'); dot != std::string::npos; dot = s.key.find('.', dot + 1))
      CHECK(keys.count(s.key.substr(0, dot)) == 0);
  // Every default parses and satisfies its own range and the cross-key checks.
  CHECK_NOTHROW(Config::defaults());
  CHECK(find_key_spec("model.nope") == nullptr);
}

TEST_CASE("schema: allowed values read like the maths", "[config][schema]") {
  CHECK(allowed_values_text(*find_key_spec("model.n_layer")) == "[1, 4096]");
  CHECK(allowed_values_text(*find_key_spec("model.vocab_size")) == "[1, 2147483647]");
  CHECK(allowed_values_text(*find_key_spec("train.eval_every")) == ">= 0");
  CHECK(allowed_values_text(*find_key_spec("model.dropout")) == "[0, 1)");
  CHECK(allowed_values_text(*find_key_spec("train.lr")) == "> 0");
  CHECK(allowed_values_text(*find_key_spec("train.wsd_decay_frac")) == "[0, 1]");
  CHECK(allowed_values_text(*find_key_spec("train.schedule")) == "one of cosine, wsd, linear, constant");
  CHECK(allowed_values_text(*find_key_spec("run.dir")).empty());
  CHECK(std::string(config_type_name(ConfigType::choice)) == "choice");
}

TEST_CASE("schema: defaults, types and ranges of the GPT-2 and training keys", "[config][schema]") {
  struct Expected {
    ConfigType type;
    std::string value_yaml;  // as to_yaml() writes it
    std::string allowed;
  };
  using T = ConfigType;
  const std::map<std::string, Expected> expected = {
      {"model.arch", {T::choice, "gpt2", "one of gpt2, hybrid"}},
      {"model.vocab_size", {T::integer, "50257", "[1, 2147483647]"}},
      {"model.n_layer", {T::integer, "12", "[1, 4096]"}},
      {"model.n_head", {T::integer, "12", "[1, 2147483647]"}},
      {"model.d_model", {T::integer, "768", "[1, 2147483647]"}},
      {"model.n_ctx", {T::integer, "1024", "[1, 2147483647]"}},
      {"model.d_ff", {T::integer, "0", "[0, 2147483647]"}},
      {"model.layer_norm_eps", {T::number, "1.0e-05", "> 0"}},
      {"model.dropout", {T::number, "0.0", "[0, 1)"}},
      {"model.init_std", {T::number, "0.02", "> 0"}},
      {"model.init_from", {T::string, "\"\"", ""}},
      {"data.train", {T::string, "\"\"", ""}},
      {"data.val", {T::string, "\"\"", ""}},
      {"data.tokenizer", {T::string, "gpt2", ""}},
      {"data.tokenizer_dir", {T::string, "data/gpt2", ""}},
      {"train.seed", {T::integer, "1337", ">= 0"}},
      {"train.batch_size", {T::integer, "8", "[1, 2147483647]"}},
      {"train.seq_len", {T::integer, "256", "[1, 2147483647]"}},
      {"train.grad_accum", {T::integer, "1", "[1, 2147483647]"}},
      {"train.max_steps", {T::integer, "1000", "[0, 2147483647]"}},
      {"train.lr", {T::number, "0.0006", "> 0"}},
      {"train.min_lr", {T::number, "6.0e-05", ">= 0"}},
      {"train.schedule", {T::choice, "cosine", "one of cosine, wsd, linear, constant"}},
      {"train.warmup_steps", {T::integer, "100", "[0, 2147483647]"}},
      {"train.wsd_decay_frac", {T::number, "0.2", "[0, 1]"}},
      {"train.weight_decay", {T::number, "0.1", ">= 0"}},
      {"train.decay_embeddings", {T::boolean, "false", ""}},
      {"train.beta1", {T::number, "0.9", "[0, 1)"}},
      {"train.beta2", {T::number, "0.95", "[0, 1)"}},
      {"train.eps", {T::number, "1.0e-08", "> 0"}},
      {"train.grad_clip", {T::number, "1.0", ">= 0"}},
      {"train.eval_every", {T::integer, "100", ">= 0"}},
      {"train.eval_batches", {T::integer, "20", "[1, 2147483647]"}},
      {"train.sample_every", {T::integer, "0", ">= 0"}},
      {"train.sample_tokens", {T::integer, "128", "[1, 2147483647]"}},
      {"train.sample_prompt", {T::string, "\"\\n\"", ""}},
      {"train.sample_temperature", {T::number, "0.8", ">= 0"}},
      {"train.sample_top_k", {T::integer, "40", "[0, 2147483647]"}},
      {"train.log_every", {T::integer, "1", ">= 1"}},
      {"train.threads", {T::integer, "0", ">= 0"}},
      {"train.dtype", {T::choice, "f32", "one of f32, f64, bf16"}},
      {"train.activation_checkpointing", {T::boolean, "false", ""}},
      {"train.profile", {T::boolean, "false", ""}},
      {"run.dir", {T::string, "runs/default", ""}},
  };
  Config defaults = Config::defaults();
  for (const auto& [key, e] : expected) {
    INFO(key);
    const KeySpec* spec = find_key_spec(key);
    REQUIRE(spec);
    CHECK(spec->type == e.type);
    CHECK(defaults.value_yaml(key) == e.value_yaml);
    CHECK(allowed_values_text(*spec) == e.allowed);
  }
}
