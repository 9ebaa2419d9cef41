// The registry of model families and the refusals their capabilities imply (model_family.h).
#include "nn/model_family.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace moetrain {

// The families, one line each (nn/<name>_family.cpp defines it).
const ModelFamily& gpt2_family();
const ModelFamily& hybrid_family();

const std::vector<const ModelFamily*>& model_families() {
  static const std::vector<const ModelFamily*> families = {
      &gpt2_family(),
      &hybrid_family(),
  };
  return families;
}

std::vector<std::string> model_family_names() {
  std::vector<std::string> names;
  for (const ModelFamily* f : model_families()) names.push_back(f->name);
  return names;
}

std::string model_families_doc() {
  std::vector<std::string> lines;
  for (const ModelFamily* f : model_families()) lines.push_back(f->name + " = " + f->description);
  return fmt::format("{}", fmt::join(lines, "; "));
}

namespace {

std::string model_family_list() { return fmt::format("{}", fmt::join(model_family_names(), ", ")); }

}  // namespace

const ModelFamily& model_family(const std::string& name) {
  for (const ModelFamily* f : model_families())
    if (f->name == name) return *f;
  throw ConfigError(fmt::format("model.arch = {}: not a model family of this moetrain; use one of {}", name,
                                model_family_list()));
}

const ModelFamily& model_family(const Config& config) {
  const std::string name = config.get_string("model.arch");
  for (const ModelFamily* f : model_families())
    if (f->name == name) return *f;
  config.fail("model.arch", fmt::format("not a model family of this moetrain; use one of {}", model_family_list()));
}

const ModelFamily* model_family_for_hf_type(const std::string& model_type) {
  for (const ModelFamily* f : model_families())
    if (std::find(f->hf_model_types.begin(), f->hf_model_types.end(), model_type) != f->hf_model_types.end()) return f;
  return nullptr;
}

std::string families_with(bool ModelCapabilities::*capability) {
  std::vector<std::string> names;
  for (const ModelFamily* f : model_families())
    if (f->capabilities.*capability) names.push_back(f->name);
  if (names.empty()) return "no model.arch";
  return fmt::format("model.arch {}", fmt::join(names, " or "));
}

void check_capabilities(const Config& config, const ModelFamily& family, bool layout) {
  const ModelCapabilities& can = family.capabilities;
  // Layout first: a pipeline or expert split the family cannot run is refused before
  // any divisibility check would send the user to change numbers.
  if (layout && config.get_int("train.pp") > 1 && !can.pipeline_parallel)
    config.fail("train.pp", fmt::format("pipeline parallelism needs {}; model.arch {} has no pipeline stages",
                                        families_with(&ModelCapabilities::pipeline_parallel), family.name));
  if (layout && config.get_int("train.ep") > 1 && !can.expert_parallel)
    config.fail("train.ep", fmt::format("expert parallelism needs {} with MoE layers (model.moe.num_experts > 0); "
                                        "model.arch {} has no routed experts",
                                        families_with(&ModelCapabilities::expert_parallel), family.name));
  if (!config.get_string("train.recompute_modules").empty() && !can.selective_recompute)
    config.fail("train.recompute_modules",
                fmt::format("is for {}; model.arch {} recomputes {}", families_with(&ModelCapabilities::selective_recompute),
                            family.name,
                            can.full_recompute ? "whole blocks only: set train.activation_checkpointing: true instead"
                                               : "nothing"));
  if (config.get_bool("train.activation_checkpointing") && !can.full_recompute)
    config.fail("train.activation_checkpointing",
                fmt::format("is for {}; model.arch {} cannot recompute its layers in backward",
                            families_with(&ModelCapabilities::full_recompute), family.name));
}

void check_parallel_fit(const Config& config, const ModelFamily& family) {
  const int64_t pp = config.get_int("train.pp"), ep = config.get_int("train.ep");
  const int64_t virtual_stages = config.get_int("train.pp_virtual");
  if (pp > 1) {
    const int64_t layers = family.num_layers(config);
    if (pp > layers)
      config.fail("train.pp", fmt::format("exceeds the model's {} layers (each stage needs at least one)", layers));
    if (pp * virtual_stages > layers)
      config.fail("train.pp_virtual", fmt::format("gives train.pp x train.pp_virtual = {} virtual stages, more than the "
                                                  "model's {} layers (each needs at least one)",
                                                  pp * virtual_stages, layers));
  }
  if (ep > 1) {
    const int64_t experts = family.routed_experts(config);
    if (experts == 0) config.fail("train.ep", "expert parallelism needs MoE layers (model.moe.num_experts > 0)");
    if (experts % ep != 0) config.fail("train.ep", fmt::format("does not divide model.moe.num_experts = {}", experts));
  }
}

uint64_t model_seed(const Config& config) { return static_cast<uint64_t>(config.get_int("train.seed")); }

}  // namespace moetrain
