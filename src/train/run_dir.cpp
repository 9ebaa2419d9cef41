#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "core/error.h"
#include "io/durable.h"
#include "train/metrics.h"

namespace moetrain {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kLock = "run.lock";
constexpr const char* kRecord = "run.json";

std::string host_name() {
  char host[256] = {};
  return ::gethostname(host, sizeof host - 1) == 0 ? std::string(host) : std::string("?");
}

std::string now_text(const char* format) {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char text[64];
  std::strftime(text, sizeof text, format, &tm);
  return text;
}

// 20261201-201503-4f1c: when it started, and 16 random bits against two starts in one second.
std::string new_run_id() {
  std::random_device rd;
  return fmt::format("{}-{:04x}", now_text("%Y%m%d-%H%M%S"), rd() & 0xffff);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// run.json of the latest run that began here.
struct RunRecord {
  std::string run_id, lineage, started_from;  // started_from: "" for step 0
};

std::optional<RunRecord> read_record(const fs::path& dir) {
  const fs::path path = dir / kRecord;
  if (!fs::exists(path)) return std::nullopt;
  const json j = json::parse(read_text(path), nullptr, false);
  MT_CHECK(!j.is_discarded() && j.is_object() && j.contains("lineage"),
           "{}: not a run record written by moetrain (expected a JSON object with run_id, lineage, started_from); "
           "delete it to treat the checkpoints here as one lineage", path.string());
  return RunRecord{j.value("run_id", std::string()), j.value("lineage", std::string()),
                   j.value("started_from", std::string())};
}

std::string names(const std::vector<CommittedCheckpoint>& cs) {
  std::string out;
  for (const CommittedCheckpoint& c : cs) out += (out.empty() ? "" : ", ") + c.name;
  return out.empty() ? "none" : out;
}

}  // namespace

RunDirectory::RunDirectory(std::string dir) : dir_(std::move(dir)), run_id_(new_run_id()) {
  moetrain::create_directories(dir_);
  const std::string lock = (fs::path(dir_) / kLock).string();
  lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) throw IoError(fmt::format("{}: cannot open the run's lock file: {}", lock, std::strerror(errno)));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string holder = read_text(lock);
    while (!holder.empty() && holder.back() == '\n') holder.pop_back();
    ::close(lock_fd_);
    lock_fd_ = -1;
    if (err != EWOULDBLOCK) throw IoError(fmt::format("{}: cannot lock: {}", lock, std::strerror(err)));
    MT_THROW("run.dir {} is in use by another moetrain run ({}); wait for it to end or stop it, or choose another "
             "run.dir", dir_, holder.empty() ? std::string("holder unknown") : holder);
  }
  // Who holds it, for the message of a second run (the lock is the flock, not this text).
  const std::string who = fmt::format("pid {} on host {}, run {}, started {}", ::getpid(), host_name(), run_id_,
                                      now_text("%Y-%m-%d %H:%M:%S"));
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    throw IoError(fmt::format("{}: writing the lock holder failed: {}", lock, std::strerror(errno)));
}

RunDirectory::~RunDirectory() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

StartPlan RunDirectory::plan(const CheckpointOptions& o, const Config& config) const {
  StartPlan plan;
  const std::vector<CommittedCheckpoint> all = committed_checkpoints(dir_, true);
  if (o.resume_none()) {
    const fs::path d(dir_);
    const int64_t records = count_metrics_records(metrics_path());
    std::error_code ec;
    const bool has_model = fs::exists(d / "model", ec), has_ckpts = fs::exists(checkpoints_dir(dir_), ec);
    if (!all.empty() || records > 0 || has_model || has_ckpts) {
      const std::string what = fmt::format("{} checkpoint{}, {} metrics record{}{}", all.size(),
                                           all.size() == 1 ? "" : "s", records, records == 1 ? "" : "s",
                                           has_model ? ", a model/" : "");
      if (!o.overwrite)
        config.fail("ckpt.resume", fmt::format("a fresh run, but run.dir {} already holds one ({}); continue it "
                                               "with ckpt.resume: auto, start over there with run.overwrite: true "
                                               "(deletes them), or choose another run.dir", dir_, what));
      spdlog::warn("run.overwrite: deleting the earlier run in {} ({})", dir_, what);
      plan.clear = true;
    }
    plan.lineage = run_id_;
    return plan;
  }
  const std::optional<RunRecord> previous = read_record(dir_);
  // The checkpoints `auto` may pick: those of the previous run's lineage and the one it started from.
  auto eligible = [&](const CommittedCheckpoint& c) {
    return !previous || c.lineage == previous->lineage || c.name == previous->started_from;
  };
  std::optional<CommittedCheckpoint> newest;
  for (const CommittedCheckpoint& c : all)
    if (eligible(c)) newest = c;
  plan.lineage = previous && !previous->lineage.empty() ? previous->lineage
                 : newest && !newest->lineage.empty() ? newest->lineage
                                                      : run_id_;
  if (o.resume == "auto") {
    plan.from = newest;
    if (!newest)
      spdlog::info("ckpt.resume = auto: no complete checkpoint {}in {}; starting from step 0",
                   previous ? "of this run's lineage " : "", checkpoints_dir(dir_));
  } else {
    MT_ASSERT(o.resume.rfind("step_", 0) == 0, "ckpt.resume '{}' passed the schema's check", o.resume);
    for (const CommittedCheckpoint& c : all)
      if (c.name == o.resume) plan.from = c;
    if (!plan.from) {
      const fs::path dir = fs::path(checkpoints_dir(dir_)) / o.resume;
      config.fail("ckpt.resume", fs::is_directory(dir)
                                     ? fmt::format("{} has no COMMIT: that save did not finish; choose another "
                                                   "checkpoint (complete: {})", dir.string(), names(all))
                                     : fmt::format("{} does not exist (complete checkpoints: {})", dir.string(),
                                                   names(all)));
    }
    if (!newest || newest->name != plan.from->name) {  // an older one: a new branch
      plan.rollback = true;
      plan.lineage = run_id_;
    }
  }
  for (const CommittedCheckpoint& c : all)
    if (c.step > plan.step()) plan.abandoned.push_back(c);
  if (!plan.abandoned.empty())
    spdlog::warn("{} {}: {} {} not on this run's path; moving {} to {}/abandoned/{}/ (auto never picks them)",
                 plan.rollback ? "rollback to" : "ckpt.resume = auto resumes",
                 plan.from ? plan.from->name : std::string("step 0"), names(plan.abandoned),
                 plan.abandoned.size() == 1 ? "is" : "are", plan.abandoned.size() == 1 ? "it" : "them",
                 checkpoints_dir(dir_), run_id_);
  return plan;
}

void RunDirectory::begin(const StartPlan& plan) {
  const fs::path d(dir_);
  if (plan.clear)
    for (const fs::path& p : {d / "checkpoints", d / "model", d / "metrics.jsonl", d / kRecord, d / "config.resolved.yaml"}) {
      std::error_code ec;
      fs::remove_all(p, ec);
      if (ec) throw IoError(fmt::format("run.overwrite: cannot delete {}: {}", p.string(), ec.message()));
    }
  // First the record: a crash after it resumes from plan.from, whatever else was done.
  const json record = {{"run_id", run_id_},
                       {"lineage", plan.lineage},
                       {"started_from", plan.from ? plan.from->name : std::string()},
                       {"step", plan.step()},
                       {"host", host_name()},
                       {"pid", ::getpid()},
                       {"started", now_text("%Y-%m-%dT%H:%M:%S%z")}};
  write_file_atomically(d / kRecord, record.dump(2) + "\n");
  const fs::path aside = fs::path(checkpoints_dir(dir_)) / "abandoned" / run_id_;
  if (!plan.abandoned.empty() || plan.rollback) moetrain::create_directories(aside);
  for (const CommittedCheckpoint& c : plan.abandoned) {
    std::error_code ec;
    fs::rename(c.dir, aside / c.name, ec);
    if (ec) throw IoError(fmt::format("moving {} to {} failed: {}", c.dir, (aside / c.name).string(), ec.message()));
  }
  if (!plan.abandoned.empty()) {
    fsync_path(checkpoints_dir(dir_), true);
    const fs::path latest = fs::path(checkpoints_dir(dir_)) / "latest";  // for people: it named an abandoned one
    if (plan.from) write_file_atomically(latest, plan.from->name + "\n");
    else fs::remove(latest);
  }
  const MetricsRepair r = repair_metrics(metrics_path(), plan.step(),
                                         plan.rollback ? (aside / "metrics.jsonl").string() : std::string());
  if (r.dropped > 0)
    spdlog::info("  metrics.jsonl: {} {} records after step {} ({})", plan.rollback ? "moved aside" : "dropped",
                 r.dropped, plan.step(),
                 plan.rollback ? "the abandoned branch's" : "an earlier run's, past the step this one starts from");
}

}  // namespace moetrain
