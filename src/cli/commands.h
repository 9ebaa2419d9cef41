// Subcommand registry of the CLI.
#pragma once

namespace moetrain::cli {

// Parses argv, runs the chosen subcommand and returns the process exit code.
int run(int argc, char** argv);

}  // namespace moetrain::cli
