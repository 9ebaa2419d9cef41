// The entry points of the MPI implementation (src/comm/mpi.cpp) that
// communicator.cpp uses. Declared without mpi.h, which only mpi.cpp includes.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace moetrain::comm::detail {

// Initialises MPI once (MPI_Init_thread, FUNNELED; MPI_Finalize registered at
// exit) and returns a communicator over a duplicate of MPI_COMM_WORLD.
std::unique_ptr<Communicator> mpi_world();
// MPI_Initialized and not MPI_Finalized.
bool mpi_active();
// MPI_Abort on MPI_COMM_WORLD.
[[noreturn]] void mpi_abort(int exit_code);

}  // namespace moetrain::comm::detail
