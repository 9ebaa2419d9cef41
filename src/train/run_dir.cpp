#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
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
#include "io/paths.h"
#include "train/metrics.h"

namespace moetrain {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kLock = "run.lock";
constexpr const char* kRecord = "run.json";

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

// The text of a small file of the run (run.lock, run.json), "" when it is missing or
// not a regular file (a FIFO is not waited on): what it says only feeds messages
// and lineage, and a damaged run.json starts a new lineage as a missing one does.
std::string read_text(const fs::path& path) {
  try {
    return read_regular_file(path.string(), "a run record", int64_t{1} << 20);
  } catch (const Error&) {
    return "";
  }
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

namespace {

std::pair<uint64_t, uint64_t> file_id(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

// Who holds a directory in use, for the message of a second run: run.lock's text,
// else the pid and host run.json records (run.lock may have been deleted).
std::string holder_of(const fs::path& dir) {
  std::string holder = read_text(dir / kLock);
  while (!holder.empty() && holder.back() == '\n') holder.pop_back();
  if (!holder.empty()) return holder;
  const json j = json::parse(read_text(dir / kRecord), nullptr, false);
  if (j.is_object() && j.contains("pid"))
    return fmt::format("pid {} on host {}, run {}, started {}, as {} records; {} is missing", j.value("pid", 0),
                       j.value("host", std::string("?")), j.value("run_id", std::string("?")),
                       j.value("started", std::string("?")), kRecord, kLock);
  return "holder unknown";
}

[[noreturn]] void in_use(const std::string& dir) {
  MT_THROW("run.dir {} is in use by another moetrain run ({}); wait for it to end or stop it, or choose another "
           "run.dir", dir, holder_of(dir));
}

}  // namespace

std::optional<std::string> live_run_holder(const std::string& dir) {
  auto held = [](const std::string& path, int flags) {
    const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
    if (fd < 0) return false;
    const bool busy = ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK;
    ::close(fd);  // releases the probe's lock
    return busy;
  };
  const fs::path lock = fs::path(dir) / kLock;
  std::error_code ec;
  const bool has_lock = fs::is_regular_file(lock, ec);
  if (!has_lock && !fs::is_regular_file(fs::path(dir) / kRecord, ec)) return std::nullopt;  // not a run directory
  if (!(has_lock && held(lock.string(), O_RDONLY)) && !held(dir, O_RDONLY | O_DIRECTORY)) return std::nullopt;
  return holder_of(dir);
}

RunDirectory::RunDirectory(std::string dir, bool lock_directory) : dir_(std::move(dir)), run_id_(new_run_id()) {
  moetrain::create_directories(dir_);
  try {
    take_locks(lock_directory);
  } catch (...) {  // no destructor runs: release what was taken
    if (lock_fd_ >= 0) ::close(lock_fd_);
    if (dir_fd_ >= 0) ::close(dir_fd_);
    throw;
  }
}

void RunDirectory::take_locks(bool lock_directory) {
  // First the directory's own lock: deleting run.lock does not release it.
  dir_fd_ = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd_ < 0) throw IoError(fmt::format("run.dir {}: cannot open: {}", dir_, std::strerror(errno)));
  struct stat st {};
  if (::fstat(dir_fd_, &st) != 0) throw IoError(fmt::format("run.dir {}: cannot stat: {}", dir_, std::strerror(errno)));
  dir_id_ = file_id(st);
  if (lock_directory) {
    if (::flock(dir_fd_, LOCK_EX | LOCK_NB) == 0) {
      dir_locked_ = true;
    } else if (errno == EWOULDBLOCK) {
      in_use(dir_);
    } else {  // NFS emulates flock with byte-range locks, which a directory cannot take (EBADF)
      spdlog::info("run.dir {}: the file system cannot lock a directory ({}); {} alone holds it", dir_,
                   std::strerror(errno), kLock);
    }
  }
  take_lock_file();
}

void RunDirectory::take_lock_file() {
  const std::string lock = (fs::path(dir_) / kLock).string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError(fmt::format("{}: cannot open the run's lock file: {}", lock, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err != EWOULDBLOCK) throw IoError(fmt::format("{}: cannot lock: {}", lock, std::strerror(err)));
    in_use(dir_);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(fmt::format("{}: cannot stat: {}", lock, std::strerror(err)));
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);
  lock_fd_ = fd;
  lock_id_ = file_id(st);
  // Who holds it, for the message of a second run (the lock is the flock, not this text).
  const std::string who = fmt::format("pid {} on host {}, run {}, started {}", ::getpid(), host_name(), run_id_,
                                      now_text("%Y-%m-%d %H:%M:%S"));
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    throw IoError(fmt::format("{}: writing the lock holder failed: {}", lock, std::strerror(errno)));
}

void RunDirectory::check_held() {
  struct stat st {};
  const std::string lock = (fs::path(dir_) / kLock).string();
  if (::stat(dir_.c_str(), &st) != 0 || file_id(st) != dir_id_)
    MT_THROW("run.dir {} was {} while this run held it: stopping before writing more (another run may be using the "
             "path now); the checkpoints of this run are in the directory it locked: resume there with ckpt.resume: "
             "auto", dir_, ::stat(dir_.c_str(), &st) != 0 ? "moved or deleted" : "replaced by another directory");
  if (::stat(lock.c_str(), &st) == 0 && file_id(st) == lock_id_) return;
  if (!dir_locked_)
    MT_THROW("{} was deleted or replaced while this run held run.dir {}, and this file system cannot lock the "
             "directory itself: another run may have started there, so this one stops before writing more; the "
             "committed checkpoints are intact: once no other run uses {}, continue with ckpt.resume: auto", lock, dir_,
             dir_);
  take_lock_file();  // the directory's lock kept every other run out
  spdlog::warn("{} was deleted or replaced while this run held run.dir {}; the run holds the directory's own lock, so "
               "no other run could start there: {} is written again (docs/checkpoints.md)", lock, dir_, lock);
}

RunDirectory::~RunDirectory() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flocks
  if (dir_fd_ >= 0) ::close(dir_fd_);
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
    // A manifest that cannot be read hides which lineage its checkpoint belongs to:
    // rather than skip it as another branch's (and move it aside), auto stops.
    for (const CommittedCheckpoint& c : all)
      if (!c.manifest_problem.empty() && (!newest || c.step > newest->step))
        config.fail("ckpt.resume", fmt::format(
            "the manifest of {} cannot be read ({}), so auto cannot tell whether it is this run's newest "
            "checkpoint and does not skip it: resume from an older one with ckpt.resume: {} (the newest intact one "
            "of this run), or move {} out of {} if it is not needed", c.dir, c.manifest_problem,
            newest ? newest->name : std::string("step_..."), c.dir, checkpoints_dir(dir_)));
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
