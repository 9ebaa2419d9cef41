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
#include "comm/communicator.h"
#include "comm/process_grid.h"
#include "cli/commands.h"
#include "core/error.h"
#include "train/distributed.h"
#include "train/model_source.h"

namespace moetrain::cli {

namespace {

// What the export needs from its source: the resolved config, the model and its full
// state (parameters and buffers at full size). The one place that knows where models
// come from: a model directory (<run>/model, an export) or a training checkpoint.
struct LoadedModel {
  Config config;
  std::unique_ptr<LanguageModel> model;
  ParameterList state;
};

// A training checkpoint (<run>/checkpoints/step_N, docs/checkpoints.md): its own
// config, one process holding every expert (resharded from however many ranks
// saved it), weights and buffers only.
LoadedModel load_training_checkpoint(const std::string& path) {
  Config config = Config::load(checkpoint_config_path(path), {"train.ep=1"});
  config.set("model.init_from", "''", "moetrain export");
  std::unique_ptr<comm::Communicator> one = comm::single_process();
  Distributed d;
  d.world = one.get();
  d.grid = comm::make_process_grid(*one, 1);
  LoadedModel m{config, build_model(config), {}};
  const TrainProgress p = load_checkpoint(d, path, *m.model, nullptr, config);
  spdlog::info("training checkpoint {}: step {}, {} tokens seen", path, p.step, p.tokens);
  m.state = m.model->parameters();
  const ParameterList buffers = m.model->buffers();
  m.state.insert(m.state.end(), buffers.begin(), buffers.end());
  return m;
}

LoadedModel load_model_for_export(const std::string& path) {
  namespace fs = std::filesystem;
  MT_CHECK(fs::is_directory(path), "--checkpoint {}: no such directory", path);
  if (fs::exists(fs::path(path) / "manifest.json")) return load_training_checkpoint(path);
  ModelSource source;
  source.checkpoint = path;
  LoadedModel m{resolve_config(source), nullptr, {}};
  m.model = build_model(m.config);
  m.config.set("model.init_from", "''", "moetrain export");  // the export stands alone
  m.state = m.model->parameters();
  const ParameterList buffers = m.model->buffers();
  m.state.insert(m.state.end(), buffers.begin(), buffers.end());
  return m;
}

struct ExportCommandOptions {
  std::string checkpoint, out, format = "safetensors", dtype = "f32", max_shard_size = "5GB";
  bool force = false, no_progress = false;
};

int run_export(const ExportCommandOptions& o) {
  namespace fs = std::filesystem;
  ExportOptions options;
  options.format = parse_export_format(o.format);
  options.dtype = parse_export_dtype(o.dtype);
  options.max_shard_bytes = parse_byte_size(o.max_shard_size);
  options.replace = o.force;
  options.progress = !o.no_progress;
  std::error_code ec;
  MT_CHECK(!(fs::exists(o.out) && fs::exists(o.checkpoint) && fs::equivalent(o.out, o.checkpoint, ec)),
           "--out {} is the --checkpoint directory; write the export elsewhere", o.out);
  if (fs::exists(o.out))
    MT_CHECK(fs::is_directory(o.out) && (o.force || fs::is_empty(o.out)),
             "--out {} exists and is not an empty directory; choose another or pass --force to replace it", o.out);
  LoadedModel m = load_model_for_export(o.checkpoint);
  spdlog::info("export: {} ({}) -> {} ({}, {})", o.checkpoint, m.model->describe(), o.out, o.format, o.dtype);
  export_model_dir(*m.model, m.state, o.out, options, &m.config);
  spdlog::info("export: wrote {}", o.out);
  return 0;
}

}  // namespace

void add_export_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("export", "Write one model directory with Hugging Face names and config.json");
  auto o = std::make_shared<ExportCommandOptions>();
  cmd->add_option("--checkpoint", o->checkpoint,
                  "a training checkpoint (<run>/checkpoints/step_N) or a model directory (<run>/model, an export)")
      ->required();
  cmd->add_option("--out", o->out, "the directory to write (must not exist or be empty, unless --force)")->required();
  cmd->add_option("--format", o->format, "safetensors (default) or hdf5");
  cmd->add_option("--dtype", o->dtype, "f32 (default) or bf16 (round to nearest even)");
  cmd->add_option("--max-shard-size", o->max_shard_size,
                  "safetensors: shard above this size (bytes, or 5GB, 500MB, 2GiB; default 5GB)");
  cmd->add_flag("--force", o->force, "replace --out if it exists and is not empty");
  cmd->add_flag("--no-progress", o->no_progress, "no progress bar or lines");
  commands.push_back({cmd, [o] {
    try {
      return run_export(*o);
    } catch (const std::filesystem::filesystem_error& e) {  // a stat or listing the system refused (EACCES, EIO)
      throw IoError(fmt::format("export: {}: {}", e.path1().string(), e.code().message()));
    }
  }});
}

}  // namespace moetrain::cli
