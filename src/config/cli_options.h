// Command-line glue for the config: -c/--config FILE, repeatable --set KEY=VALUE
// and --print-config on a subcommand, the same on every command that reads a
// config (train, eval, ...); and the numbers of every option read as strictly as
// the schema reads config values. Typical use in a cli/<name>.cpp:
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

// Makes every numeric option of `app` and its subcommands (CLI11's types INT, UINT,
// FLOAT) read its text as the schema reads a config value (config.cpp), ahead of the
// option's other checks; a refusal is "--seed: ..." (a CLI11 ValidationError):
//   integers: decimal digits with an optional sign, within the 64-bit range, and not
//     negative for an unsigned target: "-1" and "18446744073709551616" for --seed are
//     refused instead of wrapped to 18446744073709551615 (CLI11 reads them with an
//     unchecked strtoull), "1e23" and "2^64" as not integers; a leading 0 is decimal
//     (CLI11 alone reads 010 as octal 8, 0x10 as 16);
//   numbers: finite, and 0 or of magnitude in [FLT_MIN, FLT_MAX] (as number keys, which
//     reach f32 code): "nan", "inf" or "1e39" for --temperature are refused instead of
//     sampling uniform bytes.
// Call it once all options exist, before parsing.
void check_numeric_options(CLI::App& app);

}  // namespace moetrain
