// The MPI plugin (comm/mpi_world.h, docs/distributed.md "MPI is loaded only under a
// launcher"): a run of one process never loads Open MPI, and a run that asks for
// MPI without a loadable plugin stops with the paths it tried. The MPI runs
// themselves (ctest comm_mpi_np1/2/4, the [cli][slow] mpirun cases) load it.
#include <catch2/catch.hpp>

#include <fstream>
#include <string>

#include "comm/communicator.h"
#include "moetrain.h"
#include "testing.h"

using moetrain::testing::TempDir;
using std::string;

namespace {

// The path of a file mapped into this process whose path contains `name`; "" if none.
string mapped_path(const string& name) {
  std::ifstream maps("/proc/self/maps");
  string line;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash != string::npos && line.find(name, slash) != string::npos) return line.substr(slash);
  }
  return "";
}

bool mapped(const string& name) { return !mapped_path(name).empty(); }

// `moetrain train` on the quickstart config for one step, with `env` before it (the plugin is loaded before the data is read).
moetrain::testing::CommandOutput train_with(const string& env, const TempDir& dir) {
  return moetrain::testing::capture_command("env " + env + " " + string(MOETRAIN_BINARY_DIR) + "/moetrain train -c " +
                                           string(MOETRAIN_SOURCE_DIR) +
                                           "/configs/gpt2-shakespeare.yaml --set train.max_steps=1 --set train.warmup_steps=0 --set run.dir=" +
                                           dir.path() + "/run");
}

}  // namespace

TEST_CASE("a one-process world loads neither Open MPI nor the MPI plugin", "[comm]") {
  if (moetrain::comm::launched_with_mpi() || std::getenv("MOETRAIN_MPI")) return;  // ctest comm_mpi_np*: MPI's own
  REQUIRE(moetrain::comm::world().size() == 1);
  CHECK_FALSE(moetrain::comm::mpi_active());
  CHECK_FALSE(mapped("libmpi.so"));
  CHECK_FALSE(mapped("libopen-pal"));
  CHECK_FALSE(mapped("libmoetrain_mpi.so"));
}

TEST_CASE("a run that asks for MPI without a loadable plugin names what it tried", "[comm][cli]") {
  TempDir dir;
  SECTION("no such file") {
    const auto run = train_with("MOETRAIN_MPI=1 MOETRAIN_MPI_PLUGIN=" + dir.path() + "/nowhere.so", dir);
    CHECK(run.code == 2);
    CHECK(run.output.find("MPI plugin libmoetrain_mpi.so could not be loaded") != string::npos);
    CHECK(run.output.find(dir.path() + "/nowhere.so: no such file") != string::npos);
    CHECK(run.output.find("MOETRAIN_MPI=0 runs without MPI") != string::npos);
  }
  SECTION("a file that is not a shared object") {
    const string junk = dir.path() + "/libmoetrain_mpi.so";
    moetrain::testing::write_bytes(junk, "not an ELF file\n");
    const auto run = train_with("MOETRAIN_MPI=1 MOETRAIN_MPI_PLUGIN=" + junk, dir);
    CHECK(run.code == 2);
    CHECK(run.output.find(junk + ": ") != string::npos);
    CHECK(run.output.find("could not be loaded") != string::npos);
  }
  SECTION("a shared object that is not our plugin") {
    const string other = mapped_path("libfmt.so");  // loaded by every binary of ours
    REQUIRE(!other.empty());
    const auto run = train_with("MOETRAIN_MPI=1 MOETRAIN_MPI_PLUGIN=" + other, dir);
    CHECK(run.code == 2);
    CHECK(run.output.find(other + ": no symbol moetrain_mpi_plugin (not a moetrain MPI plugin)") != string::npos);
  }
}
