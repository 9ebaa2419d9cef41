// Checkpoints, run directories and exports against a hostile user (issue 35):
// nothing already written is lost, nothing wrong is loaded or published
// silently. `export --out` that would delete the source or a run's checkpoints,
// a run.lock deleted under a live run, a run ending inside a streak of skipped
// non-finite steps, hand-edited checkpoint fields, a damaged newest manifest,
// rank files that are directories or devices, leftovers of killed exports,
// --out or --checkpoint that is a file. A tiny byte-level GPT-2, one thread.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_fixtures.h"
#include "core/error.h"
#include "io/paths.h"
#include "testing.h"
#include "train/run_dir.h"

using moetrain::testing::read_bytes;
using moetrain::testing::TempDir;
using moetrain::testing::write_bytes;
using std::string;
namespace fs = std::filesystem;
using json = nlohmann::json;

using moetrain::testing::one_to;
using moetrain::testing::steps_of;

namespace {

using Result = moetrain::testing::CommandOutput;

Result run(const string& args) { return moetrain::testing::run_moetrain(args); }

using Job = moetrain::testing::TinyGpt2Runs;

// The names in a directory, sorted.
std::vector<string> names_in(const string& dir) {
  std::vector<string> out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Edits a rank file of a checkpoint with h5py (an attribute of "/" set to an integer
// or a string, or element 0 of a dataset set to a value), then makes manifest.json's
// size and SHA-256 of that file match, so only the edited field is wrong.
void edit_rank_file(const string& checkpoint, const string& what, const string& name, const string& value) {
  const string script =
      "import h5py, hashlib, json, sys\n"
      "d, what, name, value = sys.argv[1:5]\n"
      "f = d + '/rank_00000.h5'\n"
      "with h5py.File(f, 'r+') as h:\n"
      "    if what == 'int': h.attrs[name] = int(value)\n"
      "    elif what == 'str': h.attrs[name] = value\n"
      "    else:\n"
      "        x = h[name][...]; x.flat[0] = float(value); h[name][...] = x\n"
      "m = json.load(open(d + '/manifest.json'))\n"
      "data = open(f, 'rb').read()\n"
      "m['files'][0]['bytes'] = len(data); m['files'][0]['sha256'] = hashlib.sha256(data).hexdigest()\n"
      "json.dump(m, open(d + '/manifest.json', 'w'))\n";
  write_bytes(checkpoint + "/../edit.py", script);
  REQUIRE(moetrain::testing::run_command("/usr/bin/python3 " + checkpoint + "/../edit.py " + checkpoint + " " + what +
                                         " " + name + " '" + value + "'") == 0);
}

}  // namespace

TEST_CASE("cli: export --out that holds the source or a run's checkpoints, or lies in a live run, is refused (exit 2 "
          "naming both paths); nothing is deleted", "[cli]") {
  Job job;
  REQUIRE(job.train("run", 20).code == 0);
  const string source = job.path("run", "checkpoints/step_00000020");
  const std::vector<string> before = names_in(job.path("run", "checkpoints"));
  struct Case {
    string out, says;
  };
  const Case cases[] = {
      {job.path("run", "checkpoints"), " contains the --checkpoint " + source},  // the issue's: every checkpoint gone
      {job.path("run"), " contains the --checkpoint " + source},
      {job.path("run", "checkpoints/"), " contains the --checkpoint " + source},
      {job.path("run", "checkpoints/../checkpoints"), " contains the --checkpoint " + source},
      {job.dir, " contains the --checkpoint " + source},
  };
  for (const Case& c : cases) {
    INFO(c.out);
    Result r = run("export --checkpoint " + source + " --out " + c.out + " --force --no-progress");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("--out " + c.out + c.says) != string::npos);
  }
  CHECK(names_in(job.path("run", "checkpoints")) == before);
  CHECK(fs::exists(source + "/COMMIT"));

  // Another run's directory (not the source's): --force would delete its checkpoints.
  REQUIRE(job.train("other", 10).code == 0);
  Result other = run("export --checkpoint " + source + " --out " + job.path("other") + " --force --no-progress");
  INFO(other.output);
  CHECK(other.code == 2);
  CHECK(other.output.find("--out " + job.path("other") + " holds " + job.path("other") + "/") != string::npos);
  CHECK(other.output.find("part of a training run or checkpoint, which --force would delete with it (the "
                          "--checkpoint is " + source + ")") != string::npos);
  CHECK(fs::exists(job.path("other", "checkpoints/step_00000010/COMMIT")));

  // A model directory an earlier export wrote is replaced as before.
  REQUIRE(run("export --checkpoint " + source + " --out " + job.path("exported") + " --no-progress").code == 0);
  Result replaced = run("export --checkpoint " + source + " --out " + job.path("exported") + " --force --no-progress");
  INFO(replaced.output);
  CHECK(replaced.code == 0);

  // Inside a run directory that a live run holds: refused while it runs.
  const string log = job.path("live.log");
  Result live = moetrain::testing::capture_command(
      "{ " + string(MOETRAIN_BINARY_DIR) + "/moetrain " + job.args("live", 100000, "--set ckpt.every=0") + " > " + log +
      " 2>&1 & pid=$!; i=0; while [ \"$( (wc -l < " + job.path("live", "metrics.jsonl") +
      ") 2>/dev/null || echo 0)\" -lt 2 ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; " +
      string(MOETRAIN_BINARY_DIR) + "/moetrain export --checkpoint " + source + " --out " + job.path("live", "model") +
      " --no-progress; echo \"rc=$?\"; kill -KILL $pid; wait $pid; }");
  INFO(live.output);
  CHECK(live.output.find("rc=2") != string::npos);
  CHECK(live.output.find("--out " + job.path("live", "model") + " is inside run.dir " + job.path("live") +
                         ", which a live run holds (pid ") != string::npos);
  CHECK(live.output.find("(the --checkpoint is " + source + ")") != string::npos);
  CHECK(!fs::exists(job.path("live", "model")));
  // Once that run is gone, its directory is an ordinary place to export to.
  Result after = run("export --checkpoint " + source + " --out " + job.path("live", "model") + " --no-progress");
  INFO(after.output);
  CHECK(after.code == 0);
}

TEST_CASE("cli: export --out that is a file, and --checkpoint that is a file, say so (exit 2)", "[cli]") {
  Job job;
  REQUIRE(job.train("run", 10).code == 0);
  const string source = job.path("run", "checkpoints/step_00000010");
  const string file = job.tmp.write("a_file", "not a directory\n");
  for (const string flag : {"", " --force"}) {
    Result r = run("export --checkpoint " + source + " --out " + file + flag + " --no-progress");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("--out " + file + " is a file, not a directory: export writes a directory") != string::npos);
    CHECK(r.output.find("pass --force") == string::npos);
    CHECK(read_bytes(file) == "not a directory\n");
  }
  const string commands[] = {"export --out " + job.path("x") + " --no-progress", "generate --max-new-tokens 2",
                             "eval --data '" + job.dir + "/data/val_*.bin' --batches 1"};
  for (const string& c : commands) {
    Result r = run(c + " --checkpoint " + source + "/rank_00000.h5");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("--checkpoint " + source + "/rank_00000.h5: a file, not a checkpoint directory") !=
          string::npos);
  }
}

TEST_CASE("cli: export removes the temp directories of killed exports into the same --out, only those", "[cli]") {
  Job job;
  REQUIRE(job.train("run", 10).code == 0);
  const string source = job.path("run", "checkpoints/step_00000010");
  // A pid that is gone: a shell that printed its own pid and exited.
  Result shell = moetrain::testing::capture_command("sh -c 'echo $$'");
  REQUIRE(shell.code == 0);
  const string dead = std::to_string(std::stol(shell.output));
  REQUIRE(::kill(static_cast<pid_t>(std::stol(dead)), 0) != 0);
  const string out = job.path("exp");
  // Temp directories are named <out>.tmp.<host>.<pid> (io/paths.h, temp_entry_name).
  const string host = moetrain::host_name();
  job.tmp.write("exp.tmp." + host + "." + dead + "/model.safetensors", "partial");  // a killed export's: removed
  job.tmp.write("exp.tmp." + host + "." + std::to_string(::getpid()) + "/x", "alive");  // this test's pid: kept
  job.tmp.write("exp.tmp." + host + ".abc/x", "not a pid");                        // not the pattern: kept
  job.tmp.write("exp.tmp.otherhost." + dead + "/x", "another host's");             // its pid says nothing here
  job.tmp.write("other.tmp." + host + "." + dead + "/x", "another --out");         // another export's: kept
  Result r = run("export --checkpoint " + source + " --out " + out + " --no-progress");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(!fs::exists(out + ".tmp." + host + "." + dead));
  CHECK(r.output.find("removed " + out + ".tmp." + host + "." + dead + ", left by an export that did not finish") !=
        string::npos);
  CHECK(fs::exists(out + ".tmp." + host + "." + std::to_string(::getpid()) + "/x"));
  CHECK(fs::exists(out + ".tmp." + host + ".abc/x"));
  CHECK(fs::exists(out + ".tmp.otherhost." + dead + "/x"));
  CHECK(fs::exists(job.path("other.tmp." + host + "." + dead + "/x")));
  CHECK(fs::exists(out + "/model.safetensors"));
}

TEST_CASE("cli: a run that reaches max_steps inside a streak of skipped non-finite steps exits 3 and writes no "
          "model", "[cli]") {
  Job job;
  // Weights of 1e30 are finite, their products are not: every step's loss is NaN and is
  // skipped; the run reaches its 3 steps before train.max_consecutive_skips (5).
  Result r = job.train("huge_init", 3, "--set model.init_std=1e30");
  INFO(r.output);
  CHECK(r.code == 3);
  CHECK(r.output.find("the run reached train.max_steps = 3 inside a run of 3 skipped steps (train.nan_policy = "
                      "skip) in which the model's loss was not finite, so no model is written to " +
                      job.path("huge_init", "model")) != string::npos);
  CHECK(r.output.find("done:") == string::npos);
  CHECK(!fs::exists(job.path("huge_init", "model")));
  // Rerun as after any failure: the checkpoint of step 3 ends in that streak, and no
  // step runs to show the model computes: still no model.
  Result again = job.train("huge_init", 3, "--set model.init_std=1e30 --set ckpt.resume=auto");
  INFO(again.output);
  CHECK(again.code == 3);
  CHECK(again.output.find("inside a run of 3 skipped steps (train.nan_policy = skip), saved in the checkpoint it "
                          "starts from") != string::npos);
  CHECK(!fs::exists(job.path("huge_init", "model")));
  // A last step skipped for a NaN gradient (its loss finite; fault.kind nan_grad, a
  // testing aid) leaves the model of the steps before it, which is written.
  Result transient = job.train("transient", 3, "--set fault.kind=nan_grad --set fault.step=3");
  INFO(transient.output);
  CHECK(transient.code == 0);
  CHECK(transient.output.find("step skipped on every rank") != string::npos);
  CHECK(fs::exists(job.path("transient", "model/model.safetensors")));
}

TEST_CASE("cli: a damaged manifest in the newest checkpoint stops ckpt.resume auto (exit 2); it is not moved aside",
          "[cli]") {
  Job job;
  REQUIRE(job.train("run", 20).code == 0);
  const string manifest = job.path("run", "checkpoints/step_00000020/manifest.json");
  const string good = read_bytes(manifest);
  for (const string& damaged : {good.substr(0, good.size() / 2), string("[]"),
                                std::regex_replace(good, std::regex(R"("step": 20)"), R"("step": -20)")}) {
    INFO(damaged.substr(0, 80));
    write_bytes(manifest, damaged);
    Result r = job.train("run", 30, "--set ckpt.resume=auto");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("the manifest of " + job.path("run", "checkpoints/step_00000020") + " cannot be read (") !=
          string::npos);
    CHECK(r.output.find("resume from an older one with ckpt.resume: step_00000010") != string::npos);
    CHECK(r.output.find("resumed from") == string::npos);
    CHECK(fs::exists(job.path("run", "checkpoints/step_00000020/COMMIT")));
    CHECK(!fs::exists(job.path("run", "checkpoints/abandoned")));
  }
  // The way out the message names works: the older checkpoint, named.
  Result older = job.train("run", 20, "--set ckpt.resume=step_00000010");
  INFO(older.output);
  CHECK(older.code == 0);
  CHECK(older.output.find("resumed from " + job.path("run", "checkpoints/step_00000010")) != string::npos);
}

TEST_CASE("cli: a rank file or manifest that is a directory, a link to /dev/zero or a dangling link exits 2 naming "
          "it", "[cli]") {
  Job job;
  REQUIRE(job.train("run", 10).code == 0);
  const string ckpt = job.path("run", "checkpoints/step_00000010");
  const string saved = job.dir + "/saved";
  fs::copy(ckpt, saved, fs::copy_options::recursive);
  struct Case {
    string file, make, says;
  };
  const Case cases[] = {
      {"rank_00000.h5", "mkdir", "is a directory, not a file"},
      {"rank_00000.h5", "ln -s /dev/zero", "is a character device (through a symbolic link), not a file"},
      {"rank_00000.h5", "ln -s /nonexistent", "is a link to nothing, not a file"},
      {"manifest.json", "mkdir", "is a directory, not a file"},
      {"manifest.json", "ln -s /dev/zero", "is a character device (through a symbolic link), not a file"},
      {"rank_00000.h5", "mkfifo", "is a FIFO, not a file"},
      {"manifest.json", "mkfifo", "is a FIFO, not a file"},
  };
  for (const Case& c : cases) {
    INFO(c.file << " " << c.make);
    fs::remove_all(ckpt);
    fs::copy(saved, ckpt, fs::copy_options::recursive);
    fs::remove(ckpt + "/" + c.file);
    REQUIRE(moetrain::testing::run_command(c.make + " " + ckpt + "/" + c.file) == 0);
    // timeout: reading /dev/zero never ends.
    Result r = moetrain::testing::capture_command("timeout 120 " + string(MOETRAIN_BINARY_DIR) +
                                                  "/moetrain export --checkpoint " + ckpt + " --out " +
                                                  job.path("out") + " --no-progress");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find(ckpt + "/" + c.file + (c.file == "manifest.json" ? " is " : " (listed in manifest.json) is ") +
                        c.says.substr(3)) != string::npos);
    CHECK(r.output.find("unexpected error") == string::npos);
  }
  // The checkpoint's config.resolved.yaml is read by the config loader (io/paths.h).
  fs::remove_all(ckpt);
  fs::copy(saved, ckpt, fs::copy_options::recursive);
  for (const string make : {"ln -s /dev/zero", "mkfifo"}) {
    INFO(make);
    fs::remove(ckpt + "/config.resolved.yaml");
    REQUIRE(moetrain::testing::run_command(make + " " + ckpt + "/config.resolved.yaml") == 0);
    Result r = moetrain::testing::capture_command("timeout 120 " + string(MOETRAIN_BINARY_DIR) +
                                                  "/moetrain export --checkpoint " + ckpt + " --out " +
                                                  job.path("out") + " --no-progress");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find(ckpt + "/config.resolved.yaml: not a regular file") != string::npos);
  }
}

TEST_CASE("checkpoint: hand-edited fields of a checkpoint are refused (exit 2 naming the file and the field)",
          "[checkpoint]") {
  Job job;
  REQUIRE(job.train("run", 20).code == 0);
  const string ckpt = job.path("run", "checkpoints/step_00000020");
  const string saved = job.dir + "/saved";
  fs::copy(job.path("run"), saved, fs::copy_options::recursive);
  auto restore = [&] {
    fs::remove_all(job.path("run"));
    fs::copy(saved, job.path("run"), fs::copy_options::recursive);
  };
  auto manifest_set = [&](const string& key, const json& value) {
    json m = json::parse(read_bytes(ckpt + "/manifest.json"));
    m[key] = value;
    write_bytes(ckpt + "/manifest.json", m.dump(2));
  };
  const string manifest = ckpt + "/manifest.json", rank = "rank_00000.h5";
  struct Case {
    std::function<void()> edit;
    string says;
    // The optimizer's state (exp_avg_sq) is read by a resume (at max_steps: a load, no step), not by export.
    bool resume = false;
  };
  const std::vector<Case> cases = {
      {[&] { manifest_set("version", 1.5); }, manifest + ": field \"version\" is 1.5, not one this build reads"},
      {[&] { manifest_set("version", 3); }, manifest + ": field \"version\" is 3, not one this build reads"},
      {[&] { manifest_set("format", "other"); }, manifest + ": field \"format\" is 'other'"},
      {[&] { manifest_set("step", -10); }, manifest + ": field \"step\" = -10 is outside [0, "},
      {[&] { manifest_set("pp", 2); }, manifest + ": field \"pp\" = 2 is outside [1, 1]"},
      {[&] { manifest_set("world", 0); }, manifest + ": field \"world\" = 0 is outside [1, "},
      {[&] { manifest_set("tokens", 7); }, rank + " records tokens = 2560, but manifest.json says 7"},
      {[&] { manifest_set("dtype", "f64"); }, "params/wte.weight in " + rank + " is f32, but manifest.json records "
                                              "dtype = 'f64'"},
      {[&] { edit_rank_file(ckpt, "int", "version", "3"); }, rank + " records version = 3, but manifest.json says 1"},
      {[&] { edit_rank_file(ckpt, "str", "format", "other"); }, rank + " records format = 'other', expected "
                                                                 "'moetrain-checkpoint'"},
      {[&] { edit_rank_file(ckpt, "int", "adam_step", "21"); }, rank + " records adam_step = 21, outside [0, step = "
                                                                 "20]"},
      {[&] { edit_rank_file(ckpt, "int", "adam_step", "-1"); }, rank + " records adam_step = -1, outside [0, step = "
                                                                 "20]"},
      {[&] { edit_rank_file(ckpt, "int", "loader_epoch", "-1"); }, rank + " records loader_epoch = -1, outside"},
      {[&] { edit_rank_file(ckpt, "int", "loader_position", "-5"); }, rank + " records loader_position = -5, outside"},
      {[&] { edit_rank_file(ckpt, "int", "skipped", "21"); }, rank + " records skipped = 21, outside [0, step = 20]"},
      {[&] { edit_rank_file(ckpt, "int", "consecutive_skips", "1"); }, rank + " records consecutive_skips = 1, "
                                                                        "outside [0, skipped = 0]"},
      {[&] { edit_rank_file(ckpt, "data", "exp_avg_sq/wte.weight", "-1"); }, "exp_avg_sq/wte.weight in " + rank +
                                                                             " holds 1 negative values", true},
  };
  for (const Case& c : cases) {
    restore();
    c.edit();
    INFO(c.says);
    Result r = c.resume ? job.train("run", 20, "--set ckpt.resume=auto")
                        : run("export --checkpoint " + ckpt + " --out " + job.path("out") + " --no-progress");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find(c.says) != string::npos);
    CHECK(r.output.find("checkpoint " + ckpt) != string::npos);
  }
  // The untouched copy loads, both ways.
  restore();
  Result ok = run("export --checkpoint " + ckpt + " --out " + job.path("out") + " --no-progress");
  INFO(ok.output);
  CHECK(ok.code == 0);
  Result resumed = job.train("run", 20, "--set ckpt.resume=auto");
  INFO(resumed.output);
  CHECK(resumed.code == 0);
}

TEST_CASE("cli: deleting run.lock under a live run lets no second run in; the first ends done with its whole "
          "history", "[cli][run_dir]") {
  Job job;
  const string first = job.path("first.log");
  const string bin = string(MOETRAIN_BINARY_DIR) + "/moetrain ";
  auto records = [&](int n) {
    return "i=0; while [ \"$( (wc -l < " + job.path("shared", "metrics.jsonl") + ") 2>/dev/null || echo 0)\" -lt " +
           std::to_string(n) + " ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; ";
  };
  // The first run trains in the background; once it has logged steps, run.lock goes and a
  // second run starts on the same directory; then the first is asked to save and exit.
  Result second = moetrain::testing::capture_command(
      "{ " + bin + job.args("shared", 100000, "--set ckpt.every=0") + " > " + first + " 2>&1 & pid=$!; " +
      records(3) + "rm " + job.path("shared", "run.lock") + "; " + bin +
      job.args("shared", 20, "--set ckpt.resume=auto") +
      "; echo \"rc=$?\"; n=$(wc -l < " + job.path("shared", "metrics.jsonl") + "); " + records(0) + "i=0; while [ " +
      "\"$(wc -l < " + job.path("shared", "metrics.jsonl") + ")\" -le $((n + 2)) ] && [ $i -lt 1200 ]; do sleep 0.05; "
      "i=$((i+1)); done; kill -USR1 $pid; wait $pid; echo \"first=$?\"; }");
  const string log = read_bytes(first);
  INFO(second.output);
  INFO(log);
  CHECK(second.output.find("rc=2") != string::npos);
  CHECK(second.output.find("run.dir " + job.path("shared") + " is in use by another moetrain run (pid ") !=
        string::npos);
  CHECK(second.output.find("first=0") != string::npos);
  CHECK(log.find(job.path("shared", "run.lock") + " was deleted or replaced while this run held run.dir " +
                 job.path("shared") + "; the run holds the directory's own lock") != string::npos);
  // One history, the first run's, from step 1 to the step it stopped at.
  std::smatch stopped;
  REQUIRE(std::regex_search(log, stopped, std::regex(R"(SIGUSR1: saving a checkpoint at step (\d+))")));
  const std::vector<int64_t> steps = steps_of(read_bytes(job.path("shared", "metrics.jsonl")));
  CHECK(steps == one_to(std::stoll(stopped[1])));
  CHECK(std::stoll(stopped[1]) > 3);
  CHECK(fs::exists(job.path("shared", "run.lock")));
}

TEST_CASE("checkpoint: the run directory's lock survives a deleted run.lock; without it, or when the directory is "
          "moved, the run stops", "[checkpoint][run_dir]") {
  TempDir tmp;
  const string dir = tmp / "run";
  {
    moetrain::RunDirectory held(dir);
    REQUIRE(held.directory_locked());
    fs::remove(dir + "/run.lock");
    const string e = moetrain::testing::error_of([&] { moetrain::RunDirectory second(dir); });
    CHECK_THAT(e, Catch::Contains("run.dir " + dir + " is in use by another moetrain run (holder unknown)"));
    CHECK(!fs::exists(dir + "/run.lock"));  // the refused run created nothing
    held.check_held();                      // takes run.lock again
    CHECK(fs::exists(dir + "/run.lock"));
    CHECK_THAT(read_bytes(dir + "/run.lock"), Catch::Contains("pid " + std::to_string(::getpid())));
    CHECK_THROWS_WITH(moetrain::RunDirectory(dir), Catch::Contains("is in use by another moetrain run"));
  }
  {
    // Where the directory cannot be locked (NFS), run.lock is the lock: deleting it lets
    // another run in, and the first one stops at its next write.
    moetrain::RunDirectory held(dir, false);
    REQUIRE(!held.directory_locked());
    held.check_held();
    fs::remove(dir + "/run.lock");
    moetrain::RunDirectory intruder(dir, false);
    const string e = moetrain::testing::error_of([&] { held.check_held(); });
    CHECK_THAT(e, Catch::Contains(dir + "/run.lock was deleted or replaced while this run held run.dir " + dir) &&
                      Catch::Contains("this one stops before writing more"));
  }
  {
    moetrain::RunDirectory held(dir);
    fs::rename(dir, tmp / "moved");
    const string e = moetrain::testing::error_of([&] { held.check_held(); });
    CHECK_THAT(e, Catch::Contains("run.dir " + dir + " was moved or deleted while this run held it"));
    fs::create_directories(dir);
    const string replaced = moetrain::testing::error_of([&] { held.check_held(); });
    CHECK_THAT(replaced, Catch::Contains("run.dir " + dir + " was replaced by another directory"));
  }
}

TEST_CASE("cli: a checkpoint save never replaces a file, link or uncommitted directory of its step's name (exit 2 "
          "naming it)", "[cli]") {
  Job job;
  REQUIRE(job.train("run", 10).code == 0);
  const string target = job.path("run", "checkpoints/step_00000020");
  struct Case {
    string what, says;
    std::function<void()> make;
  };
  const Case cases[] = {
      {"a file", "(a file)", [&] { write_bytes(target, "someone's notes\n"); }},
      {"a link", "(a link)", [&] { fs::create_directory_symlink(job.path("elsewhere"), target); }},
      {"a directory without COMMIT", "(a directory without COMMIT)",
       [&] {
         fs::create_directories(target);
         write_bytes(target + "/notes.txt", "someone's notes\n");
       }},
  };
  fs::create_directories(job.path("elsewhere"));
  write_bytes(job.path("elsewhere/keep.txt"), "kept\n");
  for (const Case& c : cases) {
    INFO(c.what);
    fs::remove_all(target);
    c.make();
    Result r = job.train("run", 20, "--set ckpt.resume=auto --set ckpt.schedule_change=apply");
    INFO(r.output);
    CHECK(r.code == 2);
    CHECK(r.output.find("checkpoint " + target + ": something that is not a committed checkpoint " + c.says +
                        " has that name; this save cannot replace it: move it out of " +
                        job.path("run", "checkpoints")) != string::npos);
    CHECK(fs::exists(fs::symlink_status(target)));
    if (c.what == "a file") CHECK(read_bytes(target) == "someone's notes\n");
    if (c.what == "a directory without COMMIT") CHECK(read_bytes(target + "/notes.txt") == "someone's notes\n");
    CHECK(read_bytes(job.path("elsewhere/keep.txt")) == "kept\n");
    CHECK(fs::exists(job.path("run", "checkpoints/step_00000010/COMMIT")));
  }
}
