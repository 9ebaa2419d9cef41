// Config options for CLI11 subcommands; see cli_options.h.
#include "config/cli_options.h"

#include <CLI/CLI.hpp>

namespace moetrain {

std::shared_ptr<ConfigOptions> add_config_options(CLI::App* cmd, bool require_config) {
  // The callbacks own a reference, so the struct lives as long as the app even
  // if the caller drops the returned pointer.
  auto opts = std::make_shared<ConfigOptions>();
  CLI::Option* config = cmd->add_option_function<std::string>(
      "-c,--config", [opts](const std::string& path) { opts->config_path = path; },
      "YAML config file (its include: files are read first)");
  if (require_config) config->required();
  // One KEY=VALUE per --set, so a positional argument after it is not swallowed.
  cmd->add_option_function<std::vector<std::string>>(
         "--set", [opts](const std::vector<std::string>& overrides) { opts->overrides = overrides; },
         "Override one config key, e.g. --set model.n_layer=4 (repeatable; later wins)")
      ->allow_extra_args(false)
      ->take_all();
  cmd->add_flag_function(
      "--print-config", [opts](int64_t count) { opts->print_config = count > 0; },
      "Print the resolved config as YAML and exit");
  return opts;
}

Config load_from(const ConfigOptions& options) {
  if (!options.config_path.empty()) return Config::load(options.config_path, options.overrides);
  Config config = Config::defaults();
  config.apply_overrides(options.overrides);
  return config;
}

}  // namespace moetrain
