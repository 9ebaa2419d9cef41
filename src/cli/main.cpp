// The moetrain command line. Subcommands live in cli/<name>.cpp. Logs go to
// stderr (program output such as generated text and eval results to stdout);
// a moetrain::Error is reported once, without a stack trace, with the exit code of
// its class (core/error.h: 2 bad input, 3 numerical, 4 out of memory, 5 I/O; the
// watchdog exits 42; a stop signal before training started 0 or 75, as
// core/signals.h says; 1 for anything unexpected). The stop signals are caught
// from the first line on (core/signals.h), before any argument is read.
// Under mpirun with several ranks an error ends the whole job (MPI_Abort): the
// other ranks may be waiting in a collective for this one.
#include <new>

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "backend/cpu/parallel.h"
#include "cli/commands.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/signals.h"

namespace {

int fail(int code) {
  if (moetrain::comm::mpi_active() && moetrain::comm::world().size() > 1) moetrain::comm::abort_job(code);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace moetrain;
  cpu::reexec_with_short_spin(argv);  // an exec: the handlers come after it
  signals::install();
  spdlog::set_default_logger(spdlog::stderr_color_mt("moetrain"));
  spdlog::set_pattern("[%H:%M:%S] %^%v%$");
  try {
    return cli::run(argc, argv);
  } catch (const Interrupted& e) {
    spdlog::warn("{}", e.what());
    return fail(e.exit_code());
  } catch (const NumericalError& e) {
    spdlog::error("{}", e.what());
    return fail(kExitNumerical);
  } catch (const OutOfMemoryError& e) {
    spdlog::error("{}", e.what());
    return fail(kExitOutOfMemory);
  } catch (const IoError& e) {
    spdlog::error("{}", e.what());
    return fail(kExitIo);
  } catch (const Error& e) {
    spdlog::error("{}", e.what());
    return fail(kExitBadInput);
  } catch (const std::bad_alloc&) {
    spdlog::error("out of memory (a standard-library allocation failed); lower train.batch_size or train.seq_len");
    return fail(kExitOutOfMemory);
  } catch (const std::exception& e) {
    spdlog::critical("unexpected error: {}", e.what());
    return fail(1);
  }
}
