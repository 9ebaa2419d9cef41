// The moetrain command line. Subcommands live in cli/<name>.cpp. Logs go to
// stderr (program output such as generated text and eval results to stdout);
// a moetrain::Error is reported once, without a stack trace, with exit code 2
// (3 for a numerical failure, 1 for anything unexpected).
// Under mpirun with several ranks an error ends the whole job (MPI_Abort): the
// other ranks may be waiting in a collective for this one.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/error.h"

namespace {

int fail(int code) {
  if (moetrain::comm::mpi_active() && moetrain::comm::world().size() > 1) moetrain::comm::abort_job(code);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::set_default_logger(spdlog::stderr_color_mt("moetrain"));
  spdlog::set_pattern("[%H:%M:%S] %^%v%$");
  try {
    return moetrain::cli::run(argc, argv);
  } catch (const moetrain::NumericalError& e) {
    spdlog::error("{}", e.what());
    return fail(3);
  } catch (const moetrain::Error& e) {
    spdlog::error("{}", e.what());
    return fail(2);
  } catch (const std::exception& e) {
    spdlog::critical("unexpected error: {}", e.what());
    return fail(1);
  }
}
