#include "cli/commands.h"

#include <CLI/CLI.hpp>

#include "backend/cpu/parallel.h"
#include "core/signals.h"

namespace moetrain::cli {

int run(int argc, char** argv) {
  CLI::App app{"moetrain: train GPT-2 and Kimi-K3-style hybrid MoE models"};
  app.set_version_flag("--version", std::string("moetrain ") + MOETRAIN_VERSION);
  app.require_subcommand(1);
  int threads = 0;
  app.add_option("--threads", threads, "CPU threads for kernels and BLAS (default: cores / local ranks)")
      ->check(CLI::PositiveNumber);

  Commands commands;
  add_info_command(app, commands);
  add_prepare_command(app, commands);
  add_train_command(app, commands);
  add_generate_command(app, commands);
  add_eval_command(app, commands);
  add_ledger_command(app, commands);
  add_op_command(app, commands);
  add_export_command(app, commands);
  add_schema_command(app, commands);

  CLI11_PARSE(app, argc, argv);
  // Only training has something to save when a stop signal comes; the other
  // commands end as any program would (a signal noted while parsing included).
  if (!app.got_subcommand("train")) signals::restore_default_actions();
  cpu::init_threads();
  if (threads > 0) cpu::set_num_threads(threads);
  for (const Command& c : commands)
    if (c.app->parsed()) return c.run();
  return 0;
}

}  // namespace moetrain::cli
