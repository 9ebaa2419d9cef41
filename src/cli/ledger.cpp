// `moetrain ledger -c CONFIG [--set k=v] [--pp P] [--dp N] [--ep M] [--zero 0|1] [--micro-batch B]
// [--micro-batches K] [--gpu-memory 140GiB] [--json] [--print-config]`: parameters per component,
// total and active, training FLOPs per token, memory per rank of a pp x dp x ep layout against
// a device's memory, and an estimated step time, counted on shapes only (the full Kimi-K3 in about
// a second). `--plan N` searches the layouts of N devices instead (docs/parallelism.md#the-ledger-flags).
// Exit codes: 0; 1 when --plan finds no layout that fits; 2 for bad flags or configs.
#include <cctype>
#include <cmath>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "cli/commands.h"
#include "config/cli_options.h"
#include "core/error.h"
#include "nn/ledger.h"

namespace moetrain::cli {

namespace {

// "140GiB" -> 140 x 2^30, "141GB" -> 141e9, "450GB/s" -> 450e9 (with per_second):
// K, M, G, T are powers of 1000, Ki, Mi, Gi, Ti powers of 1024; a unit is required.
double parse_size(const std::string& flag, const std::string& text, bool per_second) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  if (per_second && unit.size() > 2 && unit.compare(unit.size() - 2, 2, "/s") == 0) unit.resize(unit.size() - 2);
  static const std::vector<std::pair<std::string, double>> units = {
      {"B", 1},       {"KB", 1e3},  {"MB", 1e6},  {"GB", 1e9},  {"TB", 1e12}, {"KiB", 1024.0}, {"MiB", 1048576.0},
      {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
  for (const auto& [name, scale] : units)
    if (used > 0 && value >= 0 && std::isfinite(value) && unit == name) return value * scale;
  throw Error(fmt::format("ledger: {} {}: expected a size with a unit, e.g. {}", flag, text,
                          per_second ? "450GB/s" : "140GiB or 141GB"));
}

}  // namespace

void add_ledger_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand("ledger", "Parameter, FLOP and memory ledger of a config (no allocation)");
  struct Options {
    LedgerLayout layout;
    int64_t plan = 0, global_batch = 0, top = 10;
    std::string gpu_memory = "140GiB", reserve = "10GiB", intra_bw = "450GB/s", inter_bw = "50GB/s";
    double peak_tflops = 989, mfu = 0.4;
    int64_t gpus_per_node = 8;
    bool json = false;
  };
  auto o = std::make_shared<Options>();
  auto config_options = add_config_options(cmd, true);
  cmd->add_option("--pp", o->layout.pp, "pipeline stages (layers split as train.pp does)")->check(positive());
  cmd->add_option("--dp", o->layout.dp, "data-parallel replicas of each stage (memory per rank)")->check(positive());
  cmd->add_option("--ep", o->layout.ep, "expert-parallel ranks (experts sharded over them)")->check(positive());
  cmd->add_option("--zero", o->layout.zero, "1: optimizer state (and bf16 runs' f32 master) sharded over the replicas")
      ->check(non_negative());
  cmd->add_option("--micro-batch", o->layout.micro_batch, "sequences per micro-batch (default train.batch_size)")
      ->check(positive());
  cmd->add_option("--micro-batches", o->layout.num_micro_batches,
                  "micro-batches per step and pipeline, the 1F1B schedule's M (default train.grad_accum)")
      ->check(positive());
  cmd->add_option("--pp-virtual", o->layout.virtual_stages,
                  "virtual stages per pipeline rank, the interleaved 1F1B (default train.pp_virtual)")
      ->check(positive());
  CLI::Option* plan = cmd->add_option("--plan", o->plan,
                                      "search the layouts of this many devices; print the feasible ones, fastest first")
                          ->check(positive());
  for (const char* one_layout : {"--pp", "--pp-virtual", "--dp", "--ep", "--zero", "--micro-batches"})
    plan->excludes(cmd->get_option(one_layout));
  cmd->add_option("--global-batch", o->global_batch,
                  "--plan: sequences per optimizer step (default: devices x train.batch_size x train.grad_accum)")
      ->check(positive())
      ->needs(plan);
  cmd->add_option("--top", o->top, "--plan: layouts printed")->check(positive());
  cmd->add_option("--gpu-memory", o->gpu_memory, "memory per device (an H200: 140GiB)")->capture_default_str();
  cmd->add_option("--reserve", o->reserve, "of it, kept for the CUDA context, NCCL and fragmentation")
      ->capture_default_str();
  cmd->add_option("--peak-tflops", o->peak_tflops, "peak dense TFLOP/s per device (H200 bf16: 989)")
      ->capture_default_str();
  cmd->add_option("--mfu", o->mfu, "fraction of the peak the layers reach")->capture_default_str();
  cmd->add_option("--intra-bw", o->intra_bw, "bandwidth per device inside a node (NVLink)")->capture_default_str();
  cmd->add_option("--inter-bw", o->inter_bw, "bandwidth per device across nodes")->capture_default_str();
  cmd->add_option("--gpus-per-node", o->gpus_per_node, "devices per node")->check(positive())->capture_default_str();
  cmd->add_flag("--json", o->json, "machine-readable output");
  commands.push_back({cmd, [o, config_options] {
    Config config = load_from(*config_options);
    if (config_options->print_config) {
      fmt::print("{}", config.to_yaml());
      return 0;
    }
    ClusterAssumptions cluster;
    cluster.gpu_memory = parse_size("--gpu-memory", o->gpu_memory, false);
    cluster.reserve = parse_size("--reserve", o->reserve, false);
    cluster.intra_bandwidth = parse_size("--intra-bw", o->intra_bw, true);
    cluster.inter_bandwidth = parse_size("--inter-bw", o->inter_bw, true);
    cluster.peak_flops = o->peak_tflops * 1e12;
    cluster.mfu = o->mfu;
    cluster.devices_per_node = o->gpus_per_node;
    if (cluster.reserve >= cluster.gpu_memory)
      throw Error(fmt::format("ledger: --reserve {} leaves nothing of --gpu-memory {}", o->reserve, o->gpu_memory));
    if (!(o->mfu > 0 && o->mfu <= 1) || !(o->peak_tflops > 0) || cluster.intra_bandwidth <= 0 ||
        cluster.inter_bandwidth <= 0)
      throw Error(fmt::format("ledger: --mfu {} must be in (0, 1]; --peak-tflops {}, --intra-bw {}, --inter-bw {} "
                              "must be above 0",
                              o->mfu, o->peak_tflops, o->intra_bw, o->inter_bw));
    if (o->plan > 0) {
      PlanOptions options{o->plan, o->global_batch, o->layout.micro_batch, o->top};
      Plan plan = plan_layouts(config, options, cluster);
      fmt::print("{}\n", o->json ? plan_json(plan) : plan_text(plan));
      return plan.feasible.empty() ? 1 : 0;
    }
    Ledger l = make_ledger(config, o->layout, cluster);
    fmt::print("{}\n", o->json ? ledger_json(l) : ledger_text(l));
    return 0;
  }});
}

}  // namespace moetrain::cli
