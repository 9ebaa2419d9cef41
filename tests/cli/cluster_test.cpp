// Cluster-shaped runs on one machine: the full Kimi-K3 topology (93 layers,
// 896 experts top-16 + 2 shared, AttnRes blocks of 12) under mpirun -np 4 at
// EP 4 through a crash and a resume, with the ledger's memory estimate checked
// against the measured peak RSS of every rank; and mpirun across two "hosts"
// (network namespaces joined by a veth pair) whose losses equal the one-host run.
// These are the most expensive CLI runs: their own ctest entry (cli_cluster).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include <fmt/format.h>

#include "testing.h"

using moetrain::testing::kLocalMpirun;
using moetrain::testing::metrics_history;
using moetrain::testing::metrics_losses;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;

string moetrain_bin() { return string(MOETRAIN_BINARY_DIR) + "/moetrain"; }

// Byte-level tinyshakespeare shards under dir/data.
void prepare_bytes(const string& dir) {
  Result r = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                             "/data/tinyshakespeare.txt --out " + dir +
                                             "/data --tokenizer byte --val-tokens 8192");
  INFO(r.output);
  REQUIRE(r.code == 0);
}

}  // namespace

TEST_CASE("cli: the full K3 topology (93 layers, 896 experts top-16, AttnRes S=12) trains under mpirun -np 4 "
          "at EP 4, survives a killed rank through its checkpoint, and stays within 15% of the ledger's memory",
          "[cli][cluster][slow]") {
  TempDir tmp;
  const string dir = tmp.path();
  prepare_bytes(dir);
  const string run = dir + "/run";
  const string args = string(kLocalMpirun) + "-np 4 " + moetrain_bin() + " train -c " + string(MOETRAIN_SOURCE_DIR) +
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
  const std::vector<double> loss = metrics_losses(run);
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

namespace {

// Two "hosts" h1 and h2: network namespaces joined by a veth pair named mt0 in
// both, 10.77.0.1/24 and 10.77.0.2/24, each process in them with its own
// hostname (a UTS namespace per launch). Removed again on destruction.
class NamespaceHosts {
 public:
  explicit NamespaceHosts(const string& dir) : suffix_("_" + std::to_string(::getpid())) {
    const string a = ns("h1"), b = ns("h2");
    const string setup = fmt::format(
        "ip netns add {0} && ip netns add {1} && "
        "ip link add mt0a netns {0} type veth peer name mt0b netns {1} && "
        "ip -n {0} link set mt0a name mt0 && ip -n {1} link set mt0b name mt0 && "
        "ip -n {0} addr add 10.77.0.1/24 dev mt0 && ip -n {1} addr add 10.77.0.2/24 dev mt0 && "
        "ip -n {0} link set lo up && ip -n {0} link set mt0 up && "
        "ip -n {1} link set lo up && ip -n {1} link set mt0 up",
        a, b);
    Result r = moetrain::testing::capture_command(setup);
    created_ = true;
    if (r.code != 0) {
      why_not_ = r.output;
      return;
    }
    // Open MPI's launcher calls `agent HOST COMMAND...`, as it would call ssh.
    agent_ = dir + "/netns-agent.sh";
    std::ofstream(agent_) << "#!/bin/sh\nhost=$1; shift\nexec ip netns exec mt${host}" << suffix_
                          << " unshare --uts sh -c \"hostname $host; $*\"\n";
    fs::permissions(agent_, fs::perms::owner_all);
    hostfile_ = dir + "/hosts";
    std::ofstream(hostfile_) << "h1 slots=2\nh2 slots=2\n";
  }
  ~NamespaceHosts() {
    if (created_)
      moetrain::testing::capture_command(fmt::format("ip netns del {}; ip netns del {}", ns("h1"), ns("h2")));
  }
  bool ok() const { return why_not_.empty(); }
  const string& why_not() const { return why_not_; }
  // A shell command run on h1 (where mpirun starts, as on a cluster's first node).
  string on_h1(const string& command) const {
    return "ip netns exec " + ns("h1") + " unshare --uts sh -c " +
           moetrain::testing::shell_quote("hostname h1 && " + command);
  }
  const string& agent() const { return agent_; }
  const string& hostfile() const { return hostfile_; }
  // Bytes h2 received over the veth so far.
  int64_t h2_rx_bytes() const {
    Result r = moetrain::testing::capture_command("ip netns exec " + ns("h2") +
                                                  " cat /sys/class/net/mt0/statistics/rx_bytes");
    return r.code == 0 ? std::stoll(r.output) : -1;
  }

 private:
  string ns(const string& host) const { return "mt" + host + suffix_; }
  string suffix_, agent_, hostfile_, why_not_;
  bool created_ = false;
};

}  // namespace

TEST_CASE("cli: launch/multinode.sh across two hosts (network namespaces, TCP over a veth pair) trains k3-tiny "
          "with the same losses as one host, experts and data parallelism across hosts", "[cli][cluster][slow]") {
  if (::geteuid() != 0) {
    WARN("skipped: creating network namespaces needs root");
    return;
  }
  TempDir tmp;
  const string dir = tmp.path();
  NamespaceHosts hosts(dir);
  if (!hosts.ok()) {
    WARN("skipped: cannot create network namespaces here (ip netns / veth): " << hosts.why_not());
    return;
  }
  prepare_bytes(dir);
  const string src = MOETRAIN_SOURCE_DIR;
  const string train = src + "/configs/k3-tiny.yaml --set data.train=" + dir +
                       "/data/train_*.bin --set data.val= --set train.max_steps=8 --set train.warmup_steps=2 "
                       "--set train.batch_size=2 --set train.seq_len=32 --set train.threads=1 --set train.log_every=1 "
                       "--set model.n_layer=4 --set model.attn_res_block_size=2";
  // EP 4: every all-to-all crosses the hosts. EP 2 x DP 2: expert groups inside
  // a host, the gradient all-reduce between them.
  for (int ep : {4, 2}) {
    INFO("ep " << ep);
    const string one = dir + "/one_ep" + std::to_string(ep), two = dir + "/two_ep" + std::to_string(ep);
    const string sets = " --set train.ep=" + std::to_string(ep);
    Result local = moetrain::testing::capture_command(string(kLocalMpirun) + "-np 4 " + moetrain_bin() +
                                                      " train -c " + train + sets + " --set run.dir=" + one);
    INFO(local.output);
    REQUIRE(local.code == 0);

    const int64_t rx_before = hosts.h2_rx_bytes();
    const string launch = "cd " + moetrain::testing::shell_quote(src) + " && BUILD_DIR=" +
                          moetrain::testing::shell_quote(MOETRAIN_BINARY_DIR) +
                          " MOETRAIN_MPIRUN_ARGS='--oversubscribe --mca plm_rsh_agent " + hosts.agent() +
                          " -x OMP_NUM_THREADS=1' launch/multinode.sh --iface mt0 " + hosts.hostfile() + " 4 " +
                          train + sets + " --set run.dir=" + two;
    Result remote = moetrain::testing::capture_command(hosts.on_h1(launch));
    INFO(remote.output);
    REQUIRE(remote.code == 0);
    CHECK(remote.output.find("rank   1 | host h1") != string::npos);
    CHECK(remote.output.find("rank   2 | host h2") != string::npos);
    CHECK(hosts.h2_rx_bytes() - rx_before > (1 << 20));  // the traffic went over the veth
    CHECK(metrics_history(two) == metrics_history(one));
  }
}
