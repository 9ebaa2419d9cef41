// Write failures as a user meets them: `moetrain export`, `prepare --out` and the
// config a run saves, on a full file system (a 1 MiB tmpfs filled up) and on a
// read-only one. Each exits 5 (IoError) with one line naming the path and the
// system's message, and leaves nothing partial where the output would be.
// Needs root for mount(8); skipped with a warning otherwise.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "config/config.h"
#include "moetrain.h"
#include "testing.h"
#include "train/model_source.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using std::string;
namespace fs = std::filesystem;

namespace {

using Result = moetrain::testing::CommandOutput;
Result run(const string& args) { return moetrain::testing::run_moetrain(args); }

// A tmpfs of 1 MiB at `dir` (created), unmounted at scope exit; ok is false when
// mount(8) is not allowed here.
struct Tmpfs {
  string dir;
  bool ok = false;
  Tmpfs(const string& path, const string& options) : dir(path) {
    fs::create_directories(dir);
    ok = moetrain::testing::run_command("mount -t tmpfs -o " + options + " tmpfs " + dir + " 2>/dev/null") == 0;
  }
  ~Tmpfs() {
    if (ok) moetrain::testing::run_command("umount " + dir);
  }
  // Fills the file system with `dir`/filler until a write fails with ENOSPC.
  void fill() const {
    const int fd = ::open((dir + "/filler").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    REQUIRE(fd >= 0);
    std::vector<char> block(4096, 'x');
    while (::write(fd, block.data(), block.size()) > 0) {
    }
    ::close(fd);
  }
  std::vector<string> listing() const {
    std::vector<string> names;
    for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
};

const char* kTinyGpt2 = "model:\n  vocab_size: 256\n  n_layer: 2\n  n_head: 2\n  d_model: 32\n  n_ctx: 64\n"
                        "data:\n  tokenizer: byte\n";

// <dir>/model as `moetrain train` writes it (model.safetensors, config.json,
// config.resolved.yaml), written in-process on a roomy disk.
string write_model_dir(const TempDir& tmp) {
  const string yaml = tmp.write("tiny.yaml", string(kTinyGpt2) + "train:\n  seq_len: 32\n");
  Config config = Config::load(yaml);
  std::unique_ptr<LanguageModel> model = build_model(config);
  export_model(*model, tmp / "model");
  config.save(tmp / "model/config.resolved.yaml");
  return tmp / "model";
}

// The one line of `output` holding `needle` (the error; info lines come before it).
string line_with(const string& output, const string& needle) {
  const size_t at = output.find(needle);
  if (at == string::npos) return "";
  const size_t begin = output.rfind('\n', at), end = output.find('\n', at);
  return output.substr(begin == string::npos ? 0 : begin + 1, end == string::npos ? string::npos : end - begin - 1);
}

}  // namespace

TEST_CASE("cli: export onto a full disk exits 5 naming the file and the system's message; nothing is left",
          "[cli]") {
  TempDir tmp;
  Tmpfs disk(tmp / "small", "size=1m");
  if (!disk.ok) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  const string model = write_model_dir(tmp);
  disk.fill();
  for (const char* format : {"safetensors", "hdf5"}) {
    DYNAMIC_SECTION(format) {
      Result r = run("export --checkpoint " + model + " --out " + disk.dir + "/out --no-progress --format " + format);
      INFO(r.output);
      CHECK(r.code == 5);
      const string error = line_with(r.output, "No space left on device");
      CHECK(error.find("export to " + disk.dir + "/out failed") != string::npos);
      CHECK(error.find(string(format) == "safetensors" ? "model.safetensors" : "model.h5") != string::npos);
      CHECK(disk.listing() == std::vector<string>{"filler"});  // no out, no out.tmp.<pid>
    }
  }
  SECTION("replacing an existing export with --force keeps the old one when the new one does not fit") {
    fs::remove(disk.dir + "/filler");
    Result first = run("export --checkpoint " + model + " --out " + disk.dir + "/out --no-progress");
    REQUIRE(first.code == 0);
    const string before = moetrain::testing::read_bytes(disk.dir + "/out/model.safetensors");
    disk.fill();
    Result r = run("export --checkpoint " + model + " --out " + disk.dir + "/out --no-progress --force");
    INFO(r.output);
    CHECK(r.code == 5);
    CHECK(r.output.find("No space left on device") != string::npos);
    CHECK(disk.listing() == std::vector<string>{"filler", "out"});
    CHECK(moetrain::testing::read_bytes(disk.dir + "/out/model.safetensors") == before);
  }
}

TEST_CASE("cli: prepare --out on a full disk exits 5 naming the shard; no shard or staging directory is left",
          "[cli]") {
  TempDir tmp;
  Tmpfs disk(tmp / "small", "size=1m");
  if (!disk.ok) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  // tinyshakespeare as bytes is 2.2 MB of uint16 tokens: the val shard fits, the train shard does not.
  Result r = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + disk.dir +
                 "/data --tokenizer byte --val-tokens 8192");
  INFO(r.output);
  CHECK(r.code == 5);
  const string error = line_with(r.output, "No space left on device");
  CHECK(error.find("prepare --out " + disk.dir + "/data") != string::npos);
  CHECK(error.find("train_000000.bin") != string::npos);
  CHECK(disk.listing() == std::vector<string>{"data"});
  CHECK(fs::is_empty(disk.dir + "/data"));  // no shard, no staging directory
}

TEST_CASE("cli: a run whose run.dir is on a full disk exits 5 naming the file it could not write", "[cli]") {
  TempDir tmp;
  Tmpfs disk(tmp / "small", "size=1m");
  if (!disk.ok) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  Result data = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + tmp / "data" +
                    " --tokenizer byte --val-tokens 8192");
  REQUIRE(data.code == 0);
  const string yaml = tmp.write("train.yaml", string(kTinyGpt2) + "  train: " + tmp / "data/train_*.bin" +
                                "\n  val: ''\ntrain:\n  batch_size: 2\n  seq_len: 16\n  max_steps: 2\n"
                                "  eval_every: 0\n");
  disk.fill();
  Result r = run("train -c " + yaml + " --set run.dir=" + disk.dir + "/run");
  INFO(r.output);
  CHECK(r.code == 5);
  CHECK(line_with(r.output, "No space left on device").find(disk.dir + "/run/") != string::npos);
}

TEST_CASE("cli: export and prepare into a read-only file system exit 5 with 'Read-only file system'", "[cli]") {
  TempDir tmp;
  Tmpfs disk(tmp / "ro", "ro,size=1m");
  if (!disk.ok) {
    WARN("skipped: cannot mount a tmpfs here (needs root)");
    return;
  }
  const string model = write_model_dir(tmp);
  Result exported = run("export --checkpoint " + model + " --out " + disk.dir + "/out --no-progress");
  INFO(exported.output);
  CHECK(exported.code == 5);
  CHECK(line_with(exported.output, "Read-only file system").find("export to " + disk.dir + "/out failed") !=
        string::npos);
  Result nested = run("export --checkpoint " + model + " --out " + disk.dir + "/a/b/out --no-progress");
  INFO(nested.output);
  CHECK(nested.code == 5);
  CHECK(nested.output.find("cannot create directory " + disk.dir + "/a/b") != string::npos);
  CHECK(nested.output.find("Read-only file system") != string::npos);

  Result prepared = run("prepare " + string(MOETRAIN_SOURCE_DIR) + "/data/tinyshakespeare.txt --out " + disk.dir +
                        "/data --tokenizer byte");
  INFO(prepared.output);
  CHECK(prepared.code == 5);
  CHECK(prepared.output.find("cannot create directory " + disk.dir + "/data: Read-only file system") !=
        string::npos);
  CHECK(disk.listing().empty());  // not even out.tmp.<pid> or data
}
