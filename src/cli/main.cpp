// The moetrain command line. Subcommands register themselves in cli/commands.h;
// a moetrain::Error is reported once, without a stack trace, with exit code 2.
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  try {
    return moetrain::cli::run(argc, argv);
  } catch (const moetrain::Error& e) {
    spdlog::error("{}", e.what());
    return 2;
  } catch (const std::exception& e) {
    spdlog::critical("unexpected error: {}", e.what());
    return 3;
  }
}
