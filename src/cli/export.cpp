// `moetrain export --checkpoint DIR --format safetensors|hdf5 --out DIR [--dtype f32|bf16]
//  [--max-shard-size 5GB] [--force] [--no-progress]`: one unsharded model directory with
// Hugging Face names and config.json (checkpoint/export.h, docs/export.md).
//
// --out must not exist or be empty, unless --force (then it is replaced once the new
// directory is complete); --out may not be --checkpoint itself, contain it, hold a
// run's files (run.lock, checkpoints, ...) that --force would delete, be a file, or
// lie inside a run directory a live run holds. Bad input exits 2 with a message
// naming the paths; a failed write exits 5 naming the file and the system's
// message (--out is then as it was); a tensor with NaN or infinities in the model, or
// after rounding to --dtype, exits 3 naming it before anything is written.
#include <filesystem>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "cli/commands.h"
#include "cli/model_options.h"
#include "core/error.h"
#include "train/model_source.h"
#include "train/run_dir.h"

namespace moetrain::cli {

namespace {

struct ExportCommandOptions {
  std::string checkpoint, out, format = "safetensors", dtype = "f32", max_shard_size = "5GB";
  bool force = false, no_progress = false, print_config = false;
};

namespace fs = std::filesystem;

// The first thing under `dir` that belongs to a training run or a
// checkpoint, which --force would delete with it, or "". Directory links are not
// followed; past kLimit entries the directory is taken as not a model directory.
std::string run_content_in(const fs::path& dir) {
  constexpr int64_t kLimit = 10000;
  static const char* const kMarks[] = {"run.lock", "run.json", "metrics.jsonl", "checkpoints", "COMMIT",
                                       "manifest.json"};
  auto mark = [](const fs::path& p) {
    for (const char* m : kMarks)
      if (p.filename() == m) return true;
    return false;
  };
  std::error_code ec;
  int64_t seen = 0;
  for (fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end;
       !ec && it != end; it.increment(ec)) {
    if (mark(it->path())) return it->path().string();
    if (++seen > kLimit)
      return fmt::format("more than {} entries (a model directory holds a few files)", kLimit);
  }
  if (ec) return fmt::format("{} (cannot be listed: {})", dir.string(), ec.message());
  return "";
}

// --out against --checkpoint and against runs, before anything is loaded (exit 2, naming both paths).
void check_out(const ExportCommandOptions& o) {
  std::error_code ec;
  const fs::path out(o.out);
  const bool out_exists = fs::exists(fs::symlink_status(out, ec));
  if (out_exists)
    MT_CHECK(fs::is_directory(out, ec), "--out {} is {}, not a directory: export writes a directory "
             "(model.safetensors, config.json, ...); remove it or choose another --out", o.out,
             fs::is_symlink(fs::symlink_status(out, ec)) && !fs::exists(out, ec) ? "a link to nothing" : "a file");
  // Links and ".." resolved; where that fails (a component not searchable), the absolute path as written.
  auto resolved = [](const fs::path& p) {
    std::error_code e;
    const fs::path r = fs::weakly_canonical(p, e);
    return e ? fs::absolute(p, e).lexically_normal() : r;
  };
  const fs::path source = resolved(o.checkpoint), target = resolved(out);
  MT_CHECK(target != source, "--out {} is the --checkpoint directory; write the export elsewhere", o.out);
  // Replacing --out deletes what it holds: never the source, never a run's checkpoints.
  auto inside = [](const fs::path& a, const fs::path& b) {  // a inside b (or b itself)
    auto ai = a.begin(), bi = b.begin();
    for (; bi != b.end(); ++ai, ++bi)
      if (ai == a.end() || *ai != *bi) return false;
    return true;
  };
  MT_CHECK(!inside(source, target), "--out {} contains the --checkpoint {}: replacing --out would delete the "
           "source; write the export elsewhere", o.out, o.checkpoint);
  if (out_exists && o.force && !fs::is_empty(out, ec)) {
    const std::string found = run_content_in(out);
    MT_CHECK(found.empty(), "--out {} holds {}, part of a training run or checkpoint, which --force would delete with "
             "it (the --checkpoint is {}); write the export elsewhere", o.out, found, o.checkpoint);
  }
  // Not inside a run directory while its run is writing there (it replaces <run>/model at its end).
  for (fs::path d = target; !d.empty(); d = d.parent_path()) {
    if (const std::optional<std::string> holder = live_run_holder(d.string()))
      MT_THROW("--out {} is inside run.dir {}, which a live run holds ({}); wait for it to end or write the export "
               "elsewhere (the --checkpoint is {})", o.out, d.string(), *holder, o.checkpoint);
    if (d == d.parent_path()) break;
  }
}

int run_export(const ExportCommandOptions& o) {
  ExportOptions options;
  options.format = parse_export_format(o.format);
  options.dtype = parse_export_dtype(o.dtype);
  options.max_shard_bytes = parse_byte_size(o.max_shard_size);
  options.replace = o.force;
  options.progress = !o.no_progress;
  options.tokenizer_files = true;
  MT_CHECK(!o.out.empty() || o.print_config, "export: --out is required (the directory to write); run 'moetrain "
           "export --help' for the options");
  if (!o.print_config) {
    check_out(o);
    std::error_code ec;
    if (fs::exists(o.out, ec))
      MT_CHECK(o.force || fs::is_empty(o.out, ec),
               "--out {} exists and is not an empty directory; choose another or pass --force to replace it", o.out);
  }
  ModelSource source;
  source.checkpoint = o.checkpoint;
  LoadedModel m = load_model(source);
  m.config.set("model.init_from", "''", "moetrain export");  // the export stands alone
  if (o.print_config) {
    fmt::print("{}", m.config.to_yaml());
    return 0;
  }
  spdlog::info("export: {} ({}) -> {} ({}, {})", o.checkpoint, m.model->describe(), o.out, o.format, o.dtype);
  export_model_dir(*m.model, m.state(), o.out, options, &m.config);
  spdlog::info("export: wrote {}", o.out);
  return 0;
}

}  // namespace

void add_export_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("export", "Write one model directory with Hugging Face names and config.json");
  auto o = std::make_shared<ExportCommandOptions>();
  cmd->add_option("--checkpoint", o->checkpoint, kCheckpointHelp)
      ->required();
  cmd->add_option("--out", o->out, "the directory to write (must not exist or be empty, unless --force); required");
  cmd->add_option("--format", o->format, "safetensors or hdf5");
  cmd->add_option("--dtype", o->dtype, "f32 or bf16 (round to nearest even)");
  cmd->add_option("--max-shard-size", o->max_shard_size,
                  "safetensors: shard above this size (bytes, or 5GB, 500MB, 2GiB)");
  cmd->add_flag("--force", o->force, "replace --out if it exists and is not empty");
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar or lines");
  cmd->add_flag("--print-config", o->print_config, "print the source's resolved config (YAML) and exit");
  commands.push_back({cmd, [o] {
    try {
      return run_export(*o);
    } catch (const std::filesystem::filesystem_error& e) {  // a stat or listing the system refused (EACCES, EIO)
      throw IoError(fmt::format("export: {}: {}", e.path1().string(), e.code().message()));
    }
  }});
}

}  // namespace moetrain::cli
