#include "cli/model_options.h"

#include <CLI/CLI.hpp>

#include "core/error.h"

namespace moetrain::cli {

std::shared_ptr<ModelSource> add_model_source_options(CLI::App* cmd) {
  auto source = std::make_shared<ModelSource>();
  cmd->add_option("-c,--config", source->config_path, "YAML experiment config (architecture, tokenizer)");
  cmd->add_option("--set", source->overrides, "override a config key: a.b.c=value (repeatable)");
  cmd->add_option("--init-from", source->init_from,
                  "Hugging Face GPT-2 directory (config.json + model.safetensors) or .safetensors file");
  cmd->add_option("--checkpoint", source->checkpoint, "model directory written by `moetrain train` (<run>/model)");
  return source;
}

void check_model_source(const ModelSource& source) {
  MT_CHECK(!source.config_path.empty() || !source.init_from.empty() || !source.checkpoint.empty(),
           "no model given: pass -c CONFIG, --init-from DIR or --checkpoint DIR");
}

}  // namespace moetrain::cli
