// Faults under mpirun -np 4 (k3-tiny with its MoE, one thread per rank), made by
// the fault: section (a testing aid): a rank that stops (SIGSTOP, a hang) must
// end the whole job through the collective watchdog (dist.timeout_s) with exit
// code 42 and a line naming rank, step and operation; a rank that is killed
// (SIGKILL) must end the job quickly, non-zero. In both cases no process of the
// run may be left behind.
#include <catch2/catch.hpp>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "testing.h"

using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;
using Clock = std::chrono::steady_clock;

// Byte-level tinyshakespeare shards in dir/data.
void prepare(const string& dir) {
  Result r = moetrain::testing::run_moetrain("prepare " + string(MOETRAIN_SOURCE_DIR) +
                                             "/data/tinyshakespeare.txt --out " + dir +
                                             "/data --tokenizer byte --val-tokens 8192");
  INFO(r.output);
  REQUIRE(r.code == 0);
}

// A k3-tiny training of up to 20 steps on 4 ranks; stdin closed (mpirun forwards
// it to rank 0), an outer limit in case nothing ends the job.
string mpirun_train(const string& dir, const string& run_dir, const string& extra) {
  return "timeout -s KILL 120 mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader "
         "--mca btl_vader_single_copy_mechanism none --mca mpi_yield_when_idle 1 -x OMP_NUM_THREADS=1 -np 4 " +
         string(MOETRAIN_BINARY_DIR) + "/moetrain train -c " + string(MOETRAIN_SOURCE_DIR) +
         "/configs/k3-tiny.yaml --set data.train=" + dir + "/data/train_*.bin --set data.val= "
         "--set train.max_steps=20 --set train.warmup_steps=5 --set train.batch_size=4 --set train.seq_len=32 "
         "--set train.eval_every=0 --set train.sample_every=0 --set train.threads=1 --set train.log_every=1 "
         "--set run.dir=" + run_dir + " " + extra + " < /dev/null";
}

// Live processes (not zombies: their command line is empty) whose command line
// contains `needle`, as "pid: command line".
std::vector<string> processes_with(const string& needle) {
  std::vector<string> out;
  for (const fs::directory_entry& e : fs::directory_iterator("/proc")) {
    const string pid = e.path().filename().string();
    if (pid.find_first_not_of("0123456789") != string::npos || pid == std::to_string(::getpid())) continue;
    std::ifstream in(e.path() / "cmdline", std::ios::binary);  // empty when it ended meanwhile
    string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (char& c : cmdline)
      if (c == '\0') c = ' ';
    if (cmdline.find(needle) != string::npos) out.push_back(pid + ": " + cmdline);
  }
  return out;
}

// Waits up to 3 s for the processes of a run to be gone (the launcher may
// return while the kernel still delivers its SIGKILLs); kills what remains, so
// that a failing test leaves nothing behind either, and returns it.
std::vector<string> leftovers(const string& run_dir) {
  std::vector<string> left = processes_with(run_dir);
  for (int i = 0; i < 30 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left = processes_with(run_dir);
  }
  for (const string& p : left) ::kill(std::stoi(p), SIGKILL);
  return left;
}

// The time of day, in seconds, of the first log line ("[HH:MM:SS] ...") that
// contains `text`; -1 if none.
int stamp_of(const string& output, const string& text) {
  std::smatch m;
  const std::regex line(R"(\[(\d\d):(\d\d):(\d\d)\] ([^\n]*))");
  for (auto it = output.cbegin(); std::regex_search(it, output.cend(), m, line); it = m.suffix().first)
    if (m[4].str().find(text) != string::npos) return std::stoi(m[1]) * 3600 + std::stoi(m[2]) * 60 + std::stoi(m[3]);
  return -1;
}

}  // namespace

TEST_CASE("cli: a stopped rank (fault.kind = stop) ends the job through the watchdog, exit 42, nothing left",
          "[cli][slow]") {
  TempDir tmp;
  prepare(tmp.path());
  const string run_dir = tmp.path() + "/stopped-run";
  const auto t0 = Clock::now();
  Result r = moetrain::testing::capture_command(mpirun_train(
      tmp.path(), run_dir, "--set train.ep=2 --set dist.timeout_s=5 --set fault.kind=stop --set fault.rank=1 "
                           "--set fault.step=3"));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  INFO(r.output << "\n(" << seconds << " s)");
  const std::vector<string> left = leftovers(run_dir);
  INFO("left over:\n" << fmt::format("{}", fmt::join(left, "\n")));
  CHECK(left.empty());
  CHECK(r.code == 42);
  CHECK(r.output.find("dp 2 x ep 2") != string::npos);
  CHECK(r.output.find("fault injection: rank 1 sends itself SIGSTOP at the start of step 3") != string::npos);
  CHECK(r.output.find("step 2/20 | loss") != string::npos);
  CHECK(r.output.find("step 3/20 | loss") == string::npos);
  // A peer of the stopped rank names itself, the operation, what it was for and the step.
  CHECK(std::regex_search(r.output, std::regex(R"(watchdog: rank [023] of 4 \(host [^)]+\) has waited [5-9]\.\d s in )"
                                               R"([a-z_]+( \([a-zA-Z ]+\))? at step 3 \(dist\.timeout_s = 5\): )"
                                               R"(another rank is hung, dead or slower than the timeout; )"
                                               R"(ending the job \(exit code 42\))")));
  // The job ends within the timeout (plus the monitor's poll and the teardown)
  // of the stop: compare the stamps of the two lines (whole seconds). The whole
  // run (about 10 s here, 4 s of it start-up) gets a loose bound.
  const int stopped = stamp_of(r.output, "fault injection: rank 1 sends itself SIGSTOP");
  const int fired = stamp_of(r.output, "watchdog: rank ");
  REQUIRE(stopped >= 0);
  REQUIRE(fired >= 0);
  CHECK((fired - stopped + 86400) % 86400 >= 4);  // a peer may have begun waiting just before the stop
  CHECK((fired - stopped + 86400) % 86400 <= 7);
  CHECK(seconds < 60);
}

TEST_CASE("cli: a killed rank (fault.kind = kill) ends the job quickly, non-zero, nothing left", "[cli][slow]") {
  TempDir tmp;
  prepare(tmp.path());
  const string run_dir = tmp.path() + "/killed-run";
  const auto t0 = Clock::now();
  // The default dist.timeout_s (600 s): the launcher, not the watchdog, ends this job.
  Result r = moetrain::testing::capture_command(mpirun_train(
      tmp.path(), run_dir, "--set train.ep=4 --set fault.kind=kill --set fault.rank=1 --set fault.step=3"));
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  INFO(r.output << "\n(" << seconds << " s)");
  const std::vector<string> left = leftovers(run_dir);
  INFO("left over:\n" << fmt::format("{}", fmt::join(left, "\n")));
  CHECK(left.empty());
  CHECK(r.code != 0);
  CHECK(r.output.find("dp 1 x ep 4") != string::npos);
  CHECK(r.output.find("fault injection: rank 1 sends itself SIGKILL at the start of step 3") != string::npos);
  CHECK(r.output.find("signal 9") != string::npos);  // mpirun names the cause
  CHECK(r.output.find("watchdog:") == string::npos);
  CHECK(seconds < 30);  // about 5 s here, 4 s of it start-up; the launcher ends the job about 1 s after the kill
}

TEST_CASE("cli: fault.kind = kill or stop on a rank outside the run, or at no step, is refused", "[cli][errors]") {
  TempDir tmp;
  prepare(tmp.path());
  auto train = [&](const string& fault) {
    return moetrain::testing::run_moetrain(
        "train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/k3-tiny.yaml --set data.train=" + tmp.path() +
        "/data/train_*.bin --set data.val= --set train.max_steps=2 --set train.threads=1 --set run.dir=" + tmp.path() +
        "/run " + fault);
  };
  Result rank = train("--set fault.kind=stop --set fault.rank=1 --set fault.step=1");
  INFO(rank.output);
  CHECK(rank.code == 2);
  CHECK(rank.output.find("--set fault.rank=1: fault.rank = 1: is not a rank of this run, which has 1 rank; "
                         "fault.kind = stop would never fire") != string::npos);
  Result step = train("--set fault.kind=kill --set fault.rank=0");
  INFO(step.output);
  CHECK(step.code == 2);
  CHECK(step.output.find("fault.step = 0 (default): fault.kind = kill needs a step (1-based) to fire at") !=
        string::npos);
}

TEST_CASE("cli: an allocation the machine cannot hold exits 4 with one line naming the bytes", "[cli][errors]") {
  TempDir tmp;
  prepare(tmp.path());
  // Under ASan (launch/test.sh's sanitizer pass) the failed allocation must return
  // null, not abort; the pass's own options (detect_leaks=0) are kept.
  const string train = "ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}allocator_may_return_null=1 " +
                       string(MOETRAIN_BINARY_DIR) +
                       "/moetrain train -c " + string(MOETRAIN_SOURCE_DIR) + "/configs/gpt2-shakespeare.yaml "
                       "--set model.n_layer=1 --set model.n_head=2 --set model.d_model=32 --set train.seq_len=16 "
                       "--set data.tokenizer=byte --set data.train=" + tmp.path() + "/data/train_*.bin --set data.val= "
                       "--set run.dir=" + tmp.path() + "/run ";
  // model.n_ctx = 2e9: the position table alone is 2e9 x 32 f32 = 256 GB, refused
  // before anything is allocated, naming the group and the keys that size it.
  Result r = moetrain::testing::capture_command(train + "--set model.vocab_size=256 --set model.n_ctx=2000000000 "
                                                "--set train.batch_size=2");
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("of weights alone, more than this machine's"));
  CHECK_THAT(r.output, Catch::Contains("model.vocab_size x model.d_model (and model.n_ctx x model.d_model)"));
  // Activations: 60,000 windows of 16 tokens give logits of 60000 x 16 x 50257 f32
  // (193 GB): the allocation fails and the line names the bytes and the tensor.
  r = moetrain::testing::capture_command(train + "--set model.vocab_size=50257 --set model.n_ctx=16 "
                                         "--set train.batch_size=60000 --set run.overwrite=true");
  INFO(r.output);
  CHECK(r.code == 4);
  CHECK_THAT(r.output, Catch::Contains("out of host memory: failed to allocate") &&
                           Catch::Contains("for a tensor of shape"));
}
