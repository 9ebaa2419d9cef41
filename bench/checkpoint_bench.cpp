// Checkpoint save and load speed (issue 6), against the disk measured in the same run.
//   build/moetrain_bench_checkpoint [CONFIG] [DIR]
// CONFIG defaults to configs/k3-small.yaml (67M parameters; k3-scaled-lite, 3.6B,
// does not fit this 24 GiB box with its AdamW state). Its full parameter set (weights,
// router biases and both AdamW moments are saved); DIR (default: a directory under
// /tmp) must be on the disk you care about. One process. Reports, as medians of 3:
//   raw write: the same number of bytes with write(2) + fsync, one file;
//   raw read:  reading that file back (page cache warm, as right after a save);
//   save:      save_checkpoint (HDF5 with Fletcher32, SHA-256, manifest, COMMIT, renames);
//   load:      load_checkpoint (SHA-256 check of the file, then the HDF5 reads);
// with MB/s and the ratio to the raw write or read.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "moetrain.h"
#include "optim/adamw.h"
#include "train/distributed.h"
#include "train/model_source.h"

using namespace moetrain;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double raw_write(const std::string& path, const std::vector<char>& bytes) {
  const auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  MT_CHECK(fd >= 0, "cannot create {}", path);
  for (size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + at, std::min<size_t>(bytes.size() - at, 64 << 20));
    MT_CHECK(n > 0, "write to {} failed", path);
    at += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  return since(t0);
}

double raw_read(const std::string& path, std::vector<char>& bytes) {
  const auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_RDONLY);
  MT_CHECK(fd >= 0, "cannot open {}", path);
  for (size_t at = 0; at < bytes.size();) {
    const ssize_t n = ::read(fd, bytes.data() + at, std::min<size_t>(bytes.size() - at, 64 << 20));
    MT_CHECK(n > 0, "read of {} failed", path);
    at += static_cast<size_t>(n);
  }
  ::close(fd);
  return since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string config_path = argc > 1 ? argv[1] : std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml";
  const std::string dir = argc > 2 ? argv[2] : (fs::temp_directory_path() / "moetrain_bench_checkpoint").string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  Config config = Config::load(config_path, {"run.dir=" + dir + "/run"});
  Distributed dist = make_distributed(config);
  std::unique_ptr<LanguageModel> model = build_model(config);
  AdamW opt(model->parameters(), {});
  for (Tensor& m : opt.exp_avg()) fill_(m, 1e-3);
  for (Tensor& v : opt.exp_avg_sq()) fill_(v, 1e-6);
  int64_t bytes = 0;
  for (const NamedParameter& p : model->parameters()) bytes += 3 * p.tensor.nbytes();
  for (const NamedParameter& b : model->buffers()) bytes += b.tensor.nbytes();
  std::printf("checkpoint of %s: %lld parameters, %.1f MB of tensors (weights + 2 AdamW moments + buffers), in %s\n",
              config_path.c_str(), static_cast<long long>(count_parameters(model->parameters())), bytes / 1e6,
              dir.c_str());

  std::vector<char> buf(static_cast<size_t>(bytes), 1);
  std::vector<double> w, r, s, l;
  TrainProgress progress;
  for (int rep = 0; rep < 3; ++rep) {
    w.push_back(raw_write(dir + "/raw.bin", buf));
    r.push_back(raw_read(dir + "/raw.bin", buf));
    progress.step = rep + 1;
    SaveOptions o;
    o.keep_last = 1;
    auto t0 = Clock::now();
    const SaveResult saved = save_checkpoint(dist, config.get_string("run.dir"), *model, opt, progress, config, o);
    s.push_back(since(t0));
    t0 = Clock::now();
    load_checkpoint(dist, saved.dir, *model, &opt, config);
    l.push_back(since(t0));
  }
  fs::remove(dir + "/raw.bin");
  const double mw = median(w), mr = median(r), ms = median(s), ml = median(l);
  auto line = [&](const char* what, double sec, double base) {
    std::printf("  %-10s %9.1f ms %9.0f MB/s   %6.2fx the raw time\n", what, sec * 1e3, bytes / 1e6 / sec, sec / base);
  };
  line("raw write", mw, mw);
  line("save", ms, mw);
  line("raw read", mr, mr);
  line("load", ml, mr);
  fs::remove_all(dir);
  return 0;
}
