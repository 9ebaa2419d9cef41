// `moetrain train -c CONFIG [--set key=value ...] [--print-config]`. Exit code 0
// when the run finished or SIGUSR1 stopped it with a checkpoint, kExitPreempted
// (75) when SIGTERM/SIGINT/SIGHUP/SIGUSR2 did (core/signals.h).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "config/cli_options.h"
#include "train/trainer.h"

namespace moetrain::cli {

void add_train_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("train", "Train a model from a YAML config");
  auto options = add_config_options(cmd, true);
  commands.push_back({cmd, [options] {
    Config config = load_from(*options);
    if (options->print_config) {
      fmt::print("{}", config.to_yaml());
      return 0;
    }
    signals::throw_if_requested("while the config was read");
    return train(config).exit_code;
  }});
}

}  // namespace moetrain::cli
