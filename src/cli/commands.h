// The CLI's subcommands. Each lives in its own file (cli/<name>.cpp) and
// registers itself on the app with an add_<name>_command function; run()
// parses argv and runs the chosen one.
#pragma once

#include <functional>
#include <vector>

namespace CLI {
class App;
class Validator;
}

namespace moetrain::cli {

struct Command {
  CLI::App* app;              // the subcommand, to test whether it was parsed
  std::function<int()> run;   // its action; returns the exit code
};
using Commands = std::vector<Command>;

// Parses argv, runs the chosen subcommand and returns the process exit code. A
// command-line mistake throws moetrain::Error (exit 2): one line saying what was
// wrong and which `--help` to run; --help and --version print and return 0.
int run(int argc, char** argv);

// Option checks with one-line messages ("--top-k: must be >= 0, got -1"), instead
// of CLI::PositiveNumber's "not in range 0.000000 to 1797693134862315708...".
CLI::Validator at_least(double min);
CLI::Validator positive();      // at_least(1)
CLI::Validator non_negative();  // at_least(0)

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
