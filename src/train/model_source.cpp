#include "train/model_source.h"

#include <algorithm>
#include <filesystem>
#include <optional>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "backend/cpu/allocator.h"
#include "backend/cpu/parallel.h"
#include "backend/cuda/runtime.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "comm/distributed.h"
#include "core/format.h"
#include "nn/hf_adapter.h"
#include "nn/hybrid.h"
#include "nn/ledger.h"
#include "nn/model_family.h"

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
    if (ours != theirs && key == "model.layer_mixers" && !config.is_set_explicitly(key)) {
      // The schedule came from the period keys: name the one the config set, and the schedule it gives.
      std::string by = "model.mixer";
      for (const char* k : {"model.attn_every", "model.attn_offset", "model.attn_last", "model.attn_mixer"})
        if (config.is_set_explicitly(k)) by = k;
      config.fail(by, fmt::format("gives the layer schedule {} (with model.n_layer = {}), which conflicts with "
                                  "model.layer_mixers = {} in {} (model_type {}); remove the schedule keys from the "
                                  "config", ours, config.get_int("model.n_layer"), theirs, json, hf.model_type));
    }
    if (ours != theirs)
      config.fail(key, fmt::format("conflicts with {} = {} in {} (model_type {}); remove it from the config", key,
                                   theirs, json, hf.model_type));
  }
  config = std::move(adopted);
}

// Weights without a config.json take their shape from the config's model section;
// when they do not fit it the adapter's message ("tensor wte.weight is [256, 16] but the
// model expects [50257, 768]") gets where that shape came from and what to do.
void load_init_weights(const Config& config, LanguageModel& model, const std::string& init, ExpertShard shard) {
  try {
    load_hf_weights(model, init, shard);
  } catch (const IoError&) {
    throw;
  } catch (const NumericalError&) {
    throw;
  } catch (const OutOfMemoryError&) {
    throw;
  } catch (const Error& e) {
    if (is_hf_model_dir(init)) throw;  // the shape came from its config.json, which the message names
    throw Error(fmt::format(
        "{}; {} has no config.json, so the model's shape came from the config: model.arch = {} ({}), model.n_layer = "
        "{} ({}), model.d_model = {} ({}); put the config.json that came with the weights beside them, or make the "
        "config's model section describe them (-c CONFIG)", e.what(), init, config.get_string("model.arch"),
        config.where("model.arch"), config.get_int("model.n_layer"), config.where("model.n_layer"),
        config.get_int("model.d_model"), config.where("model.d_model")));
  }
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

// The keys that size a parameter group (the ledger's components), for messages.
std::string sizing_keys(const std::string& group) {
  if (group == "embedding") return "model.vocab_size x model.d_model (and model.n_ctx x model.d_model)";
  if (group == "experts") return "model.moe.num_experts x model.moe.expert_d_ff x model.d_model (or latent_dim)";
  return "model.n_layer x model.d_model and the " + group + " widths";
}

// Before anything is allocated: the model's shapes from a shape-only construction
// (milliseconds, as `moetrain ledger`), so a size too large to exist is an error
// naming the model section rather than a failed allocation, and weights that
// alone exceed this machine's memory are refused naming their largest group.
void check_model_fits(const Config& config, ExpertShard shard) {
  Ledger ledger;
  try {
    ledger = make_ledger(config, {1, shard.size});
  } catch (const OutOfMemoryError& e) {  // a shape beyond 2^63 elements
    throw ConfigError(fmt::format("the model section describes a tensor too large to exist ({}); check the sizes: "
                                  "model.vocab_size, model.d_model, model.n_layer, model.d_ff, model.moe.*",
                                  e.what()));
  }
  const double bytes_per_weight = config.get_string("train.dtype") == "f64" ? 8 : 4;
  const double bytes = static_cast<double>(ledger.params_per_rank) * bytes_per_weight;
  const double memory = cpu::host_memory_bytes();
  if (bytes <= memory || ledger.components.empty()) return;
  const auto largest = std::max_element(ledger.components.begin(), ledger.components.end(),
                                        [](const auto& a, const auto& b) { return a.second < b.second; });
  throw OutOfMemoryError(fmt::format(
      "the model has {} parameters on this rank: {} of weights alone, more than this machine's {} of memory (before "
      "gradients and optimizer state); the largest group is {} ({} parameters: {}); `moetrain ledger -c CONFIG` lists them",
      ledger.params_per_rank, human_bytes(bytes), human_bytes(memory), largest->first, largest->second,
      sizing_keys(largest->first)));
}

bool is_training_checkpoint(const std::string& dir) {
  return std::filesystem::exists(std::filesystem::path(dir) / "manifest.json");
}

}  // namespace

void adopt_init_from_architecture(Config& config) {
  const std::string init = config.get_string("model.init_from");
  if (!init.empty() && is_hf_model_dir(init)) adopt_hf_architecture(config, init);
}

Config resolve_config(const ModelSource& source) {
  MT_CHECK(source.checkpoint.empty() || (source.init_from.empty() && source.config_path.empty()),
           "give either --checkpoint or -c/--init-from, not both");
  if (!source.checkpoint.empty()) {
    MT_CHECK(std::filesystem::is_directory(source.checkpoint), "--checkpoint {}: {}", source.checkpoint,
             std::filesystem::exists(source.checkpoint)
                 ? "a file, not a checkpoint directory (pass <run>/checkpoints/step_N, <run>/model or a directory "
                   "`moetrain export` wrote)"
                 : "no such directory");
    if (is_training_checkpoint(source.checkpoint)) {
      // One process holds every expert: the checkpoint's shards are gathered on load.
      std::vector<std::string> overrides = source.overrides;
      overrides.push_back("train.ep=1");
      overrides.push_back("train.pp=1");
      Config config = Config::load(checkpoint_config_path(source.checkpoint), overrides);
      config.set("model.init_from", "''", "--checkpoint (a training checkpoint)");
      return config;
    }
    std::filesystem::path dir(source.checkpoint);
    std::string yaml = (dir / "config.resolved.yaml").string();
    const bool has_weights = std::filesystem::exists(dir / "model.safetensors") ||
                             std::filesystem::exists(dir / "model.safetensors.index.json") ||
                             std::filesystem::exists(dir / "model.h5");
    MT_CHECK(std::filesystem::exists(yaml) && has_weights,
             "--checkpoint {}: neither a model directory (config.resolved.yaml and model.safetensors, as `moetrain "
             "train` writes <run>/model and `moetrain export` writes) nor a training checkpoint (manifest.json, as in "
             "<run>/checkpoints/step_N){}", source.checkpoint,
             std::filesystem::is_directory(dir / "checkpoints") || std::filesystem::is_directory(dir / "model")
                 ? fmt::format("; this looks like a run directory: pass {}/model or {}/checkpoints/step_N",
                               source.checkpoint, source.checkpoint)
                 : "");
    Config config = Config::load(yaml, source.overrides);
    config.set("model.init_from", fmt::format("'{}'", source.checkpoint), "--checkpoint");
    return config;
  }
  Config config = source.config_path.empty() ? Config::defaults() : Config::load(source.config_path);
  if (!source.init_from.empty()) config.set("model.init_from", fmt::format("'{}'", source.init_from), "--init-from");
  // --set joins the YAML before a config.json is adopted, so that its conflict check sees
  // the resolved values (YAML and --set together; docs/export.md): a --set that differs
  // from config.json is refused like a YAML key, and one that brings a YAML key back into
  // agreement is accepted.
  if (!source.overrides.empty()) config.apply_overrides(source.overrides);
  adopt_init_from_architecture(config);
  const std::string init = config.get_string("model.init_from");
  // Without a config.json and a YAML only the defaults (GPT-2 124M) would say the shape,
  // and the weights would fail against them tensor by tensor: say what is missing instead.
  const bool overrides_model = std::any_of(source.overrides.begin(), source.overrides.end(),
                                           [](const std::string& o) { return o.rfind("model.", 0) == 0; });
  if (!init.empty() && source.config_path.empty() && !overrides_model && std::filesystem::exists(init) &&
      !is_hf_model_dir(init))
    throw Error(fmt::format(
        "{}: {} {}, so nothing says the model's shape; put the config.json that came with the weights {}, or pass "
        "-c CONFIG whose model section describes them (configs/gpt2-small.yaml for OpenAI's GPT-2 124M)",
        config.where("model.init_from"), init,
        std::filesystem::is_directory(init) ? "holds no config.json" : "is a weight file, which carries no config.json",
        std::filesystem::is_directory(init) ? "into it" : "beside them and pass that directory"));
  return config;
}

std::unique_ptr<LanguageModel> build_model(const Config& config, ExpertShard shard, PipelineStage stage) {
  const ModelFamily& family = model_family(config);
  check_capabilities(config, family);
  check_model_fits(config, shard);
  std::unique_ptr<LanguageModel> model = family.build(config, ModelPlacement{shard, stage});
  const std::string init = config.get_string("model.init_from");
  if (!init.empty()) {
    MT_CHECK(stage.whole(), "{}: model.init_from with train.pp = {} is not supported yet: start the pipeline from "
             "a training checkpoint (ckpt.resume) or from random weights", config.where("model.init_from"),
             stage.count);
    MT_CHECK(std::filesystem::exists(init), "{}: model.init_from ({}) does not exist",
             config.where("model.init_from"), init);
    load_init_weights(config, *model, init, shard);  // this rank's experts only
    check_loaded_weights(config, *model);
  }
  return model;
}

ParameterList LoadedModel::state() const {
  ParameterList all = model->parameters();
  const ParameterList buffers = model->buffers();
  all.insert(all.end(), buffers.begin(), buffers.end());
  return all;
}

Device place_model(LanguageModel& model, const std::string& device) {
  MT_CHECK(device == "cpu" || device == "cuda", "--device {}: not one of cpu, cuda", device);
  if (device == "cpu") return kCpu;
  MT_CHECK(cuda::built_with_cuda(), "--device cuda: this moetrain was built without the CUDA backend (rebuild where "
           "nvcc is found, docs/cuda.md), or pass --device cpu");
  MT_CHECK(cuda::device_count() > 0, "--device cuda: no CUDA device is visible (check nvidia-smi and "
           "CUDA_VISIBLE_DEVICES), or pass --device cpu");
  const Device gpu{DeviceKind::cuda, cuda::select_device(cpu::launcher_local_rank())};
  for (const NamedParameter& p : model.parameters()) move_to_device_(p.tensor, gpu);
  spdlog::info("model on {} ({})", gpu, cuda::device_name(gpu.index));
  return gpu;
}

LoadedModel load_model(const ModelSource& source) {
  LoadedModel m{resolve_config(source), nullptr};
  m.model = build_model(m.config);
  if (!source.checkpoint.empty() && is_training_checkpoint(source.checkpoint)) {
    std::unique_ptr<comm::Communicator> one = comm::single_process();
    Distributed d;
    d.world = one.get();
    d.grid = comm::make_process_grid(*one, 1);
    const TrainProgress p = load_checkpoint(d, source.checkpoint, *m.model, nullptr, m.config);
    spdlog::info("training checkpoint {}: step {}, {} tokens seen", source.checkpoint, p.step, p.tokens);
  }
  return m;
}

void export_model(const LanguageModel& model, const std::string& dir, const ParameterList* full,
                  const Config* config) {
  ExportOptions options;
  options.replace = true;  // a run's model directory is rewritten at the end of each run
  export_model_dir(model, full ? *full : ParameterList{}, dir, options, config);
}

}  // namespace moetrain
