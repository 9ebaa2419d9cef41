// Paths of the wrong kind, as a hostile user names them (issue 35): a FIFO where
// a file is read (open(2) would wait for a writer for ever), a device where a file
// is read (/dev/zero never ends) or replaced (the final rename would replace
// /dev/null), the input itself as the output, control characters in path keys,
// a second YAML document hidden in a --set value, and the temp directories of
// killed runs. Each is refused at once with exit code 2 and a message naming the
// path or key; nothing already there is changed. Commands that would block run
// under `timeout`, so a regression fails the test instead of hanging it.
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "cli/cli_fixtures.h"
#include "config/config.h"
#include "core/error.h"
#include "data/shard.h"
#include "io/durable.h"
#include "io/hdf5.h"
#include "io/paths.h"
#include "moetrain.h"
#include "testing.h"

using moetrain::testing::read_bytes;
using moetrain::testing::shell_quote;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Case = moetrain::testing::CommandCase;
// The shared tiny GPT-2, without samples.
const std::string kTinyGpt2 = std::string(moetrain::testing::kTinyGpt2Yaml) + "  sample_every: 0\n";
void check_cases(const std::vector<Case>& cases) { moetrain::testing::check_command_cases(cases); }

using Result = moetrain::testing::CommandOutput;

// The command under a hard time limit: a regression that blocks on a FIFO (a stop
// signal does not end that open) or reads /dev/zero ends as exit 137, not a hung test.
// (No address-space limit: sanitizer and CUDA builds reserve terabytes of it.)
Result run_bounded(const string& args) {
  return moetrain::testing::capture_command("timeout -s KILL 30 " + string(MOETRAIN_BINARY_DIR) + "/moetrain " +
                                            args);
}

string make_fifo(const string& path) {
  REQUIRE(::mkfifo(path.c_str(), 0644) == 0);
  return path;
}

bool is_fifo(const string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
}

bool is_char_device(const string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode);
}

// The pid of a child that has exited and been reaped: no process has it now.
pid_t dead_pid() {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(::kill(pid, 0) != 0);
  return pid;
}

// This host's name as temp entries carry it (gethostname; [A-Za-z0-9._-], others '_').
string this_host() {
  char buf[256] = {};
  REQUIRE(::gethostname(buf, sizeof(buf) - 1) == 0);
  string name(buf);
  for (char& c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_')) c = '_';
  return name;
}

// An input of `moetrain op situ_glu`.
string write_op_input(const TempDir& tmp) {
  const string in = tmp / "in.h5";
  moetrain::hdf5::Writer w(in);
  w.write("/", "gate", moetrain::randn({4, 8}, moetrain::DType::f64, 1));
  w.write("/", "up", moetrain::randn({4, 8}, moetrain::DType::f64, 2));
  w.commit();
  return in;
}

std::vector<string> temp_leftovers(const TempDir& tmp) {
  std::vector<string> out;
  for (const string& name : tmp.listing())
    if (name.find(".tmp.") != string::npos) out.push_back(name);
  return out;
}

}  // namespace

TEST_CASE("hostile io: op --out that is a FIFO, a link to a device, a directory or the input itself is refused "
          "before anything is written",
          "[cli]") {
  TempDir tmp;
  const string in = write_op_input(tmp);
  const string input_bytes = read_bytes(in);
  const string fifo = make_fifo(tmp / "fifo.h5");
  const string null_link = tmp / "null.h5";
  fs::create_symlink("/dev/null", null_link);
  REQUIRE(is_char_device("/dev/null"));
  const string dir = tmp / "dir.h5";
  fs::create_directory(dir);
  const string hard_link = tmp / "hard.h5";
  fs::create_hard_link(in, hard_link);
  const string soft_link = tmp / "soft.h5";
  fs::create_symlink(in, soft_link);
  const string op = "op situ_glu --in " + in + " --out ";
  check_cases({
      {"a FIFO", op + fifo, 2, {"op --out " + fifo, "not a regular file (a FIFO)", "choose another path"}},
      {"a link to /dev/null", op + null_link, 2, {"op --out " + null_link, "(a character device)"}},
      {"a directory", op + dir, 2, {"op --out " + dir, "(a directory)"}},
      {"the input", op + in, 2, {"op --out " + in, "is the same file as the input " + in}},
      {"a hard link to the input", op + hard_link, 2, {"op --out " + hard_link, "same file as the input " + in}},
      {"a symbolic link to the input", op + soft_link, 2, {"op --out " + soft_link, "same file as the input"}},
  });
  // Nothing was replaced, nothing left behind.
  CHECK(is_fifo(fifo));
  CHECK(fs::is_symlink(null_link));
  CHECK(fs::read_symlink(null_link) == "/dev/null");
  CHECK(is_char_device("/dev/null"));
  CHECK(fs::is_directory(dir));
  CHECK(fs::is_empty(dir));
  CHECK(fs::is_symlink(soft_link));
  CHECK(read_bytes(in) == input_bytes);
  CHECK(read_bytes(hard_link) == input_bytes);
  CHECK(temp_leftovers(tmp).empty());
  // A regular file other than the input is replaced as before.
  tmp.write("old.h5", "old");
  const Result ok = run_bounded(op + tmp / "old.h5");
  INFO(ok.output);
  CHECK(ok.code == 0);
  CHECK(moetrain::hdf5::Reader(tmp / "old.h5").has_dataset("/", "out"));
}

TEST_CASE("hostile io: a FIFO or a device where a file is read is refused at once with exit 2 naming it", "[cli]") {
  TempDir tmp;
  const string cfg = tmp.write("tiny.yaml", kTinyGpt2);
  const string fifo_yaml = make_fifo(tmp / "fifo.yaml");
  const string includes_fifo = tmp.write("inc_fifo.yaml", "include: fifo.yaml\n");
  const string includes_zero = tmp.write("inc_zero.yaml", "include: /dev/zero\n");
  const string zero_link = tmp / "zero.yaml";
  fs::create_symlink("/dev/zero", zero_link);
  const string config_dir = tmp / "configs.d";
  fs::create_directory(config_dir);
  // A sparse regular file far larger than any config: refused by size, not read.
  const string huge = tmp / "huge.yaml";
  REQUIRE(moetrain::testing::run_command("truncate -s 64M " + huge) == 0);
  const string includes_huge = tmp.write("inc_huge.yaml", "model:\n  n_layer: 2\ninclude: [tiny.yaml, huge.yaml]\n");

  const string shard = make_fifo(tmp / "train_000000.bin");
  const string in_h5 = make_fifo(tmp / "in.h5");
  const string loop = tmp / "loop.h5";
  fs::create_symlink(loop, loop);
  const string text = tmp.write("text.txt", "hello world\n");
  const string text_fifo = make_fifo(tmp / "text_fifo.txt");
  const string tokenizer_dir = tmp / "gpt2";
  fs::create_directory(tokenizer_dir);
  make_fifo(tokenizer_dir + "/encoder.json");
  make_fifo(tokenizer_dir + "/vocab.bpe");
  const string train = "train -c " + cfg + " --set data.val= --set run.dir=" + tmp / "run";
  // Hugging Face weights: a config.json and a .safetensors that are FIFOs.
  const string hf_dir = tmp / "hf";
  fs::create_directory(hf_dir);
  make_fifo(hf_dir + "/config.json");
  const string weights_fifo = make_fifo(tmp / "model.safetensors");

  check_cases({
      {"-c FIFO", "train -c " + fifo_yaml + " --print-config", 2,
       {fifo_yaml + ": not a regular file (a FIFO); expected a YAML config file"}},
      {"include: FIFO", "train -c " + includes_fifo + " --print-config", 2,
       {includes_fifo + ":1:10: include: " + fifo_yaml, "not a regular file (a FIFO)"}},
      {"include: /dev/zero", "train -c " + includes_zero + " --print-config", 2,
       {includes_zero + ":1:10: include: /dev/zero", "not a regular file (a character device)"}},
      {"-c a link to /dev/zero", "train -c " + zero_link + " --print-config", 2,
       {zero_link, "not a regular file (a character device)"}},
      {"-c a directory", "train -c " + config_dir + " --print-config", 2,
       {config_dir, "not a regular file (a directory)"}},
      {"include: a 64 MiB file", "train -c " + includes_huge + " --print-config", 2,
       {includes_huge + ":3:22: include: " + huge, "67108864 bytes, more than the 4194304 bytes (4 MiB)"}},
      {"a FIFO as a token shard", train + " --set data.train=" + shard, 2,
       {shard + ": not a regular file (a FIFO); expected a token shard"}},
      {"eval --data FIFO", "eval -c " + cfg + " --data " + shard, 2, {shard, "not a regular file (a FIFO)"}},
      {"op --in FIFO", "op situ_glu --in " + in_h5 + " --out " + tmp / "out.h5", 2,
       {in_h5 + ": not a regular file (a FIFO); expected an HDF5 file"}},
      {"op --in a loop of links", "op situ_glu --in " + loop + " --out " + tmp / "out.h5", 2,
       {loop + ": cannot open an HDF5 file: Too many levels of symbolic links"}},
      {"prepare input FIFO", "prepare " + text_fifo + " --out " + tmp / "data" + " --tokenizer byte", 2,
       {text_fifo, "not a regular file (a FIFO)"}},
      {"GPT-2 tokenizer files that are FIFOs",
       "prepare " + text + " --out " + tmp / "data" + " --tokenizer gpt2 --tokenizer-dir " + tokenizer_dir, 2,
       {tokenizer_dir + "/", "not a regular file (a FIFO); expected a tokenizer file"}},
      {"--init-from DIR whose config.json is a FIFO", "generate --init-from " + hf_dir + " --prompt a", 2,
       {hf_dir + "/config.json: not a regular file (a FIFO); expected a Hugging Face config.json"}},
      {"--init-from a .safetensors FIFO", "generate -c " + cfg + " --init-from " + weights_fifo + " --prompt a", 2,
       {weights_fifo + ": not a regular file (a FIFO); expected a safetensors file"}},
  });
  CHECK(!fs::exists(tmp / "data"));
  CHECK(!fs::exists(tmp / "out.h5"));
}

TEST_CASE("hostile io: metrics.jsonl that is a directory or a FIFO is refused naming it", "[cli]") {
  TempDir tmp;
  moetrain::testing::prepare_byte_shards(tmp.path());
  for (const string kind : {"directory", "FIFO"}) {
    DYNAMIC_SECTION(kind) {
      const string run_dir = tmp / ("run_" + kind);
      fs::create_directories(run_dir);
      const string metrics = run_dir + "/metrics.jsonl";
      if (kind == "directory") fs::create_directory(metrics);
      else make_fifo(metrics);
      const Result r = run_bounded(moetrain::testing::tiny_gpt2_train_args(tmp.path(), run_dir, 2));
      INFO(r.output);
      CHECK(r.code == 2);
      CHECK_THAT(r.output, Catch::Contains(metrics + ": not a regular file (a " + kind + ")"));
      CHECK_THAT(r.output, !Catch::Contains("unexpected error"));
      if (kind == "directory") CHECK(fs::is_directory(metrics));
      else CHECK(is_fifo(metrics));
    }
  }
}

TEST_CASE("hostile io: control characters in path keys and a second YAML document in --set are refused naming "
          "the key",
          "[config]") {
  using moetrain::Config;
  using moetrain::ConfigError;
  auto error = [](auto&& f) {
    return moetrain::testing::error_of<ConfigError>(f);
  };
  // A NUL in run.dir (YAML's "\0" escape) would cut the path the system sees.
  CHECK(error([] { Config::load_string("run:\n  dir: \"runs/a\\0b\"\n", "c.yaml"); }) ==
        "c.yaml:2:3: run.dir = \"runs/a\\x00b\": holds the control character \\x00 at offset 6; a path or name "
        "cannot hold control characters (a NUL would cut it): remove it");
  CHECK_THAT(error([] { Config::load_string("", "c.yaml", {"run.dir=\"x\\0\""}); }),
             Catch::StartsWith("--set run.dir=\"x\\0\": run.dir = \"x\\x00\": holds the control character \\x00"));
  for (const string key : {"data.train", "data.val", "data.tokenizer_dir", "model.init_from", "ckpt.resume"})
    CHECK_THAT(error([&] { Config::load_string("", "c.yaml", {key + "=\"a\\tb\""}); }),
               Catch::Contains(key + " = \"a\\tb\": holds the control character \\x09 at offset 1"));
  CHECK_THAT(error([] { Config::load_string("", "c.yaml", {"run.dir=\"a\\nb\""}); }),
             Catch::Contains("run.dir") && Catch::Contains("\\x0a"));
  // An include: name with a NUL would read the file named by the part before it.
  CHECK(error([] { Config::load_string("include: \"base.yaml\\0.bak\"\n", "c.yaml"); }) ==
        "c.yaml:1:10: include: \"base.yaml\\x00.bak\" holds the control character \\x00; a file name cannot hold "
        "control characters: remove it");
  // The sample prompt is text: a newline there is what it is for.
  CHECK(Config::load_string("", "c.yaml", {"train.sample_prompt=\"a\\nb\\tc\""}).get_string("train.sample_prompt") ==
        "a\nb\tc");

  // ... and the resolved config writes a NUL in it escaped, so it reads back whole.
  const Config prompt = Config::load_string("", "c.yaml", {"train.sample_prompt=\"a\\0b\""});
  REQUIRE(prompt.get_string("train.sample_prompt") == string("a\0b", 3));
  CHECK_THAT(prompt.to_yaml(), Catch::Contains("sample_prompt: \"a\\x00b\""));
  CHECK(Config::load_string(prompt.to_yaml(), "resolved").get_string("train.sample_prompt") == string("a\0b", 3));

  // A second document in a value: refused, not cut.
  CHECK(error([] { Config::load_string("", "c.yaml", {"run.dir=runs/a\n---\nruns/b"}); }) ==
        "--set run.dir=runs/a\n---\nruns/b: run.dir: the value holds 2 YAML documents (a line '---' or '...' starts "
        "another); a value is one scalar: quote it, or set one value per --set");
  CHECK_THAT(error([] { Config::load_string("", "c.yaml", {"model.n_layer=4\n...\n12"}); }),
             Catch::Contains("model.n_layer: the value holds 2 YAML documents"));
  CHECK(Config::load_string("", "c.yaml", {"run.dir=runs/a---b"}).get_string("run.dir") == "runs/a---b");

  // Through the command line: exit 2 naming the key, no run directory made.
  TempDir tmp;
  const string cfg = tmp.write("tiny.yaml", kTinyGpt2);
  const string nul = tmp.write("nul.yaml", "run:\n  dir: \"" + tmp / "cut\\0rest" + "\"\n");
  check_cases({
      {"a NUL in run.dir in a file", "train -c " + nul + " --print-config", 2,
       {nul + ":2:3: run.dir", "control character \\x00"}},
      {"a NUL in run.dir in --set", "train -c " + cfg + " --set " + shell_quote("run.dir=\"" + tmp / "cut\\0x\""), 2,
       {"--set run.dir=", "control character \\x00"}},
      {"a second document in --set", "train -c " + cfg + " --set " + shell_quote("data.val=a\n---\nb") +
       " --print-config", 2, {"--set data.val=a", "data.val: the value holds 2 YAML documents"}},
  });
  CHECK(!fs::exists(tmp / "cut"));
}

TEST_CASE("hostile io: prepare removes the staging directories that killed runs on this host left", "[data]") {
  TempDir tmp;
  const string out = tmp / "data";
  const string host = this_host();
  const string dead = std::to_string(dead_pid()), live = std::to_string(::getpid());
  const string stale = out + "/.prepare.tmp." + host + "." + dead;
  const std::vector<string> kept = {
      out + "/.prepare.tmp." + host + "." + live,            // a live process (this test)
      out + "/.prepare.tmp.other-host." + dead,               // another host's: its pid says nothing here
      out + "/.prepare.tmp." + dead,                          // not the pattern
      out + "/.prepare.tmp." + host + "." + dead + "x",       // not the pattern
      out + "/notes.prepare.tmp." + host + "." + dead,        // not the pattern
  };
  tmp.write("data/.prepare.tmp." + host + "." + dead + "/train_000000.bin", "half a shard");
  for (const string& k : kept) {
    fs::create_directories(k);
    moetrain::testing::write_bytes(k + "/x", "keep");
  }
  const string text = tmp.write("text.txt", string(4000, 'a'));
  const Result r = run_bounded("prepare " + text + " --out " + out + " --tokenizer byte --val-tokens 100");
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("removed " + stale + ", the staging directory of an earlier prepare"));
  CHECK(!fs::exists(stale));
  for (const string& k : kept) CHECK(read_bytes(k + "/x") == "keep");
  CHECK(fs::exists(out + "/train_000000.bin"));
  std::vector<string> staging;
  for (const auto& e : fs::directory_iterator(out))
    if (e.path().filename().string().starts_with(".prepare.tmp.")) staging.push_back(e.path().string());
  CHECK(staging.size() == 4);  // the four kept ones of that prefix; this run's own is gone
}

TEST_CASE("hostile io: prepare refuses a shard name taken by a directory or a FIFO before it writes", "[data]") {
  TempDir tmp;
  const string out = tmp / "data";
  fs::create_directories(out + "/val_000000.bin");
  make_fifo(out + "/train_000000.bin");
  const string text = tmp.write("text.txt", string(4000, 'a'));
  const Result r =
      run_bounded("prepare " + text + " --out " + out + " --tokenizer byte --val-tokens 100 --overwrite");
  INFO(r.output);
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("prepare --out: the shard " + out + "/") &&
                           Catch::Contains("exists and is not a regular file"));
  CHECK(fs::is_directory(out + "/val_000000.bin"));
  CHECK(is_fifo(out + "/train_000000.bin"));
}

TEST_CASE("hostile io: remove_stale_temp_directories removes what killed runs on this host left beside a directory",
          "[io]") {
  TempDir tmp;
  const string host = this_host();
  const string dead = std::to_string(dead_pid()), live = std::to_string(::getpid());
  const string out = tmp / "model";
  tmp.write("model/config.json", "{}");
  tmp.write("model.tmp." + host + "." + dead + "/model.h5", "half");
  const std::vector<string> kept = {"model.tmp." + host + "." + live, "model.tmp.elsewhere." + dead,
                                    "model.tmp." + dead, "model2.tmp." + host + "." + dead,
                                    "model.old." + dead};
  for (const string& k : kept) tmp.write(k + "/x", "keep");
  CHECK(moetrain::temp_directory_for(out + "/").string() == out + ".tmp." + host + "." + live);
  const std::vector<fs::path> removed = moetrain::remove_stale_temp_directories(out + "/");
  REQUIRE(removed.size() == 1);
  CHECK(removed[0].string() == out + ".tmp." + host + "." + dead);
  CHECK(!fs::exists(removed[0]));
  for (const string& k : kept) CHECK(read_bytes(tmp / k + "/x") == "keep");
  CHECK(read_bytes(out + "/config.json") == "{}");
  CHECK(moetrain::remove_stale_temp_directories(tmp / "missing/model").empty());
}

TEST_CASE("hostile io: the HDF5 reader refuses a directory and a device; writers refuse non-regular targets", "[io]") {
  using moetrain::Error;
  using moetrain::testing::error_of;
  TempDir tmp;
  const string dir = tmp / "rank_00000.h5";
  fs::create_directory(dir);
  const string zero = tmp / "zero.h5";
  fs::create_symlink("/dev/zero", zero);
  CHECK(error_of<Error>([&] { moetrain::hdf5::Reader r(dir); }) ==
        dir + ": not a regular file (a directory); expected an HDF5 file");
  CHECK(error_of<Error>([&] { moetrain::hdf5::Reader r(zero); }) ==
        zero + ": not a regular file (a character device); expected an HDF5 file");

  const string fifo = make_fifo(tmp / "fifo");
  CHECK_THAT(error_of<Error>([&] { moetrain::hdf5::Writer w(fifo); }),
             Catch::StartsWith("HDF5 file " + fifo + ": exists and is not a regular file (a FIFO)"));
  CHECK_THAT(error_of<Error>([&] { moetrain::write_file_atomically(fifo, "x"); }),
             Catch::StartsWith("cannot write " + fifo + ": exists and is not a regular file (a FIFO)"));
  const std::vector<uint16_t> tokens = {1, 2, 3};
  CHECK_THAT(error_of<Error>([&] { moetrain::data::write_shard(fifo, tokens); }),
             Catch::StartsWith("token shard " + fifo + ": exists and is not a regular file (a FIFO)"));
  CHECK_THAT(error_of<Error>([&] { moetrain::data::write_shard(zero, tokens); }),
             Catch::Contains("(a character device)"));
  // A directory replacing a file, a FIFO or a device: refused, the built one stays.
  tmp.write("built/x", "new");
  const string file = tmp.write("file", "user data");
  for (const string& target : {file, fifo, zero})
    CHECK_THAT(error_of<Error>([&] { moetrain::replace_directory(tmp / "built", target); }),
               Catch::StartsWith("cannot replace " + target + ": exists and is not a directory"));
  CHECK(read_bytes(file) == "user data");
  CHECK(is_fifo(fifo));
  CHECK(fs::is_symlink(zero));
  CHECK(is_char_device("/dev/zero"));
  CHECK(read_bytes(tmp / "built/x") == "new");
  CHECK(temp_leftovers(tmp).empty());

  // check_output_file: a new path and a regular file are fine; the input's inode is not.
  moetrain::check_output_file(tmp / "new", "out");
  moetrain::check_output_file(file, "out", {tmp / "new", dir});
  fs::create_hard_link(file, tmp / "alias");
  CHECK(error_of<Error>([&] { moetrain::check_output_file(tmp / "alias", "out", {file}); }) ==
        "out " + tmp / "alias" + ": is the same file as the input " + file +
            "; writing it would replace the input: choose another path");
}
