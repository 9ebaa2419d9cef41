// `moetrain train -c CONFIG [--set key=value ...] [--device cpu|cuda] [--print-config]`. model.init_from
// naming a Hugging Face directory sets the architecture from its config.json (train/model_source.h). Exit code 0
// when the run finished or SIGUSR1 stopped it with a checkpoint, kExitPreempted
// (75) when SIGTERM/SIGINT/SIGHUP/SIGUSR2 did (core/signals.h).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "config/cli_options.h"
#include "train/model_source.h"
#include "train/trainer.h"

namespace moetrain::cli {

void add_train_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("train", "Train a model from a YAML config");
  auto options = add_config_options(cmd, true);
  auto device = std::make_shared<std::string>();
  cmd->add_option("--device", *device, "cpu or cuda: the same as --set train.device=...")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  commands.push_back({cmd, [options, device] {
    ConfigOptions with_device = *options;
    if (!device->empty()) with_device.overrides.push_back("train.device=" + *device);
    Config config = load_from(with_device);
    // model.init_from: DIR takes the architecture of DIR/config.json, as generate and eval's --init-from
    // do; a key of the YAML that contradicts it is an error naming both.
    adopt_init_from_architecture(config);
    if (options->print_config) {
      fmt::print("{}", config.to_yaml());
      return 0;
    }
    signals::throw_if_requested("while the config was read");
    return train(config).exit_code;
  }});
}

}  // namespace moetrain::cli
