// The run directory (run.dir) of a training run (docs/checkpoints.md,
// "Run directories and lineages").
//
// Ownership: one process at a time holds a run directory, by an exclusive
// flock(2) on <dir>/run.lock that the kernel releases when the process ends
// (a SIGKILLed run leaves no stale lock). Under mpirun the root rank holds it.
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

#include <optional>
#include <string>
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

class RunDirectory {
 public:
  // Creates the directory when missing and takes its lock; a lock held by another
  // process is an Error (exit 2) naming its pid, host and start time. IoError
  // (exit 5) when the directory cannot be created or the lock file written.
  explicit RunDirectory(std::string dir);
  ~RunDirectory();
  RunDirectory(const RunDirectory&) = delete;
  RunDirectory& operator=(const RunDirectory&) = delete;

  const std::string& path() const { return dir_; }
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
  std::string dir_, run_id_;
  int lock_fd_ = -1;
};

}  // namespace moetrain
