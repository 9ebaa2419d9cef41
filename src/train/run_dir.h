// The run directory (run.dir) of a training run (docs/checkpoints.md,
// "Run directories and lineages").
//
// Ownership: one process at a time holds a run directory, by an exclusive
// flock(2) on the directory itself and on <dir>/run.lock, both released by the
// kernel when the process ends (a SIGKILLed run leaves no stale lock). Under
// mpirun the root rank holds them. The directory's lock cannot be side-stepped
// by deleting a file; run.lock names the holder for people (and is the lock
// where the file system cannot lock a directory, e.g. NFS). Before each metrics
// record, checkpoint and model write, check_held() verifies that the path still
// names the locked directory and run.lock the locked file (docs/checkpoints.md,
// "Run directories and lineages").
//
// Identity: every run (one `moetrain train` process group) gets an id, written
// as the "run" field of its metrics.jsonl records and into the manifests of its
// checkpoints. Runs form lineages: a run continues the lineage of the run it
// resumes; a fresh start, or a rollback (ckpt.resume names a checkpoint older
// than the newest of the lineage), starts a new one. <dir>/run.json records the
// latest run's id, lineage and the checkpoint it started from, so that
// `ckpt.resume: auto` follows that lineage and never jumps forward into the
// checkpoints of a branch a rollback abandoned; those are moved to
// <dir>/checkpoints/abandoned/<run id>/ with their metrics records.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "train/options.h"

namespace moetrain {

// Where a run starts, decided from the directory without writing anything.
struct StartPlan {
  std::optional<CommittedCheckpoint> from;  // none: step 0
  std::string lineage;                      // the lineage this run continues or starts
  bool rollback = false;                    // `from` is older than the newest checkpoint of its lineage
  std::vector<CommittedCheckpoint> abandoned;  // committed checkpoints after `from`, moved aside by begin()
  bool clear = false;                       // run.overwrite: the earlier run's outputs are deleted by begin()
  int64_t step() const { return from ? from->step : 0; }
};

// When a live run holds `dir` (a run directory, with run.lock or run.json: its
// run.lock or the directory's own lock is held by a process), who: run.lock's text ("holder unknown" when empty);
// nullopt otherwise. Probes with a shared, non-blocking flock released at once.
std::optional<std::string> live_run_holder(const std::string& dir);

class RunDirectory {
 public:
  // Creates the directory when missing and takes its locks; a lock held by another
  // process is an Error (exit 2) naming its pid, host and start time. IoError
  // (exit 5) when the directory cannot be created or the lock file written.
  // lock_directory false: only run.lock, as where a directory cannot be flocked
  // (the fallback; tests use it to reach that path).
  explicit RunDirectory(std::string dir, bool lock_directory = true);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return dir_; }
  // Whether the directory itself is locked (false: the file system refused, run.lock alone holds it).
  bool directory_locked() const { return dir_locked_; }
  // Before a write into the directory: the path must still name the directory this
  // run locked, and run.lock the file it locked. A run.lock deleted or replaced while
  // the directory's lock holds is taken again (with a warning); without the
  // directory's lock, or when the directory was moved, replaced or deleted, it is an
  // Error (exit 2): another run may be writing there, so this one stops.
  void check_held();
  const std::string& run_id() const { return run_id_; }
  std::string metrics_path() const { return dir_ + "/metrics.jsonl"; }

  // What ckpt.resume means here (reads only; logs what it ignores). Errors
  // (ConfigError naming ckpt.resume, exit 2): a named checkpoint that is missing or
  // incomplete; resume none in a directory holding an earlier run's checkpoints,
  // metrics or model without run.overwrite.
  StartPlan plan(const CheckpointOptions& options, const Config& config) const;
  // Makes the start durable, in an order that a crash at any point leaves
  // resumable: deletes the earlier run (plan.clear), writes run.json, moves the
  // abandoned checkpoints aside, makes metrics.jsonl one history up to the start
  // step. IoError when a write fails.
  void begin(const StartPlan& plan);

 private:
  void take_locks(bool lock_directory);
  void take_lock_file();  // opens, locks and writes run.lock (lock_fd_, lock_id_)
  std::string dir_, run_id_;
  int dir_fd_ = -1, lock_fd_ = -1;
  bool dir_locked_ = false;
  std::pair<uint64_t, uint64_t> dir_id_{}, lock_id_{};  // (st_dev, st_ino) of what is locked
};

}  // namespace moetrain
