// Where a command's model comes from, and building it:
//   -c CONFIG              a YAML experiment; random init (seed train.seed) unless
//                          model.init_from names Hugging Face weights
//   --init-from PATH       a Hugging Face directory (its config.json defines the
//                          architecture: gpt2, kimi_linear or moetrain_hybrid,
//                          nn/hf_adapter.h) or a .safetensors file (the YAML does)
//   --checkpoint DIR       a model directory (<run>/model as `moetrain train`
//                          writes it, or an export: model.safetensors and the
//                          run's config.resolved.yaml) or a training checkpoint
//                          (<run>/checkpoints/step_N: manifest.json, rank files);
//                          generate, eval and export take both
#pragma once

#include <memory>
#include <string>

#include "config/config.h"
#include "nn/language_model.h"
#include "nn/moe.h"

namespace moetrain {

struct ModelSource {
  std::string config_path;             // may be empty
  std::vector<std::string> overrides;  // --set
  std::string init_from;               // may be empty
  std::string checkpoint;              // may be empty
};

// The resolved config of a source (architecture keys from config.json where the
// weights come from Hugging Face; a training checkpoint's own config, on one
// process). Throws when the sources conflict, and when --init-from names weights
// without a config.json (a bare .safetensors file, or a directory lacking one) and
// neither -c nor a --set model.* key says the model's shape.
Config resolve_config(const ModelSource& source);

// model.init_from naming a Hugging Face directory (a config.json in it): the
// architecture of its config.json (gpt2, kimi_linear, moetrain_hybrid) replaces the
// config's model keys; a key the config set explicitly (its file or --set) to another
// value is a ConfigError naming the key, where it was set and the config.json; a
// config.json that cannot be read or is refused names it (exit 2). Nothing happens
// when model.init_from is empty or a file. resolve_config (generate, eval, export)
// and `moetrain train` both read a model.init_from through here.
void adopt_init_from_architecture(Config& config);

// What generate, eval and export run: the resolved config and the model with its
// weights (a training checkpoint's resharded onto one process: every expert).
struct LoadedModel {
  Config config;
  std::unique_ptr<LanguageModel> model;
  // Parameters and buffers, at full size.
  ParameterList state() const;
};
LoadedModel load_model(const ModelSource& source);

// generate and eval --device: "cpu" leaves the model where it was loaded; "cuda"
// moves its parameters to the GPU (the local rank's under mpirun, as train.device
// cuda does, f32 products without TF32), while prompts and batches stay host tensors
// that the model's first op reads (as the trainer's evaluation and samples do).
// Error naming --device when this build has no CUDA backend or no GPU is visible.
Device place_model(LanguageModel& model, const std::string& device);

// A model built from a resolved config (model.arch): random init, or the weights
// of model.init_from (a Hugging Face directory or file, read by the model's adapter). Weights holding NaN or
// infinities are refused: Error naming model.init_from's origin, the path and the
// tensor (train, eval, generate, export all load through here).
// shard: this rank's experts under expert parallelism (hybrid models with MoE).
// stage: this rank's pipeline stage under train.pp (hybrid models; random init only).
std::unique_ptr<LanguageModel> build_model(const Config& config, ExpertShard shard = {}, PipelineStage stage = {});

// Writes DIR (replacing it) with export_model_dir's defaults: f32 model.safetensors
// under Hugging Face names plus config.json (checkpoint/export.h, docs/export.md),
// and config.resolved.yaml when `config` is given (inside the same temp directory,
// so DIR appears complete with it or not at all).
// state: the model's parameters and buffers at full size when they differ from the
// model's own (expert shards gathered from other ranks).
// Throws NumericalError naming the tensor before writing anything when a tensor is
// not finite; IoError naming the file and strerror when a write fails.
void export_model(const LanguageModel& model, const std::string& dir, const ParameterList* state = nullptr,
                  const Config* config = nullptr);

}  // namespace moetrain
