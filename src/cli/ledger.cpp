// `moetrain ledger -c CONFIG [--set k=v] [--dp N] [--ep M] [--json] [--print-config]`: parameters per
// component, total and active, training FLOPs per token and memory per rank of a
// config, counted on shapes only (the full Kimi-K3 in about a second).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "config/cli_options.h"
#include "nn/ledger.h"

namespace moetrain::cli {

void add_ledger_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("ledger", "Parameter, FLOP and memory ledger of a config (no allocation)");
  struct Options {
    LedgerLayout layout;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  auto config_options = add_config_options(cmd, true);
  cmd->add_option("--dp", o->layout.dp, "data-parallel replicas (memory per rank)")->check(positive());
  cmd->add_option("--ep", o->layout.ep, "expert-parallel ranks (experts sharded over them)")->check(positive());
  cmd->add_flag("--json", o->json, "machine-readable output");
  commands.push_back({cmd, [o, config_options] {
    Config config = load_from(*config_options);
    if (config_options->print_config) {
      fmt::print("{}", config.to_yaml());
      return 0;
    }
    Ledger l = make_ledger(config, o->layout);
    fmt::print("{}\n", o->json ? ledger_json(l) : ledger_text(l));
    return 0;
  }});
}

}  // namespace moetrain::cli
