// The model families moetrain builds (model.arch) and what each can do
// (docs/architecture.md#adding-a-model-family). A family is one record: its name,
// how it reads and builds its model from a Config, its Hugging Face config.json
// reader, what the ledger needs of it, and its capabilities. The refusals that follow
// from a capability (train.pp for a family without pipeline stages, ...) are made
// here, in check_capabilities, never by testing model.arch elsewhere.
//
// A family lives in one file (nn/gpt2_family.cpp, nn/hybrid_family.cpp) that defines
// `const ModelFamily& <name>_family()`; model_family.cpp lists it in the registry.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "nn/hf_adapter.h"
#include "nn/language_model.h"
#include "nn/moe.h"
#include "nn/param_factory.h"

namespace moetrain {

// How a family's LM head relates to its token embedding.
enum class TiedEmbeddings {
  always,    // the head is the embedding (GPT-2): model.tie_embeddings is not read
  optional,  // model.tie_embeddings chooses
};

// What a family's models can do; each false capability is a refusal in check_capabilities.
struct ModelCapabilities {
  bool pipeline_parallel = false;    // train.pp > 1: the model builds one pipeline stage
  bool expert_parallel = false;      // train.ep > 1: routed experts sharded over ranks
  bool full_recompute = false;       // train.activation_checkpointing: whole layers recomputed in backward
  bool selective_recompute = false;  // train.recompute_modules: named modules recomputed
  bool learned_positions = false;    // position embeddings: those past train.seq_len never trained
  TiedEmbeddings tied_embeddings = TiedEmbeddings::optional;
};

// Where the model being built sits in the run: its experts and its pipeline stage.
struct ModelPlacement {
  ExpertShard shard;   // this rank's routed experts (expert parallel families)
  PipelineStage stage; // this rank's pipeline stage (pipeline parallel families)
};

// What the ledger (nn/ledger.cpp) reads of a model built on shapes only.
// The op of a bf16 model on the CPU that holds the largest f32 tensors while it runs:
// an f32 result of a bf16 op before its rounding (a biased linear's product,
// ops/linalg/linalg_cpu.cpp), or f32 copies of its bf16 tensors for a kernel without a
// bf16 path of its own (ops/common/bf16_widen.h; docs/cuda.md "bf16 on the CPU"): its
// name and those f32 values per token. {"", 0} when there is none.
struct CpuWidenedOp {
  std::string name;
  int64_t values_per_token = 0;
};

struct LedgerShapes {
  std::unique_ptr<LanguageModel> model;        // built without allocating
  const std::vector<ParamSpec>* specs = nullptr;  // model's parameters (points into `model`)
  int64_t n_layer = 0, d_model = 0;
  int64_t experts = 0, top_k = 0, moe_width = 0;  // moe_width: the dispatched row (latent L, else D)
  std::vector<bool> moe_layer;                    // per layer
  bool tied = false;                              // the LM head is the embedding table
  // The model's estimates over layers [first, end), with or without the head.
  std::function<double(int64_t, int64_t, bool)> flops, activations;
  std::function<int64_t(int64_t)> boundary;                 // values per token entering layer l
  std::function<int64_t(const std::string&)> layer_of;      // a parameter's layer (-1 before, n_layer after)
  // Forward FLOPs per token that train.recompute_modules runs again, over layers [first, end).
  std::function<double(int64_t, int64_t)> selective_flops = [](int64_t, int64_t) { return 0.0; };
  CpuWidenedOp cpu_widened;  // a bf16 step's largest f32 transient on the CPU (the ledger counts it there)
};

struct ModelFamily {
  std::string name;         // model.arch
  std::string description;  // one line with its docs section (the schema's doc of model.arch)
  ModelCapabilities capabilities;

  // The model with random weights (seed train.seed) for `placement`, its config read
  // (and so validated: errors name the key, Config::fail) on the way; model.init_from
  // is build_model's business (train/model_source.h).
  std::function<std::unique_ptr<LanguageModel>(const Config&, const ModelPlacement&)> build;
  // The ledger's view: the model built on shapes only, at sequence length seq_len.
  std::function<LedgerShapes(const Config&, int64_t seq_len, bool mixed_precision)> ledger_shapes;
  std::function<int64_t(const Config&)> num_layers;
  std::function<int64_t(const Config&)> routed_experts;  // 0: no MoE layers
  std::function<bool(const Config&)> ties_embeddings;

  // Hugging Face config.json model_type values this family reads, and the reader.
  std::vector<std::string> hf_model_types;
  std::function<HfArchitecture(const std::string& path, const std::string& model_type)> read_hf_architecture;
};

// Every registered family, in registration order.
const std::vector<const ModelFamily*>& model_families();
// The registered names, in registration order: model.arch's choices (config/schema.cpp).
std::vector<std::string> model_family_names();
// "gpt2 = GPT-2 (docs/...); hybrid = ...": what model.arch's doc in config/schema.cpp
// must say (config/ sits below nn/, so the schema spells it; tests compare).
std::string model_families_doc();
// The family `name`; ConfigError naming model.arch and the families there are when none.
const ModelFamily& model_family(const std::string& name);
// The family of config's model.arch.
const ModelFamily& model_family(const Config& config);
// The family reading config.json's model_type; null when none.
const ModelFamily* model_family_for_hf_type(const std::string& model_type);

// The families with a capability, for messages: "model.arch hybrid", "model.arch a or b",
// "no model.arch".
std::string families_with(bool ModelCapabilities::*capability);

// The refusals of what `family` cannot do, each a ConfigError naming the key with
// its origin (Config::fail; exit 2): train.recompute_modules without selective
// recomputation, train.activation_checkpointing without full recomputation, and with
// `layout` also train.pp > 1 without pipeline stages and train.ep > 1 without expert
// parallelism (the ledger passes layout false: it estimates layouts the trainer cannot run).
void check_capabilities(const Config& config, const ModelFamily& family, bool layout = true);

// Whether the model can be cut as train.pp, train.pp_virtual and train.ep ask: at
// least one layer per (virtual) stage, train.ep dividing the routed experts (and MoE
// layers at all). ConfigError naming the key.
void check_parallel_fit(const Config& config, const ModelFamily& family);

// train.seed, as every family's builder seeds its parameters.
uint64_t model_seed(const Config& config);

// Binds the ledger's estimates to a model with the per-layer-range estimate
// functions (flops_per_token(T, first, end, head), activation_bytes_per_token(mixed,
// first, end, head), boundary_values_per_token(l), parameter_layer(name)).
template <class Model>
void bind_ledger_estimates(LedgerShapes& s, const Model* p, int64_t seq_len, bool mixed_precision) {
  s.specs = &p->param_specs();
  s.flops = [p, seq_len](int64_t first, int64_t end, bool head) { return p->flops_per_token(seq_len, first, end, head); };
  s.activations = [p, mixed_precision](int64_t first, int64_t end, bool head) {
    return p->activation_bytes_per_token(mixed_precision, first, end, head);
  };
  s.boundary = [p](int64_t l) { return p->boundary_values_per_token(l); };
  s.layer_of = [p](const std::string& name) { return p->parameter_layer(name); };
}

}  // namespace moetrain
