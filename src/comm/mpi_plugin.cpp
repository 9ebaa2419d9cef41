// Finds and loads libmoetrain_mpi.so (comm/mpi_world.h): the MPI communicator is
// a plugin, so only runs that use MPI load Open MPI.
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

#include "comm/mpi_world.h"

#ifndef MOETRAIN_MPI_PLUGIN_BUILD_DIR
#define MOETRAIN_MPI_PLUGIN_BUILD_DIR ""
#endif

namespace moetrain::comm::detail {

namespace {

std::atomic<const MpiPlugin*> g_mpi_plugin{nullptr};

// The folder of the running executable ("" when /proc/self/exe cannot be read).
std::string executable_dir() {
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : exe.parent_path().string();
}

// Where to look, in order: $MOETRAIN_MPI_PLUGIN alone when set; else beside the
// executable, then the build folder compiled in (tests and benchmarks built elsewhere).
std::vector<std::string> mpi_plugin_candidates() {
  if (const char* forced = std::getenv("MOETRAIN_MPI_PLUGIN"); forced && *forced) return {forced};
  std::vector<std::string> paths;
  if (const std::string dir = executable_dir(); !dir.empty()) paths.push_back(dir + "/" + kMpiPluginFile);
  const std::string build_dir = MOETRAIN_MPI_PLUGIN_BUILD_DIR;
  if (!build_dir.empty()) {
    const std::string p = build_dir + "/" + kMpiPluginFile;
    if (paths.empty() || paths.front() != p) paths.push_back(p);
  }
  return paths;
}

const MpiPlugin* open_mpi_plugin() {
  std::vector<std::string> failures;
  for (const std::string& path : mpi_plugin_candidates()) {
    if (::access(path.c_str(), F_OK) != 0) {
      failures.push_back(fmt::format("{}: no such file", path));
      continue;
    }
    // RTLD_GLOBAL: Open MPI opens its own components with dlopen, and they look
    // for libmpi's symbols in the global scope.
    void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (!handle) {
      const char* why = ::dlerror();
      failures.push_back(fmt::format("{}: {}", path, why ? why : "dlopen failed"));
      continue;
    }
    using Entry = const MpiPlugin* (*)();
    auto entry = reinterpret_cast<Entry>(::dlsym(handle, kMpiPluginEntry));
    if (!entry) {
      failures.push_back(fmt::format("{}: no symbol {} (not a moetrain MPI plugin)", path, kMpiPluginEntry));
      continue;
    }
    const MpiPlugin* plugin = entry();
    if (!plugin || plugin->abi != kMpiPluginAbi || plugin->communicator_size != sizeof(Communicator)) {
      failures.push_back(fmt::format("{}: built for another moetrain (plugin ABI {}, this binary's {}); rebuild "
                                     "both from one checkout",
                                     path, plugin ? plugin->abi : -1, kMpiPluginAbi));
      continue;  // the handle stays open: a stale plugin may hold static objects
    }
    return plugin;
  }
  MT_THROW("this run uses MPI (launched by mpirun/srun, or MOETRAIN_MPI=1) but moetrain's MPI plugin {} could not "
           "be loaded:\n  {}\nBuild it with the binaries (launch/build.sh builds it beside them), or point "
           "MOETRAIN_MPI_PLUGIN at it; MOETRAIN_MPI=0 runs without MPI (one process)",
           kMpiPluginFile, fmt::join(failures, "\n  "));
}

}  // namespace

const MpiPlugin& load_mpi_plugin() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (const MpiPlugin* p = g_mpi_plugin.load()) return *p;
  const MpiPlugin* p = open_mpi_plugin();
  g_mpi_plugin.store(p);
  return *p;
}

const MpiPlugin* loaded_mpi_plugin() { return g_mpi_plugin.load(); }

}  // namespace moetrain::comm::detail
