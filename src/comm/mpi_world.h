// The MPI implementation is a plugin: src/comm/mpi.cpp is built as
// libmoetrain_mpi.so (the only file that includes mpi.h, the only one that links
// Open MPI), and communicator.cpp loads it with dlopen the first time a run uses
// MPI (docs/distributed.md, "MPI is loaded only under a launcher"). A binary that
// never runs under mpirun never loads Open MPI's chain (libopen-rte, hwloc,
// libevent: glibc 2.36), so the one-GPU bundle starts on older images
// (docs/cuda.md, "The bundle"). The plugin resolves our own symbols against the
// executable that loads it (every executable is linked with its symbols exported).
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace moetrain::comm::detail {

// Bumped whenever MpiPlugin or Communicator changes shape; a plugin of another
// version is refused (a stale libmoetrain_mpi.so beside a rebuilt binary).
inline constexpr int kMpiPluginAbi = 1;

// What the plugin hands the loader (mpi.cpp fills it).
struct MpiPlugin {
  int abi;                 // kMpiPluginAbi of the plugin's build
  size_t communicator_size;  // sizeof(Communicator) there: a second guard against a stale plugin
  // Initialises MPI once (MPI_Init_thread, FUNNELED; MPI_Finalize registered at
  // exit) and returns a communicator over a duplicate of MPI_COMM_WORLD.
  std::unique_ptr<Communicator> (*world)();
  // MPI_Initialized and not MPI_Finalized.
  bool (*active)();
  // MPI_Abort on MPI_COMM_WORLD; does not return.
  void (*abort)(int exit_code);
};

// The plugin's entry point, a C name so dlsym finds it.
inline constexpr const char* kMpiPluginEntry = "moetrain_mpi_plugin";
inline constexpr const char* kMpiPluginFile = "libmoetrain_mpi.so";

// Loads the plugin once (thread-safe) and returns it. Looks at
// $MOETRAIN_MPI_PLUGIN (a path; used alone when set), then beside the running
// executable, then in the build folder the binary was built in. Throws Error
// naming every path tried and the loader's reason when none loads.
const MpiPlugin& load_mpi_plugin();
// The plugin when load_mpi_plugin() has succeeded, else nullptr (never loads).
const MpiPlugin* loaded_mpi_plugin();

}  // namespace moetrain::comm::detail
