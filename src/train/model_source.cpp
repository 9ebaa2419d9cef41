#include "train/model_source.h"

#include <filesystem>
#include <optional>

#include <fmt/format.h>

#include "checkpoint/export.h"
#include "nn/gpt2.h"
#include "nn/hf_adapter.h"
#include "nn/hybrid.h"

namespace moetrain {

namespace {

// The value of `key` as the model reads it, so that two spellings of one architecture
// compare equal: d_ff 0 is 4 * d_model, n_value_head 0 is kda.n_head, and the mixer
// schedule is the resolved list whichever keys gave it.
std::string resolved_value(const Config& config, const std::string& key) {
  if (key == "model.d_ff" && config.get_int(key) == 0) return std::to_string(4 * config.get_int("model.d_model"));
  if (key == "model.kda.n_value_head" && config.get_int(key) == 0) return config.value_yaml("model.kda.n_head");
  if (key == "model.layer_mixers") {
    std::string out;
    for (MixerKind k : mixer_schedule(config.get_int("model.n_layer"), config.get_string("model.layer_mixers"),
                                      parse_mixer_kind(config.get_string("model.mixer")),
                                      parse_mixer_kind(config.get_string("model.attn_mixer")),
                                      config.get_int("model.attn_every"), config.get_int("model.attn_offset"),
                                      config.get_bool("model.attn_last"))) {
      if (!out.empty()) out += ',';
      out += mixer_kind_name(k);
    }
    return out;
  }
  return config.value_yaml(key);
}

bool set_explicitly(const Config& config, const std::string& key) {
  if (key != "model.layer_mixers") return config.is_set_explicitly(key);
  for (const char* k : {"model.layer_mixers", "model.mixer", "model.attn_mixer", "model.attn_every",
                        "model.attn_offset", "model.attn_last"})
    if (config.is_set_explicitly(k)) return true;
  return false;
}

// Copies the architecture of a Hugging Face config.json (gpt2, kimi_linear or
// moetrain_hybrid: nn/hf_adapter.h) into `config`. A key the YAML set explicitly to
// another value is a conflict.
void adopt_hf_architecture(Config& config, const std::string& dir) {
  const std::string json = (std::filesystem::path(dir) / "config.json").string();
  const HfArchitecture hf = read_hf_architecture(json);
  std::vector<std::pair<std::string, std::string>> values = hf.keys;
  // seq_len may not exceed the new n_ctx: shorten it when it came from the defaults.
  if (!config.is_set_explicitly("train.seq_len") && config.get_int("train.seq_len") > hf.n_ctx)
    values.emplace_back("train.seq_len", std::to_string(hf.n_ctx));
  Config adopted = config;
  adopted.set(values, json);
  for (const auto& [key, value] : hf.keys) {
    if (!set_explicitly(config, key)) continue;
    const std::string ours = resolved_value(config, key), theirs = resolved_value(adopted, key);
    if (ours != theirs)
      config.fail(key, fmt::format("conflicts with {} = {} in {} (model_type {}); remove it from the config", key,
                                   theirs, json, hf.model_type));
  }
  config = std::move(adopted);
}

// A weight file with NaN or infinities would give `loss nan`, garbage samples or a run
// that skips every step: refused at load (bad input, exit 2), naming file and tensor.
void check_loaded_weights(const Config& config, const LanguageModel& model) {
  ParameterList state = model.parameters();
  const ParameterList buffers = model.buffers();
  state.insert(state.end(), buffers.begin(), buffers.end());
  if (const std::optional<NonFiniteTensor> bad = find_non_finite(state))
    throw Error(fmt::format("{}: the weights in {} hold non-finite values: tensor {}; the file is damaged or comes "
                            "from a diverged run; use an earlier checkpoint or export instead", config.where("model.init_from"),
                            config.get_string("model.init_from"), describe(*bad)));
}

}  // namespace

Config resolve_config(const ModelSource& source) {
  MT_CHECK(source.checkpoint.empty() || (source.init_from.empty() && source.config_path.empty()),
           "give either --checkpoint or -c/--init-from, not both");
  if (!source.checkpoint.empty()) {
    std::filesystem::path dir(source.checkpoint);
    std::string yaml = (dir / "config.resolved.yaml").string();
    const bool has_weights = std::filesystem::exists(dir / "model.safetensors") ||
                             std::filesystem::exists(dir / "model.safetensors.index.json") ||
                             std::filesystem::exists(dir / "model.h5");
    MT_CHECK(std::filesystem::exists(yaml) && has_weights,
             "{}: not a moetrain model directory (expected config.resolved.yaml and model.safetensors, "
             "as written by `moetrain train` into <run>/model or by `moetrain export`)", source.checkpoint);
    Config config = Config::load(yaml, source.overrides);
    config.set("model.init_from", fmt::format("'{}'", source.checkpoint), "--checkpoint");
    return config;
  }
  Config config = source.config_path.empty() ? Config::defaults() : Config::load(source.config_path);
  if (!source.init_from.empty()) config.set("model.init_from", fmt::format("'{}'", source.init_from), "--init-from");
  std::string init = config.get_string("model.init_from");
  if (!init.empty() && is_hf_model_dir(init)) adopt_hf_architecture(config, init);
  if (!source.overrides.empty()) config.apply_overrides(source.overrides);
  return config;
}

std::unique_ptr<LanguageModel> build_model(const Config& config, ExpertShard shard) {
  const auto seed = static_cast<uint64_t>(config.get_int("train.seed"));
  if (config.get_string("model.arch") == "hybrid") {
    MT_CHECK(!config.get_bool("train.activation_checkpointing"),
             "{}: train.activation_checkpointing is not supported by model.arch hybrid yet",
             config.where("train.activation_checkpointing"));
    auto model = std::make_unique<HybridModel>(HybridConfig::from(config), seed, true, shard);
    std::string init = config.get_string("model.init_from");
    if (!init.empty()) {
      MT_CHECK(std::filesystem::exists(init), "{}: model.init_from ({}) does not exist",
               config.where("model.init_from"), init);
      load_hf_weights(*model, init, shard);  // this rank's experts only
      check_loaded_weights(config, *model);
    }
    return model;
  }
  MT_CHECK(shard.size == 1, "{}: train.ep = {} needs a model with MoE layers (model.arch hybrid, "
           "model.moe.num_experts > 0)", config.where("train.ep"), shard.size);
  Gpt2Config c = Gpt2Config::from(config);
  MT_CHECK(c.d_model % c.n_head == 0, "model.d_model = {} is not divisible by model.n_head = {}", c.d_model, c.n_head);
  auto model = std::make_unique<Gpt2>(c, seed);
  std::string init = config.get_string("model.init_from");
  if (!init.empty()) {
    MT_CHECK(std::filesystem::exists(init), "{}: model.init_from ({}) does not exist",
             config.where("model.init_from"), init);
    load_hf_weights(*model, init);
    check_loaded_weights(config, *model);
  }
  return model;
}

void export_model(const LanguageModel& model, const std::string& dir, const ParameterList* full,
                  const Config* config) {
  ExportOptions options;
  options.replace = true;  // a run's model directory is rewritten at the end of each run
  export_model_dir(model, full ? *full : ParameterList{}, dir, options, config);
}

}  // namespace moetrain
