// Cluster-shaped runs on one machine: the full Kimi-K3 topology (93 layers,
// 896 experts top-16 + 2 shared, AttnRes blocks of 12) under mpirun -np 4 at
// EP 4 through a crash and a resume, with the ledger's memory estimate checked
// against the measured peak RSS of every rank; and mpirun across two "hosts"
// (network namespaces joined by a veth pair) whose losses equal the one-host run.
// These are the most expensive CLI runs: their own ctest entry (cli_cluster).
#include <catch2/catch.hpp>

#include <filesystem>
#include <regex>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

const string kMpirun = "mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "
                       "--mca btl_vader_single_copy_mechanism none -x OMP_NUM_THREADS=1 ";

string moetrain_bin() { return string(MOETRAIN_BINARY_DIR) + "/moetrain"; }

// Byte-level tinyshakespeare shards under dir/data.
void prepare_bytes(const string& dir) {
  Result r = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                             "/data/tinyshakespeare.txt --out " + dir +
                                             "/data --tokenizer byte --val-tokens 8192");
  INFO(r.output);
  REQUIRE(r.code == 0);
}

std::vector<double> losses(const string& run_dir) {
  std::stringstream in(moetrain::testing::read_bytes(run_dir + "/metrics.jsonl"));
  std::vector<double> out;
  for (string line; std::getline(in, line);)
    if (auto at = line.find("\"loss\":"); at != string::npos) out.push_back(std::stod(line.substr(at + 7)));
  return out;
}

}  // namespace

TEST_CASE("cli: the full K3 topology (93 layers, 896 experts top-16, AttnRes S=12) trains under mpirun -np 4 "
          "at EP 4, survives a killed rank through its checkpoint, and stays within 15% of the ledger's memory",
          "[cli][cluster][slow]") {
  TempDir tmp;
  const string dir = tmp.path();
  prepare_bytes(dir);
  const string run = dir + "/run";
  const string args = kMpirun + "-np 4 " + moetrain_bin() + " train -c " + string(MOETRAIN_SOURCE_DIR) +
                      "/configs/k3-topology-mini.yaml --set data.train=" + dir +
                      "/data/train_*.bin --set data.val= --set train.max_steps=4 --set ckpt.every=2 --set run.dir=" +
                      run;

  // A rank dies at step 3: the job ends, checkpoint step 2 is complete.
  Result killed = moetrain::testing::capture_command(
      args + " --set fault.kind=kill --set fault.rank=2 --set fault.step=3");
  INFO(killed.output);
  REQUIRE(killed.code != 0);
  CHECK(killed.output.find("93 layers (69 kda, 24 mla, 0 attention)") != string::npos);
  CHECK(killed.output.find("attn_res S=12") != string::npos);
  CHECK(killed.output.find("4 rank(s): dp 1 x ep 4") != string::npos);
  REQUIRE(fs::exists(run + "/checkpoints/step_00000002/COMMIT"));
  for (int r = 0; r < 4; ++r)  // every rank wrote its experts: 896 / 4 of them
    CHECK(fs::exists(fmt::format("{}/checkpoints/step_00000002/rank_{:05d}.h5", run, r)));

  Result resumed = moetrain::testing::capture_command(args + " --set ckpt.resume=auto");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(resumed.output.find("resumed from " + run + "/checkpoints/step_00000002 (step 2") != string::npos);
  const std::vector<double> loss = losses(run);
  REQUIRE(loss.size() == 4);  // steps 1-2 from the first run, 3-4 from the resumed one
  CHECK(loss[3] < loss[0] - 0.3);  // 896 experts learn: ln 256 = 5.55 at the start

  // "peak RSS X (rank r; lowest Y) against Z predicted = the ledger's ... : peak / predicted = R"
  std::smatch m;
  REQUIRE(std::regex_search(resumed.output, m, std::regex(R"(peak / predicted = ([0-9.]+))")));
  const double ratio = std::stod(m[1]);
  CHECK(ratio > 0.85);
  CHECK(ratio < 1.15);

  // The model directory has K3's shape under Kimi's names.
  const string config = moetrain::testing::read_bytes(run + "/model/config.json");
  CHECK(config.find("\"num_experts\": 896") != string::npos);
  CHECK(config.find("\"num_experts_per_token\": 16") != string::npos);
  CHECK(config.find("\"num_hidden_layers\": 93") != string::npos);
}
