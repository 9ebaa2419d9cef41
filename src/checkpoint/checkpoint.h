// Training checkpoints: the whole state of a run, saved so that no committed
// work is lost and nothing partial is ever loaded (docs/checkpoints.md).
//
// Layout: <run>/checkpoints/step_00000030/ holds rank_00000.h5 ... (one serial
// HDF5 file per rank), manifest.json and COMMIT. A save builds the directory as
// step_00000030.tmp.<nonce>/ and renames it when complete; <run>/checkpoints/latest
// names the newest for people (resume never trusts it).
//
// What each file holds. Every rank file: the counters (step, tokens, skipped
// steps), the data-loader position, the RNG state and the layout as attributes of
// "/". Replicated tensors (all but expert shards) only in the file of each pipeline
// stage's first rank (rank 0's at train.pp 1; not the last stage's tied copy);
// expert shards (parameters of group "experts", stacked [E_local, ...]) in the
// files of the ranks with dp_index 0, with their global expert index
// (/experts/global_index).
// Groups: /params, /buffers (router biases), /exp_avg and /exp_avg_sq (AdamW
// moments, in parameter order, named like the parameter). Every dataset is chunked
// with HDF5's Fletcher32 checksum; manifest.json lists each file's size and SHA-256.
// train.zero 1: every rank writes the moments of the elements it owns, flat, with
// /zero_range/<name> = [begin, end) in the global tensor's flattened elements; the
// manifest lists each file's pieces ("optimizer_pieces").
//
// Save order (collective): rank 0 creates the .tmp directory; every rank writes
// and fsyncs its file; the sizes and SHA-256s go to rank 0; barrier; rank 0 writes
// and fsyncs manifest.json and COMMIT, fsyncs the directory, renames it, fsyncs
// the parent, replaces `latest` atomically and deletes the checkpoints beyond
// ckpt.keep_last (never the newest) and leftover .tmp directories; barrier.
//
// Load: the files a rank needs (those with replicated tensors, those holding its
// experts or pieces of its moments) are checked against the manifest (size,
// SHA-256) before anything is read; shapes are compared name by name (every
// missing, unexpected or mismatched tensor listed in one error; a pipeline stage
// ignores the other stages' names). A different layout (pp, dp, ep, zero) is
// resharded: every tensor is a set of pieces, each a range of the global
// tensor's flattened elements in some file (a whole replicated tensor in the
// stage file that holds it, a file's expert rows, a zero 1 rank's owned
// elements), and a rank copies the overlap of each piece with the range it needs.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader.h"

namespace moetrain {

class Optimizer;
class LanguageModel;
namespace comm {
struct Distributed;
}
using comm::Distributed;

// Version 1: optimizer moments whole (train.zero 0). Version 2 (written only by
// train.zero 1 runs): moments in pieces, each rank's owned elements in its own
// file (docs/checkpoints.md). This build reads both and writes 1 at zero 0.
inline constexpr int64_t kCheckpointVersion = 1;
inline constexpr int64_t kCheckpointVersionSharded = 2;

// The training loop's counters, saved beside the tensors.
struct TrainProgress {
  int64_t step = 0;               // optimizer steps taken (skipped steps included)
  int64_t tokens = 0;             // training tokens seen (all ranks)
  int64_t skipped = 0;            // steps skipped by train.nan_policy
  int64_t consecutive_skips = 0;
  data::LoaderState loader;       // position of the training stream (shared by all ranks)
};

// A testing aid (fault.kind kill_during_ckpt): SIGKILL on this rank at a point of
// the save. before_commit: after this rank's file is written, before COMMIT;
// before_rename and before_latest: rank 0 only.
enum class CheckpointKillPoint { none, before_commit, before_rename, before_latest };

struct SaveOptions {
  int64_t keep_last = 3;
  std::string run_id, lineage;  // written to the manifest (docs/checkpoints.md, "Lineage")
  CheckpointKillPoint kill_at = CheckpointKillPoint::none;
  std::function<void()> after_rank_file;  // a testing aid: runs once this rank's file is written
};

struct SaveResult {
  std::string dir;       // the committed step directory
  int64_t bytes = 0;     // this rank's file
  double seconds = 0;    // the whole save, on this rank
};

// Saves during training: synchronously (save_checkpoint), or with ckpt.async in a
// background thread: save() copies this rank's part of the state (a memcpy of the
// weights, moments and buffers it writes) and returns; the thread writes and
// hashes the file (no MPI calls off the main thread); poll(), called by every rank
// at the end of every step, commits it (the collective part of the save) once
// every rank's thread is done. A new save, and finish() at the end of the run,
// first complete the one in flight. save()/poll()/finish() are collective.
class CheckpointSaver {
 public:
  CheckpointSaver(Distributed& d, std::string run_dir, const Config& config, bool async);
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  bool async() const { return async_; }
  // Returns what was committed by this call (the synchronous save, or the async save
  // before this one).
  std::optional<SaveResult> save(const LanguageModel& model, const Optimizer& opt, const TrainProgress& progress,
                                 const SaveOptions& options);
  std::optional<SaveResult> poll();
  std::optional<SaveResult> finish();

 private:
  struct Job;
  Distributed& d_;
  std::string run_dir_;
  const Config& config_;
  bool async_;
  std::unique_ptr<Job> job_;
};

// "step_00000030"
std::string checkpoint_name(int64_t step);
// <run>/checkpoints
std::string checkpoints_dir(const std::string& run_dir);

// Saves model, optimizer and progress as described above. Collective over d.world.
// Throws IoError when writing fails (the .tmp directory is left for the next save
// to delete; nothing committed is touched), and NumericalError (exit 3) naming the
// tensor before writing anything when a tensor it would write is not finite.
SaveResult save_checkpoint(Distributed& d, const std::string& run_dir, const LanguageModel& model, const Optimizer& opt,
                           const TrainProgress& progress, const Config& config, const SaveOptions& options);

// A committed checkpoint of a run directory, with the lineage its manifest names
// ("" for checkpoints written before lineages, or an unreadable manifest).
struct CommittedCheckpoint {
  int64_t step = 0;
  std::string name;  // step_00000030
  std::string dir;   // <run>/checkpoints/step_00000030
  std::string run_id, lineage;
  std::string manifest_problem;  // why manifest.json cannot be read (missing, not JSON, a field out of range), or ""
};
// The step directories of <run>/checkpoints that have COMMIT, oldest first; with
// `log`, one line per incomplete one (.tmp directories of saves that died).
std::vector<CommittedCheckpoint> committed_checkpoints(const std::string& run_dir, bool log);

// Loads a committed checkpoint into model and optimizer (built for this run's
// layout) and returns the progress to continue from. Every rank reads what it
// needs; no collective. Throws Error (exit 2) naming the file and dataset when a
// file is corrupt or truncated, listing every tensor whose name or shape does
// not match the model, or naming a tensor that holds NaN or infinite values.
// opt may be null (export: weights and buffers only; the optimizer state in the
// files is then not compared).
TrainProgress load_checkpoint(Distributed& d, const std::string& dir, LanguageModel& model, Optimizer* opt,
                              const Config& config);

// The config a checkpoint was saved with (config.resolved.yaml in it).
std::string checkpoint_config_path(const std::string& dir);

}  // namespace moetrain
