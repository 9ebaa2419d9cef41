// `moetrain export --checkpoint DIR --format safetensors|hdf5 --out DIR [--dtype f32|bf16]
//  [--max-shard-size 5GB] [--force] [--no-progress]`: one unsharded model directory with
// Hugging Face names and config.json (checkpoint/export.h, docs/export.md).
//
// --out must not exist or be empty, unless --force (then it is replaced once the new
// directory is complete); --out may not be --checkpoint itself. Bad input exits 2 with a
// message naming the path; a failed write exits 5 naming the file and the system's
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

namespace moetrain::cli {

namespace {

struct ExportCommandOptions {
  std::string checkpoint, out, format = "safetensors", dtype = "f32", max_shard_size = "5GB";
  bool force = false, no_progress = false, print_config = false;
};

int run_export(const ExportCommandOptions& o) {
  namespace fs = std::filesystem;
  ExportOptions options;
  options.format = parse_export_format(o.format);
  options.dtype = parse_export_dtype(o.dtype);
  options.max_shard_bytes = parse_byte_size(o.max_shard_size);
  options.replace = o.force;
  options.progress = !o.no_progress;
  MT_CHECK(!o.out.empty() || o.print_config, "export: --out is required (the directory to write); run 'moetrain "
           "export --help' for the options");
  std::error_code ec;
  const bool same = fs::exists(o.out) && fs::exists(o.checkpoint) && fs::equivalent(o.out, o.checkpoint, ec);
  MT_CHECK(o.print_config || !same,
           "--out {} is the --checkpoint directory; write the export elsewhere", o.out);
  if (!o.print_config && fs::exists(o.out))
    MT_CHECK(fs::is_directory(o.out) && (o.force || fs::is_empty(o.out)),
             "--out {} exists and is not an empty directory; choose another or pass --force to replace it", o.out);
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
