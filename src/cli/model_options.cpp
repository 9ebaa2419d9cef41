#include "cli/model_options.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "core/error.h"

namespace moetrain::cli {

std::shared_ptr<ModelOptions> add_model_source_options(CLI::App* cmd, bool with_device) {
  auto o = std::make_shared<ModelOptions>();
  ModelSource& source = o->source;
  cmd->add_option("-c,--config", source.config_path, "YAML experiment config (architecture, tokenizer)");
  cmd->add_option("--set", source.overrides, "override a config key: a.b.c=value (repeatable)")->default_str("");
  cmd->add_option("--init-from", source.init_from,
                  "Hugging Face directory (config.json + safetensors: gpt2, kimi_linear, moetrain_hybrid) or a "
                  ".safetensors file");
  cmd->add_option("--checkpoint", source.checkpoint, kCheckpointHelp);
  cmd->add_flag("--print-config", o->print_config, "print the resolved config (YAML) and exit");
  if (with_device)
    cmd->add_option("--device", o->device, "cpu or cuda: where the model runs (cuda: the first visible GPU, or the "
                    "local rank's under mpirun)")->check(CLI::IsMember({"cpu", "cuda"}));
  return o;
}

void check_model_source(const ModelSource& source) {
  MT_CHECK(!source.config_path.empty() || !source.init_from.empty() || !source.checkpoint.empty(),
           "no model given: pass -c CONFIG, --init-from DIR or --checkpoint DIR");
}

bool print_config_if_asked(const ModelOptions& options) {
  check_model_source(options.source);
  if (!options.print_config) return false;
  fmt::print("{}", resolve_config(options.source).to_yaml());
  return true;
}

}  // namespace moetrain::cli
