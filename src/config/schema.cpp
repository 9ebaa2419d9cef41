// The schema table. One entry per key, grouped by section; a later issue adds
// its options here (and its consistency checks in its own code, via
// Config::fail). Defaults of the model section are GPT-2 small (124M).
#include "config/schema.h"

#include <algorithm>
#include <unordered_map>

#include <fmt/format.h>

namespace moetrain {
namespace {

// Bounds of a numeric key, spelled like the maths: at_least(1) is [1, inf),
// in(0, 1) is [0, 1], in_half_open(0, 1) is [0, 1), above(0) is (0, inf).
struct Range {
  std::optional<double> min, max;
  bool min_exclusive = false, max_exclusive = false;
};
Range at_least(double lo) { return {lo, std::nullopt, false, false}; }
Range above(double lo) { return {lo, std::nullopt, true, false}; }
Range in(double lo, double hi) { return {lo, hi, false, false}; }
Range in_half_open(double lo, double hi) { return {lo, hi, false, true}; }

KeySpec spec(ConfigType type, std::string key, std::string def, std::string doc) {
  KeySpec s{};
  s.key = std::move(key);
  s.type = type;
  s.default_yaml = std::move(def);
  s.doc = std::move(doc);
  return s;
}
KeySpec numeric(ConfigType type, std::string key, std::string def, Range r, std::string doc) {
  KeySpec s = spec(type, std::move(key), std::move(def), std::move(doc));
  s.min = r.min;
  s.max = r.max;
  s.min_exclusive = r.min_exclusive;
  s.max_exclusive = r.max_exclusive;
  return s;
}
// The keys that size tensors or loops of tensors: at most 2^31 - 1 unless their
// range says less, so no product of a few of them overflows int64 before the
// shape checks (core/shape.cpp) and no value is cut when a kernel takes an int.
bool sizes_tensors(const std::string& key) {
  static const std::vector<std::string> train = {"train.batch_size", "train.seq_len", "train.grad_accum",
                                                 "train.eval_batches", "train.sample_tokens", "train.sample_top_k",
                                                 "train.ep", "train.pp", "train.pp_virtual", "train.tp", "train.cp",
                                                 "train.max_steps", "train.warmup_steps"};
  return key.rfind("model.", 0) == 0 || key.rfind("data.synthetic", 0) == 0 ||
         std::find(train.begin(), train.end(), key) != train.end();
}
KeySpec integer(std::string key, std::string def, Range r, std::string doc) {
  if (!r.max && sizes_tensors(key)) r.max = 2147483647.0;
  return numeric(ConfigType::integer, std::move(key), std::move(def), r, std::move(doc));
}
KeySpec number(std::string key, std::string def, Range r, std::string doc) {
  return numeric(ConfigType::number, std::move(key), std::move(def), r, std::move(doc));
}
KeySpec boolean(std::string key, std::string def, std::string doc) {
  return spec(ConfigType::boolean, std::move(key), std::move(def), std::move(doc));
}
KeySpec string(std::string key, std::string def, std::string doc) {
  return spec(ConfigType::string, std::move(key), std::move(def), std::move(doc));
}
KeySpec choice(std::string key, std::string def, std::vector<std::string> choices, std::string doc) {
  KeySpec s = spec(ConfigType::choice, std::move(key), std::move(def), std::move(doc));
  s.choices = std::move(choices);
  return s;
}

std::vector<KeySpec> make_schema() {
  // clang-format off
  return {
    // model: the network. Defaults are GPT-2 small (124M).
    choice ("model.arch",           "gpt2",  {"gpt2", "hybrid"}, "gpt2 = GPT-2 (docs/model.md#gpt-2-block); hybrid = the K3-style decoder of KDA / MLA / attention mixers (docs/model.md#block-attnres to #full-decoder)"),
    integer("model.vocab_size",     "50257", at_least(1),  "rows of the token embedding; must cover every id the tokenizer produces"),
    integer("model.vocab_pad_multiple", "1", at_least(1), "pad the vocabulary to a multiple of this (Megatron's --make-vocab-size-divisible-by; 64 or 128 give the LM head GEMM aligned shapes, 50257 -> 50304): the token embedding (gpt2 wte; hybrid embed_tokens and an untied lm_head) gets the padded number of rows, the padding rows start at 0 and stay there, take no part in the loss, are never sampled and not exported (docs/model.md#padded-vocabulary); 1 = no padding"),
    integer("model.n_layer",        "12",    in(1, 4096),  "number of transformer blocks"),
    integer("model.n_head",         "12",    at_least(1),  "attention heads per block; must divide model.d_model"),
    integer("model.d_model",        "768",   at_least(1),  "width of the residual stream (GPT-2's n_embd); a multiple of model.n_head"),
    integer("model.n_ctx",          "1024",  at_least(1),  "number of learned positions: the longest sequence the model accepts"),
    integer("model.d_ff",           "0",     at_least(0),  "hidden width of the MLP; 0 means 4 * model.d_model"),
    number ("model.layer_norm_eps", "1e-5",  above(0),     "epsilon added to the variance in every LayerNorm"),
    number ("model.dropout",        "0.0",   in_half_open(0, 1), "dropout probability while training; 0 turns dropout off"),
    number ("model.init_std",       "0.02",  above(0),     "standard deviation of the normal weight initialization"),
    string ("model.init_from",      "''",                  "weights to start from: a Hugging Face directory (its config.json, gpt2, kimi_linear or moetrain_hybrid, sets the architecture: docs/export.md), a model directory of moetrain export or <run>/model (any train.ep), or a .safetensors file; empty = random init"),

    // model, hybrid architecture only (model.arch: hybrid; docs/model.md#kda-layer to #configs-and-parameter-counts).
    choice ("model.mixer",          "kda",   {"kda", "mla", "attention", "linear_attention", "deltanet", "gated_deltanet"}, "hybrid: token mixer of the layers not picked for model.attn_mixer; linear_attention, deltanet and gated_deltanet are the lower rungs of the evolution ladder (docs/evolution.md) and use the model.kda.* heads, head dim and kernels"),
    choice ("model.attn_mixer",     "mla",   {"mla", "attention", "kda", "linear_attention", "deltanet", "gated_deltanet"}, "hybrid: mixer of the layers l with l % model.attn_every == model.attn_offset (and the last, with model.attn_last)"),
    integer("model.attn_every",     "4",     at_least(0),  "hybrid: period of the model.attn_mixer layers; 0 = none by period"),
    integer("model.attn_offset",    "3",     at_least(0),  "hybrid: layer index modulo model.attn_every that gets model.attn_mixer (K3: 3)"),
    boolean("model.attn_last",      "true",                "hybrid: the last layer also gets model.attn_mixer (K3)"),
    string ("model.layer_mixers",   "''",                  "hybrid: explicit comma list of mixers, one per layer (e.g. kda,kda,kda,mla; names as model.mixer); overrides the period keys"),
    choice ("model.ffn",            "situ_glu", {"situ_glu", "swiglu", "gelu"}, "hybrid: dense FFN: situ_glu (K3), swiglu (Kimi-Linear) or gelu (no biases); width model.d_ff"),
    number ("model.situ_beta",      "4.0",   above(0),     "SiTU-GLU beta: gate soft cap, a = beta tanh(gate/beta) sigmoid(gate)"),
    number ("model.situ_linear_beta", "25.0", at_least(0), "SiTU-GLU linear beta (lambda): up = lambda tanh(up/lambda); 0 = no cap"),
    boolean("model.situ_learnable_beta", "false",          "SiTU-GLU: learn beta (one scalar per FFN, init model.situ_beta)"),
    boolean("model.attn_res",       "true",                "hybrid: Block Attention Residuals (softmax over depth) instead of the residual stream"),
    integer("model.attn_res_block_size", "12", at_least(1), "hybrid: AttnRes block size S in decoder layers; a block opens at every layer l % S == 0"),
    boolean("model.tie_embeddings", "false",               "hybrid: LM head shares the token embedding (GPT-2 always ties)"),
    number ("model.rms_norm_eps",   "1e-5",  above(0),     "hybrid: epsilon of every RMSNorm (decoder, KDA output, AttnRes keys, final)"),
    number ("model.embed_init_std", "1.0",   above(0),     "hybrid: std of the token embedding init (K3: 1; GPT-2 uses model.init_std)"),
    integer("model.kda.n_head",     "4",     at_least(1),  "KDA: query/key heads H"),
    integer("model.kda.n_value_head", "0",   at_least(0),  "KDA: value heads HV (grouped value heads, a multiple of model.kda.n_head); 0 = model.kda.n_head"),
    integer("model.kda.head_dim",   "64",    at_least(1),  "KDA: head dim K = V"),
    integer("model.kda.conv_size",  "4",     at_least(1),  "KDA: width of the short causal convolutions on q, k, v"),
    choice ("model.kda.gate",       "lower_bound", {"lower_bound", "softplus"}, "KDA decay gate: lower_bound (K3: g = lb sigmoid(e^A (f + dt_bias))) or softplus (Kimi-Linear)"),
    number ("model.kda.lower_bound", "-5.0", in(-1e9, -1e-9), "KDA: lower bound lb of the lower_bound gate (K3: -5)"),
    choice ("model.kda.dt_bias_init", "spread", {"spread", "zero"}, "KDA lower-bound gate init: spread (g = -dt at f = 0, dt ~ logU(1e-3, 1e-1): long memories) or zero (TT-K3: g = lb/2 = -2.5 everywhere); the softplus gate always uses fla's init"),
    boolean("model.kda.full_rank_output_gate", "true",     "KDA: full-rank output gate (K3) instead of low rank (Kimi-Linear)"),
    choice ("model.kda.mode",       "chunked", {"chunked", "recurrent"}, "KDA kernels: chunked (WY/UT, fast) or recurrent (the step-by-step reference)"),
    integer("model.kda.chunk_size", "64",    at_least(1),  "KDA: chunk size C of the chunked kernels"),
    integer("model.mla.n_head",     "4",     at_least(1),  "MLA: heads"),
    integer("model.mla.q_lora_rank", "128",  at_least(0),  "MLA: query LoRA rank r_q; 0 = full-rank query projection"),
    integer("model.mla.kv_lora_rank", "64",  at_least(1),  "MLA: KV latent rank r_kv (the decoding cache holds r_kv + qk_rope_head_dim per token)"),
    integer("model.mla.qk_nope_head_dim", "64", at_least(0), "MLA: per-head query/key dims without position encoding"),
    integer("model.mla.qk_rope_head_dim", "32", at_least(0), "MLA: per-head query dims matched with the shared key slice (rotated only with model.mla.rope)"),
    integer("model.mla.v_head_dim", "64",    at_least(1),  "MLA: per-head value dim"),
    boolean("model.mla.output_gate", "true",               "MLA: sigmoid output gate from the layer input (K3)"),
    boolean("model.mla.rope",       "false",               "MLA: rotate the rope slices (rotate-half RoPE); false = NoPE (Kimi)"),
    number ("model.mla.rope_theta", "10000", above(0),     "MLA: RoPE base"),
    number ("model.mla.lora_norm_eps", "1e-6", above(0),   "MLA: epsilon of the two LoRA RMSNorms"),
    integer("model.moe.num_experts", "0",    at_least(0),  "MoE: routed experts; 0 = dense FFN everywhere"),
    integer("model.moe.top_k",      "8",     at_least(1),  "MoE: experts per token"),
    integer("model.moe.num_shared_experts", "1", at_least(0), "MoE: shared experts (fused into one SiTU-GLU MLP of width expert_d_ff * count)"),
    integer("model.moe.expert_d_ff", "0",    at_least(0),  "MoE: hidden width F of each expert"),
    integer("model.moe.latent_dim", "0",     at_least(0),  "MoE: latent width L of the routed experts (latent MoE); 0 = experts on the full width"),
    boolean("model.moe.latent_norm", "true",               "MoE: RMSNorm of the combined latent expert output"),
    integer("model.moe.first_dense_layers", "1", at_least(0), "MoE: the first layers keep the dense FFN (K3: 1)"),
    choice ("model.moe.router_score", "sigmoid", {"sigmoid", "softmax"}, "MoE router scores: sigmoid (K3, Kimi-Linear) or softmax"),
    boolean("model.moe.renormalize", "true",               "MoE: renormalise the selected scores to sum 1 (top_k > 1)"),
    number ("model.moe.routed_scaling_factor", "1.0", in(1e-9, 1e9), "MoE: scale rho of the routing weights (K3 1.0, Kimi-Linear 2.446)"),
    integer("model.moe.n_group",    "1",     at_least(1),  "MoE: expert groups for group-limited selection (1 = off)"),
    integer("model.moe.topk_group", "1",     at_least(1),  "MoE: groups kept by group-limited selection"),
    number ("model.moe.bias_update_rate", "1.0e-3", in(0, 1e9), "MoE: gamma of the aux-loss-free balancing (router bias += gamma sign(mean - count) per optimizer step); 0 = off"),
    number ("model.moe.aux_loss_weight", "0.0", in(0, 1e9), "MoE: weight alpha of the sequence-wise balance loss (DeepSeek-V3); 0 = off"),
    number ("model.moe.z_loss_weight", "0.0", in(0, 1e9),  "MoE: weight of the router z-loss (mean logsumexp(logits)^2); 0 = off"),
    number ("model.moe.capacity_factor", "0.0", in(0, 1e9), "MoE: 0 = dropless; > 0: each expert takes at most ceil(cf N k / E) assignments per micro-batch (per rank), later tokens' slots dropped"),

    // data: token shards and the tokenizer.
    string ("data.train",           "''",                  "glob of tokenized training shards, e.g. data/shakespeare/train_*.bin"),
    string ("data.val",             "''",                  "glob of tokenized validation shards, e.g. data/shakespeare/val_*.bin"),
    string ("data.tokenizer",       "gpt2",                "gpt2 = GPT-2 byte-level BPE (files in data.tokenizer_dir); byte = one token per byte; or the path of a tokenizer file: a Hugging Face tokenizer.json of the byte-level BPE family, a tiktoken rank file (with <file>.json beside it) or a tiktoken description (docs/training.md#tokenizers)"),
    string ("data.tokenizer_dir",   "data/gpt2",           "directory of the GPT-2 tokenizer files, used when data.tokenizer is gpt2"),
    choice ("data.synthetic",       "none",  {"none", "assoc_recall", "repeated_key", "context_switch"}, "train and evaluate on a seeded synthetic memory task instead of data.train/data.val (data/synthetic.h): the loss and val_acc count the answer positions only; train.seq_len must equal the task's row length"),
    integer("data.synthetic_num_keys", "64", at_least(1),  "synthetic: key vocabulary (model.vocab_size >= 2 + keys + values)"),
    integer("data.synthetic_num_values", "64", at_least(1), "synthetic: value vocabulary"),
    integer("data.synthetic_num_pairs", "16", at_least(1), "synthetic: key-value pairs P per row (per context for context_switch)"),
    integer("data.synthetic_num_queries", "8", at_least(1), "synthetic: queries Q per row; the row length (train.seq_len) is 2P + 2Q - 1 (context_switch: 4P + 2Q)"),
    integer("data.synthetic_num_rebinds", "4", at_least(0), "synthetic: keys bound twice (repeated_key) or again after the switch (context_switch)"),

    // train: optimization, schedule, evaluation, sampling and logging.
    integer("train.seed",           "1337",  at_least(0),  "random seed of initialization, data order and sampling"),
    integer("train.batch_size",     "8",     at_least(1),  "sequences per micro-batch"),
    integer("train.seq_len",        "256",   at_least(1),  "tokens per training sequence; at most model.n_ctx"),
    integer("train.grad_accum",     "1",     at_least(1),  "micro-batches per optimizer step (tokens per step = batch_size * seq_len * grad_accum)"),
    integer("train.max_steps",      "1000",  at_least(0),  "optimizer steps to train for"),
    number ("train.lr",             "6e-4",  above(0),     "peak learning rate, reached at the end of warmup"),
    number ("train.min_lr",         "6e-5",  at_least(0),  "learning rate at the end of the decay; at most train.lr"),
    choice ("train.schedule",       "cosine", {"cosine", "wsd", "linear", "constant"},
                                                           "learning-rate shape after warmup: cosine, wsd (warmup-stable-decay), linear or constant"),
    integer("train.warmup_steps",   "100",   at_least(0),  "steps of linear warmup from 0 to train.lr"),
    number ("train.wsd_decay_frac", "0.2",   in(0, 1),     "wsd schedule: fraction of train.max_steps spent decaying to train.min_lr at the end"),
    number ("train.weight_decay",   "0.1",   at_least(0),  "decoupled weight decay of the weight matrices (AdamW and Muon)"),
    boolean("train.decay_embeddings", "false",             "also apply weight decay to the token and position embeddings"),
    number ("train.beta1",          "0.9",   in_half_open(0, 1), "AdamW decay rate of the first moment"),
    number ("train.beta2",          "0.95",  in_half_open(0, 1), "AdamW decay rate of the second moment"),
    number ("train.eps",            "1e-8",  above(0),     "AdamW epsilon, added to the square root of the second moment"),
    choice ("train.optimizer",      "adamw", {"adamw", "muon"}, "adamw: AdamW on every parameter; muon: Muon on the hidden weight matrices (attention, MLA, KDA and MLP projections, each routed expert's matrices) and AdamW on embeddings, LM head, router gate, norms, biases and vectors, both at train.lr and train.weight_decay (docs/model.md#muon)"),
    number ("train.muon_momentum",  "0.95",  in_half_open(0, 1), "Muon: momentum mu (M = mu M + G)"),
    boolean("train.muon_nesterov",  "true",                "Muon: orthogonalise G + mu M (Nesterov) instead of M"),
    integer("train.muon_ns_steps",  "5",     in(1, 100),   "Muon: Newton-Schulz iterations per step"),
    number ("train.muon_eps",       "1e-7",  above(0),     "Muon: added to the Frobenius norm before normalising the update"),
    boolean("train.qk_clip",        "false",               "QK-Clip (MuonClip, Kimi K2): after each step, scale the query and key weights of every softmax-attention head (MLA, attention, GPT-2) whose largest logit of the step exceeded train.qk_clip_tau, so that it becomes tau (docs/model.md#qk-clip); KDA layers have no softmax"),
    number ("train.qk_clip_tau",    "100",   above(0),     "QK-Clip threshold tau on the pre-softmax logit scale * q.k"),
    number ("train.grad_clip",      "1.0",   at_least(0),  "clip the global gradient norm to this value; 0 = no clipping"),
    integer("train.eval_every",     "100",   at_least(0),  "evaluate the validation loss every N steps; 0 = never"),
    integer("train.eval_batches",   "20",    at_least(1),  "validation batches per evaluation"),
    integer("train.sample_every",   "0",     at_least(0),  "print a generated sample every N steps; 0 = never"),
    integer("train.sample_tokens",  "128",   at_least(1),  "tokens generated per sample"),
    string ("train.sample_prompt",  R"("\n")",             "text that samples continue"),
    number ("train.sample_temperature", "0.8", at_least(0), "sampling temperature; 0 = greedy (always the most likely token)"),
    integer("train.sample_top_k",   "40",    at_least(0),  "sample among the k most likely tokens; 0 = among all tokens"),
    number ("train.peak_tflops",    "0",     at_least(0),  "the per-rank peak (TFLOP/s) the step line's MFU divides model FLOPs by; 0 = measured at start-up: a 1024 x 1024 x 1024 matrix product on the run's device, dtype and threads"),
    integer("train.log_every",      "1",     at_least(1),  "print a step line every N steps"),
    integer("train.threads",        "0",     at_least(0),  "CPU threads per rank; 0 = automatic (cores / ranks on the node)"),
    choice ("train.nan_policy",     "skip", {"skip", "abort"}, "non-finite loss or gradient norm: skip the step on every rank (no update; counted in metrics) or abort (exit 3)"),
    boolean("train.check_update",   "true",                "before each optimizer update, check that it keeps every weight and optimizer state finite (AdamW: a read pass over weights, gradients and moments, about one update's time: bench/ops_bench.cpp BM_adamw_*; Muon: two elementwise passes and the norms, the full update only near overflow); a step that would not is skipped like a non-finite gradient (train.nan_policy)"),
    integer("train.max_consecutive_skips", "5", at_least(0), "train.nan_policy skip: abort (exit 3) after this many skipped steps in a row"),
    integer("train.ep",             "1",     at_least(1),  "expert-parallel ranks: experts sharded over groups of ep ranks (world = pp x dp x ep under mpirun)"),
    integer("train.pp",             "1",     at_least(1),  "pipeline stages: the layers split over pp groups of ranks, 1F1B over train.grad_accum micro-batches (world = pp x dp x ep; model.arch hybrid; docs/parallelism.md#pipeline-parallelism)"),
    integer("train.pp_virtual",     "1",     at_least(1),  "virtual pipeline stages per rank: the layers split over pp x pp_virtual stages, rank r holding r, pp + r, ...; the interleaved 1F1B shrinks the bubble pp_virtual-fold (train.grad_accum a multiple of train.pp; docs/parallelism.md#interleaved-virtual-stages)"),
    integer("train.tp",             "1",     at_least(1),  "tensor parallelism: not implemented; 1 (named so that a layout can be written down; anything else is refused, docs/parallelism.md)"),
    integer("train.cp",             "1",     at_least(1),  "context parallelism: not implemented; 1 (named so that a layout can be written down; anything else is refused, docs/parallelism.md)"),
    number ("train.grad_bucket_mb", "32",    above(0),     "several ranks: the most MiB of gradients one bucket all-reduce carries (a larger grad goes alone); smaller buckets start earlier with train.overlap_grad_sync"),
    boolean("train.overlap_grad_sync", "false",           "several ranks: sum gradient buckets while backward runs (of the last micro-batch) instead of after it; same sums"),
    integer("train.zero",           "0",     at_least(0),  "several ranks: 1 shards the optimizer state (AdamW moments by element ranges, Muon momentum by whole matrices, and bf16 runs' f32 master weights) over the data-parallel replicas of each parameter, gradients reduce-scattered and updated parameters all-gathered (ZeRO stage 1, docs/parallelism.md#distributed-optimizer-trainzero); 0 keeps them whole on every rank"),
    choice ("train.dtype",          "f32",   {"f32", "f64", "bf16"}, "dtype of parameters and activations; f64 for exact checks; bf16: mixed precision, bf16 weights and activations with f32 master weights, AdamW moments, router, norm statistics and KDA state, on CUDA or the CPU (oneDNN bf16 matrix products; docs/cuda.md)"),
    choice ("train.device",         "cpu",   {"cpu", "cuda"}, "where the model trains: cpu, or cuda (the GPU local_rank % GPUs of the node; needs a CUDA build and the model's ops on CUDA)"),
    choice ("train.cuda_graph",     "auto",  {"auto", "on", "off"}, "cuda, one GPU: capture the forward and backward of a step into a CUDA graph after the first step and replay it (one launch a step); auto checks the replay against an eager step and falls back with a warning when it cannot capture or they differ, on makes either an error, off never captures (docs/cuda.md#cuda-graphs)"),
    boolean("train.tf32",           "false", "cuda: f32 matrix products may use TF32 tensor cores (10-bit mantissa products), the chunked KDA's state products included (those also in bf16 runs)"),
    boolean("train.activation_checkpointing", "false",     "recompute each block's activations in backward instead of storing them"),
    string ("train.recompute_modules", "''", "hybrid: selective recomputation, a comma list of act (the SiTU-GLU/SwiGLU output of dense FFNs, shared and routed experts, recomputed with the down-projection) and experts (the routed experts' whole MLPs); docs/training.md#activation-recomputation"),
    boolean("train.profile",        "false", "time each component (mixers, MoE, AttnRes, embedding/head, optimizer, ...) from the second step on and print a table per step at the end"),

    // run: where a run's outputs go.
    string ("run.dir",              "runs/default",        "directory of checkpoints, metrics.jsonl and config.resolved.yaml; one run at a time holds it (a lock)"),
    boolean("run.overwrite",        "false",               "with ckpt.resume none: start over in a run.dir that already holds checkpoints or metrics, deleting them (without it that is an error)"),

    // ckpt: checkpoints of the whole training state (docs/checkpoints.md).
    integer("ckpt.every",           "0",     at_least(0),  "save a checkpoint to <run.dir>/checkpoints every N steps (and at the last step); 0 = never"),
    choice ("ckpt.schedule_change", "refuse", {"refuse", "apply"}, "on resume, when the learning-rate schedule keys changed (train.max_steps, lr, min_lr, warmup_steps, schedule, wsd_decay_frac) so the lr from the resumed step on differs: refuse (exit 2, naming the keys and the lr jump) or apply (continue on the new schedule, logged)"),
    integer("ckpt.keep_last",       "3",     at_least(1),  "committed checkpoints kept; older ones are deleted after a save (never the newest)"),
    boolean("ckpt.async",           "false",               "write checkpoints in a background thread (state copied first); training goes on, exit waits for it"),
    string ("ckpt.resume",          "none",                "none (a fresh run; run.dir must hold no earlier run unless run.overwrite) | auto (the newest complete checkpoint of this run's lineage in run.dir, if any) | step_00000030 (that one; error if it is not complete; an older one than the newest starts a new lineage)"),

    // dist: distributed runs.
    number ("dist.timeout_s",       "600",   at_least(0),  "watchdog: a collective or checkpoint barrier that waits longer ends the job (exit 42) naming rank, step and operation; 0 = off"),

    // fault: injected faults, a testing aid for the fault-handling tests (off by default).
    choice ("fault.kind",           "none", {"none", "nan_grad", "kill", "stop", "kill_during_ckpt", "signal"}, "TESTING AID: inject a fault on rank fault.rank at step fault.step: nan_grad (NaN in one gradient), kill (SIGKILL itself), stop (SIGSTOP itself, a hang), kill_during_ckpt (SIGKILL during the checkpoint save of that step, at fault.phase), signal (fault.signal to itself at fault.signal_at)"),
    choice ("fault.phase",          "before_commit", {"before_commit", "before_rename", "before_latest"}, "TESTING AID: where kill_during_ckpt strikes: before COMMIT is written, between the barrier and the rename, after the rename before `latest`"),
    integer("fault.rank",           "0",     at_least(0),  "TESTING AID: the rank that gets the fault"),
    integer("fault.step",           "0",     at_least(0),  "TESTING AID: the step (1-based) at which the fault happens; 0 = never"),
    choice ("fault.signal",         "TERM", {"TERM", "INT", "HUP", "USR1", "USR2"}, "TESTING AID: the signal of fault.kind signal"),
    choice ("fault.signal_at",      "step", {"startup", "step", "save"}, "TESTING AID: when fault.kind signal strikes: during start-up (before step 1), at the start of step fault.step, or inside the checkpoint save of step fault.step once this rank's file is written"),
    integer("fault.signal_count",   "1",     in(1, 10),    "TESTING AID: how many times fault.kind signal sends the signal at that point"),
  };
  // clang-format on
}

}  // namespace

const std::vector<KeySpec>& config_schema() {
  static const std::vector<KeySpec> schema = make_schema();
  return schema;
}

const KeySpec* find_key_spec(const std::string& key) {
  static const std::unordered_map<std::string, const KeySpec*> index = [] {
    std::unordered_map<std::string, const KeySpec*> m;
    for (const KeySpec& s : config_schema()) m.emplace(s.key, &s);
    return m;
  }();
  auto it = index.find(key);
  return it == index.end() ? nullptr : it->second;
}

const char* config_type_name(ConfigType type) {
  switch (type) {
    case ConfigType::integer: return "integer";
    case ConfigType::number: return "number";
    case ConfigType::boolean: return "boolean";
    case ConfigType::string: return "string";
    case ConfigType::choice: return "choice";
  }
  return "?";
}

std::string allowed_values_text(const KeySpec& spec) {
  if (spec.type == ConfigType::choice) return fmt::format("one of {}", fmt::join(spec.choices, ", "));
  if (spec.min && spec.max)
    return fmt::format("{}{}, {}{}", spec.min_exclusive ? "(" : "[", *spec.min, *spec.max,
                       spec.max_exclusive ? ")" : "]");
  if (spec.min) return fmt::format("{} {}", spec.min_exclusive ? ">" : ">=", *spec.min);
  if (spec.max) return fmt::format("{} {}", spec.max_exclusive ? "<" : "<=", *spec.max);
  return "";
}

}  // namespace moetrain
