// Command-line glue for the config: -c/--config FILE, repeatable --set KEY=VALUE
// and --print-config on a subcommand, the same on every command that reads a
// config (train, eval, ...). Typical use in a cli/<name>.cpp:
//
//   auto opts = add_config_options(cmd);
//   commands.push_back({cmd, [opts] {
//     Config config = load_from(*opts);
//     if (opts->print_config) { fmt::print("{}", config.to_yaml()); return 0; }
//     ...
//   }});
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"

namespace CLI {
class App;
}

namespace moetrain {

struct ConfigOptions {
  std::string config_path;             // -c, --config; empty when not given
  std::vector<std::string> overrides;  // --set, in command-line order
  bool print_config = false;           // --print-config: print the resolved YAML and exit 0
};

// Adds the options to `cmd`; parsing fills the returned struct (shared with
// the option callbacks, so it outlives neither the app nor the caller).
// `require_config` makes -c mandatory; without it the defaults are the base.
[[nodiscard]] std::shared_ptr<ConfigOptions> add_config_options(CLI::App* cmd, bool require_config = true);

// The config the options describe: the file with its includes and overrides,
// or the defaults with the overrides when no file was given.
Config load_from(const ConfigOptions& options);

}  // namespace moetrain
