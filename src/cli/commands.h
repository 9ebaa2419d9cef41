// The CLI's subcommands. Each lives in its own file (cli/<name>.cpp) and
// registers itself on the app with an add_<name>_command function; run()
// parses argv and runs the chosen one.
#pragma once

#include <functional>
#include <vector>

namespace CLI {
class App;
}

namespace moetrain::cli {

struct Command {
  CLI::App* app;              // the subcommand, to test whether it was parsed
  std::function<int()> run;   // its action; returns the exit code
};
using Commands = std::vector<Command>;

// Parses argv, runs the chosen subcommand and returns the process exit code.
int run(int argc, char** argv);

void add_info_command(CLI::App& app, Commands& commands);
void add_prepare_command(CLI::App& app, Commands& commands);
void add_train_command(CLI::App& app, Commands& commands);
void add_generate_command(CLI::App& app, Commands& commands);
void add_eval_command(CLI::App& app, Commands& commands);
void add_ledger_command(CLI::App& app, Commands& commands);
void add_op_command(CLI::App& app, Commands& commands);
void add_export_command(CLI::App& app, Commands& commands);
void add_schema_command(CLI::App& app, Commands& commands);

}  // namespace moetrain::cli
