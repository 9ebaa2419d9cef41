// The moetrain command line. Subcommands live in cli/<name>.cpp. Logs go to
// stderr (program output such as generated text and eval results to stdout);
// a moetrain::Error is reported once, without a stack trace, with exit code 2.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("moetrain"));
  spdlog::set_pattern("[%H:%M:%S] %^%v%$");
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
