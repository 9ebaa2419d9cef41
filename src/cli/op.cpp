// `moetrain op NAME --in IN.h5 --out OUT.h5 [--group G] [--mode recurrent|chunked]
//  [--chunk-size C] [--device cpu|cuda]`: runs one op or layer on inputs read from an
// HDF5 group and writes its outputs and vector-Jacobian products, so our kernels can
// be checked against another implementation (docs/op.md; fixtures:
// tests/reference/k3_reference.py).
//
// Conventions (docs/op.md has the table):
//   - inputs are datasets of the group named as the op's arguments in docs/model.md
//     (kda: q k v g beta [h0]); layer weights sit in the subgroup params/ under their
//     Hugging Face names; hyper-parameters are attributes of the group;
//   - the upstream gradient of output X is dataset dX of the group; an absent one
//     counts as zeros; with none at all only the outputs are written;
//   - the output file holds one group of the input group's name ("/" by default):
//     the outputs X, the input gradients d<input>, the parameter gradients under
//     grad/<name> (each in the shape it was given), and attributes op, dtype (and
//     mode, chunk_size for the KDA ops); some outputs are values only (latent_moe's
//     topk_idx, an i64 dataset, and topk_weight): no upstream gradient is read for them;
//   - buffers (the router bias) are read from params/ but get no gradient;
//   - muon and qk_clip are updates, not functions to differentiate: their inputs get no
//     gradient and their outputs (muon: param, momentum; qk_clip: params/..., gamma) are
//     values; attention and mla also write the value max_logit [H] (QK-Clip's statistic);
//   - all float inputs share one dtype (f32 or f64), which is the compute dtype.
// Errors name the input file, the group and the dataset or attribute; exit code 2.
// --out must be a new path or a regular file other than --in (io/paths.h).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "autograd/engine.h"
#include "backend/cpu/allocator.h"
#include "backend/cuda/runtime.h"
#include "cli/commands.h"
#include "core/format.h"
#include "io/hdf5.h"
#include "io/paths.h"
#include "nn/gpt2.h"
#include "nn/hybrid_hf.h"
#include "nn/kda_layer.h"
#include "nn/language_model.h"
#include "nn/mla.h"
#include "nn/moe.h"
#include "ops/attention/attention.h"
#include "ops/attnres/attnres.h"
#include "ops/elementwise/elementwise.h"
#include "ops/kda/kda.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/situ/situ.h"
#include "ops/view/view.h"
#include "optim/muon.h"
#include "optim/qk_clip.h"

namespace moetrain::cli {

namespace {

// Errors raised by our own input checks: already say file, group and dataset.
class OpInputError : public Error {
 public:
  using Error::Error;
};

struct Named {
  std::string name;
  Tensor tensor;
};

// What an op may hold while it runs, against its inputs' bytes: inputs, outputs,
// gradients and the kernels' scratch (the chunked KDA's per-chunk states the most).
constexpr int kOpWorkFactor = 8;

// Half this machine's memory, or MOETRAIN_OP_MEMORY_MB.
double op_memory_budget() {
  if (const char* v = std::getenv("MOETRAIN_OP_MEMORY_MB"); v && *v) {
    char* end = nullptr;
    const double mb = std::strtod(v, &end);
    MT_CHECK(*end == '\0' && mb > 0, "MOETRAIN_OP_MEMORY_MB={} is not a positive number of MiB", v);
    return mb * (1 << 20);
  }
  return 0.5 * cpu::host_memory_bytes();
}

// One run of one op: the input file and group, and what the op read and produced.
class OpRun {
 public:
  OpRun(const hdf5::Reader& in, std::string group, std::string op, KdaMode mode, int64_t chunk_size, Device device)
      : mode(mode), chunk_size(chunk_size), device(device), in_(in), group_(hdf5::normalize_group(group)),
        op_(std::move(op)) {}

  const std::string& group() const { return group_; }
  const std::string& op() const { return op_; }
  const hdf5::Reader& reader() const { return in_; }
  DType dtype() const { return dtype_; }

  // "in.h5:/kda/q"
  std::string where(const std::string& name) const { return in_.path() + ":" + hdf5::join(group_, name); }
  std::string where_group() const { return in_.path() + ":" + group_; }

  template <class... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) const {
    throw OpInputError(fmt::format("op {}: {}", op_, fmt::format(f, std::forward<Args>(args)...)));
  }

  bool has_input(const std::string& name) const { return in_.has_dataset(group_, name); }
  bool has_param(const std::string& name) const { return in_.has_dataset(params_group(), name); }

  // A differentiable input (its gradient is written as d<name>).
  Tensor input(const std::string& name, int rank) { return take(group_, name, rank, inputs_); }
  Tensor optional_input(const std::string& name, int rank) {
    return has_input(name) ? input(name, rank) : Tensor();
  }
  // A layer weight from params/ (its gradient is written as grad/<name>). rank 0: any.
  Tensor param(const std::string& name, int rank) { return take(params_group(), name, rank, params_); }
  // A buffer from params/: state of the layer that is not trained (no gradient).
  // Also the weights the ops without gradients (qk_clip) rewrite.
  Tensor buffer(const std::string& name, int rank) {
    Tensor t = read_checked(params_group(), name);
    if (rank > 0 && t.dim() != rank) fail("{} is {}; expected rank {}", where("params/" + name), t.shape(), rank);
    if (!device.is_cpu()) t = t.to(device);
    buffers_.push_back({name, t});
    return t;
  }
  // An input of the group that gets no gradient (the ops without gradients: muon's
  // param, grad, momentum; qk_clip's max_logit). rank 0: any.
  Tensor state(const std::string& name, int rank) {
    Tensor t = read_checked(group_, name);
    if (rank > 0 && t.dim() != rank) fail("{} is {}; expected rank {}", where(name), t.shape(), rank);
    if (!device.is_cpu()) t = t.to(device);
    states_.push_back({name, t});
    return t;
  }
  void expect(const std::string& name, const Tensor& t, const Shape& shape, const std::string& letters) const {
    if (t.shape() != shape) fail("{} is {}; expected {} = {}", where(name), t.shape(), letters, shape);
  }

  double attr(const std::string& name, double fallback) const {
    used_attrs_.insert(name);
    return in_.attr_double(group_, name).value_or(fallback);
  }
  std::optional<double> optional_attr(const std::string& name) const {
    used_attrs_.insert(name);
    return in_.attr_double(group_, name);
  }
  std::optional<int64_t> int_attr(const std::string& name) const {
    used_attrs_.insert(name);
    return in_.attr_int(group_, name);
  }
  std::optional<bool> bool_attr(const std::string& name) const {
    used_attrs_.insert(name);
    return in_.attr_bool(group_, name);
  }
  std::string string_attr(const std::string& name, const std::string& fallback) const {
    used_attrs_.insert(name);
    return in_.attr_string(group_, name).value_or(fallback);
  }
  // An attribute the shapes also determine: must agree when given.
  void check_attr(const std::string& name, int64_t from_shapes, const std::string& how) const {
    std::optional<int64_t> a = int_attr(name);
    if (a && *a != from_shapes)
      fail("attribute {} of {} is {} but the shapes give {} ({})", name, where_group(), *a, from_shapes, how);
  }
  // gate_mode: softplus (Kimi-Linear) or lowerbound (K3, the default).
  KdaGate gate_mode() const {
    std::string g = string_attr("gate_mode", "lowerbound");
    if (g == "softplus") return KdaGate::softplus;
    if (g == "lowerbound" || g == "lower_bound") return KdaGate::lower_bound;
    fail("attribute gate_mode of {} is \"{}\"; expected \"softplus\" or \"lowerbound\"", where_group(), g);
  }

  void output(const std::string& name, const Tensor& t) { outputs_.push_back({name, t}); }
  // An output written as it is, without an upstream gradient (indices, routing weights).
  void value(const std::string& name, const Tensor& t) { values_.push_back({name, t}); }

  const std::vector<Named>& inputs() const { return inputs_; }
  const std::vector<Named>& params() const { return params_; }
  const std::vector<Named>& outputs() const { return outputs_; }
  const std::vector<Named>& values() const { return values_; }
  std::string params_group() const { return hdf5::join(group_, "params"); }
  // Attributes of the group the op did not ask for (typos such as gate_mod).
  std::vector<std::string> unused_attributes() const {
    std::vector<std::string> out;
    for (const std::string& a : in_.attributes(group_))
      if (!used_attrs_.count(a)) out.push_back(a);
    return out;
  }
  // Datasets of the group (and params/) the op did not read, other than upstream gradients.
  std::vector<std::string> unused() const {
    std::set<std::string> known;
    for (const Named& n : inputs_) known.insert(n.name);
    for (const Named& n : states_) known.insert(n.name);
    for (const Named& n : outputs_) known.insert("d" + n.name);
    std::vector<std::string> out;
    for (const std::string& d : in_.datasets(group_))
      if (!known.count(d)) out.push_back(d);
    std::set<std::string> known_params;
    for (const Named& n : params_) known_params.insert(n.name);
    for (const Named& n : buffers_) known_params.insert(n.name);
    if (in_.has_group(params_group()))
      for (const std::string& d : in_.datasets(params_group()))
        if (!known_params.count(d)) out.push_back("params/" + d);
    return out;
  }

  const KdaMode mode;
  const int64_t chunk_size;
  const Device device;

 private:
  Tensor read_checked(const std::string& group, const std::string& name) {
    Tensor t;
    try {
      // The size first: a small file can declare datasets of any size (HDF5 fills
      // them on read), and the op's outputs, gradients and scratch grow with them.
      const Shape shape = in_.shape(group, name);
      read_bytes_ += shape.numel() * 8;  // at most f64
      const double budget = op_memory_budget();
      if (static_cast<double>(read_bytes_) * kOpWorkFactor > budget)
        fail("{}:{} is {} ({} as f64); with the inputs before it ({} in all) the op would need about {}x that, more "
             "than the budget of {} (half this machine's memory; MOETRAIN_OP_MEMORY_MB sets another)", in_.path(),
             hdf5::join(group, name), shape, human_bytes(static_cast<double>(shape.numel()) * 8),
             human_bytes(static_cast<double>(read_bytes_)), kOpWorkFactor, human_bytes(budget));
      t = in_.read(group, name);
    } catch (const OpInputError&) {
      throw;
    } catch (const Error& e) {
      throw OpInputError(fmt::format("op {}: {}", op_, e.what()));
    }
    if (t.dtype() != DType::f32 && t.dtype() != DType::f64)
      fail("{}:{} is {}; inputs are f32 or f64", in_.path(), hdf5::join(group, name), t.dtype());
    if (first_.empty()) {
      first_ = hdf5::join(group, name);
      dtype_ = t.dtype();
    } else if (t.dtype() != dtype_) {
      fail("{}:{} is {} but {} is {}; all inputs must share one dtype (f32 or f64)", in_.path(),
           hdf5::join(group, name), t.dtype(), first_, dtype_);
    }
    return t;
  }
  Tensor keep(const std::string& name, Tensor t, std::vector<Named>& list) {
    if (!device.is_cpu()) t = t.to(device);
    t.set_requires_grad(true);
    list.push_back({name, t});
    return t;
  }
  Tensor take(const std::string& group, const std::string& name, int rank, std::vector<Named>& list) {
    Tensor t = read_checked(group, name);
    if (rank > 0 && t.dim() != rank) {
      std::string rel = group == group_ ? name : "params/" + name;
      fail("{} is {}; expected rank {}", where(rel), t.shape(), rank);
    }
    return keep(name, t, list);
  }

  const hdf5::Reader& in_;
  int64_t read_bytes_ = 0;  // of the inputs so far, counted as f64
  std::string group_, op_;
  std::string first_;  // the first dataset read: fixes the dtype
  DType dtype_ = DType::f64;
  std::vector<Named> inputs_, params_, buffers_, states_, outputs_, values_;
  mutable std::set<std::string> used_attrs_;
};

double inv_sqrt(int64_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); }

// A layer's params/ group as the HF adapter reads weights (nn/hybrid_hf.h): parameters
// become inputs of the graph (their gradients written under grad/), buffers do not.
class OpParams : public HfTensorSource {
 public:
  OpParams(OpRun& r, const hdf5::Reader& in) : r_(r), in_(in) {}
  std::vector<std::string> names() const override {
    return in_.has_group(r_.params_group()) ? in_.datasets(r_.params_group()) : std::vector<std::string>{};
  }
  std::optional<Shape> shape(const std::string& name) const override {
    if (!r_.has_param(name)) return std::nullopt;
    return in_.shape(r_.params_group(), name);
  }
  Tensor read(const std::string& name) const override { return r_.param(name, 0); }
  Tensor read_buffer(const std::string& name) const override { return r_.buffer(name, 0); }
  std::string where(const std::string& name) const override {
    return r_.where(name.empty() ? "params" : "params/" + name);
  }

 private:
  OpRun& r_;
  const hdf5::Reader& in_;
};

// --- the ops -----------------------------------------------------------------------

// kda: q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K]; beta [B,T,HV]; h0 [B,HV,K,V] (optional).
void run_kda(OpRun& r) {
  Tensor q = r.input("q", 4), k = r.input("k", 4), v = r.input("v", 4), g = r.input("g", 4), beta = r.input("beta", 3);
  Tensor h0 = r.optional_input("h0", 4);
  const double scale = r.attr("scale", inv_sqrt(q.size(3)));
  KdaResult out = kda(q, k, v, g, beta, h0, scale, r.mode, r.chunk_size);
  r.output("o", out.o);
  r.output("ht", out.final_state);
}

// kda_fused: the pre-processing of docs/model.md#kda-layer around the KDA core: l2norm(q_raw), l2norm(k_raw),
// g = gate(f_raw; A_log, dt_bias), beta = σ(beta_raw).
void run_kda_fused(OpRun& r) {
  Tensor q_raw = r.input("q_raw", 4), k_raw = r.input("k_raw", 4), v = r.input("v", 4), f_raw = r.input("f_raw", 4);
  Tensor beta_raw = r.input("beta_raw", 3), A_log = r.input("A_log", 1), dt_bias = r.input("dt_bias", 0);
  Tensor h0 = r.optional_input("h0", 4);
  const int64_t HV = f_raw.size(2), K = f_raw.size(3);
  r.expect("A_log", A_log, Shape{HV}, "[HV] (HV from f_raw [B, T, HV, K])");
  if (dt_bias.shape() != Shape{HV * K} && dt_bias.shape() != Shape{HV, K})
    r.fail("{} is {}; expected [HV * K] = [{}] or [HV, K] (f_raw is {})", r.where("dt_bias"), dt_bias.shape(), HV * K,
           f_raw.shape());
  const KdaGate gate = r.gate_mode();
  const double lb = r.attr("lower_bound", -5.0), l2eps = r.attr("l2norm_eps", 1e-6);
  Tensor g = kda_gate(f_raw, A_log, reshape(dt_bias, {HV * K}), gate, lb);
  const double scale = r.attr("scale", inv_sqrt(q_raw.size(3)));
  KdaResult out = kda(l2_norm(q_raw, l2eps), l2_norm(k_raw, l2eps), v, g, sigmoid(beta_raw), h0, scale, r.mode,
                      r.chunk_size);
  r.output("o", out.o);
  r.output("ht", out.final_state);
}

// attention: causal softmax attention, q, k [B,T,H,Dk], v [B,T,H,Dv]; also max_logit [H], the
// kernel's largest logit per head (QK-Clip's statistic, docs/model.md#qk-clip; a value, no gradient).
void run_attention(OpRun& r) {
  Tensor q = r.input("q", 4), k = r.input("k", 4), v = r.input("v", 4);
  const double scale = r.attr("scale", inv_sqrt(q.size(3)));
  Tensor max_logit;
  r.output("out", causal_attention(q, k, v, scale, &max_logit));
  r.value("max_logit", max_logit);
}

// attnres: sources = the n completed blocks (block_residual [n, ..., D]) then the partial block (prefix_sum [..., D]).
void run_attnres(OpRun& r) {
  Tensor p = r.input("prefix_sum", 0), blocks = r.input("block_residual", 0);
  Tensor proj = r.input("proj", 0), norm = r.input("norm", 0);
  if (p.dim() < 1) r.fail("{} is a scalar; expected [..., D]", r.where("prefix_sum"));
  const int64_t D = p.size(-1), n = blocks.dim() >= 1 ? blocks.size(0) : 0;
  std::vector<int64_t> block_shape{n};
  for (int i = 0; i < p.dim(); ++i) block_shape.push_back(p.size(i));
  r.expect("block_residual", blocks, Shape(block_shape), "[n, ...prefix_sum's shape]");
  if (proj.shape() != Shape{D} && proj.shape() != Shape{1, D})
    r.fail("{} is {}; expected [D] = [{}] or [1, D] (nn.Linear(D, 1))", r.where("proj"), proj.shape(), D);
  r.expect("norm", norm, Shape{D}, "[D]");
  Tensors sources;
  for (int64_t i = 0; i < n; ++i) sources.push_back(reshape(slice(blocks, 0, i, i + 1), p.shape()));
  sources.push_back(p);
  r.output("out", attn_res(sources, reshape(proj, {D}), norm, r.attr("eps", 1e-5)));
}

// situ_glu: out = β tanh(gate/β) σ(gate) ⊙ λ tanh(up/λ); λ only when linear_beta is set.
// β: attribute `beta` (default 4.0), or a learnable one-element dataset `beta`.
void run_situ_glu(OpRun& r) {
  Tensor gate = r.input("gate", 0), up = r.input("up", 0);
  r.expect("up", up, gate.shape(), "the shape of gate");
  std::optional<double> lin = r.optional_attr("linear_beta");
  if (r.has_input("beta")) {
    Tensor beta = r.input("beta", 0);
    if (beta.numel() != 1) r.fail("{} is {}; a learnable beta has one element", r.where("beta"), beta.shape());
    r.output("out", situ_glu(gate, up, beta, lin));
  } else {
    r.output("out", situ_glu(gate, up, r.attr("beta", 4.0), lin));
  }
}

// kda_layer: x [B,T,D] and the KimiDeltaAttention weights (docs/model.md#kda-layer) under params/.
void run_kda_layer(OpRun& r) {
  Tensor x = r.input("x", 3);
  OpParams params(r, r.reader());
  KdaLayerConfig c;
  c.gate = r.gate_mode();
  c.lower_bound = r.attr("lower_bound", -5.0);
  c.l2norm_eps = r.attr("l2norm_eps", 1e-6);
  c.norm_eps = r.attr("o_norm_eps", 1e-5);
  c.chunked = r.mode == KdaMode::chunked;
  c.chunk_size = r.chunk_size;
  c = hf_kda_layer_config(params, x.size(2), c);
  r.check_attr("H", c.n_head, "q_proj rows / K");
  r.check_attr("conv_size", c.conv_size, "q_conv1d.weight's last dim");
  if (std::optional<bool> full = r.bool_attr("full_rank_output_gate"); full && *full != c.full_rank_output_gate)
    r.fail("attribute full_rank_output_gate of {} is {} but params/ {}", r.where_group(), *full,
           c.full_rank_output_gate ? "holds g_proj.weight" : "has no g_proj.weight (expected it, or g_a_proj/g_b_proj)");
  ParamFactory bound(hf_layer_supplier(params, /*moe=*/false), x.dtype());
  r.output("y", KdaLayer(c, bound, "").forward(x));
}

// gpt2_block: one HF GPT2Block (docs/model.md#gpt-2-block) on x [B,T,D], Conv1D weights [in, out].
// The model's own block function (nn/gpt2.h), dropout 0.
void run_gpt2_block(OpRun& r) {
  Tensor x = r.input("x", 3);
  const int64_t D = x.size(2);
  std::optional<int64_t> H_attr = r.int_attr("H");
  if (!H_attr) r.fail("{} has no attribute H (the number of heads; shapes do not say it)", r.where_group());
  const int64_t H = *H_attr;
  if (H < 1 || D % H != 0) r.fail("attribute H of {} is {}; it must divide D = {}", r.where_group(), H, D);
  const double eps = r.attr("ln_eps", 1e-5);
  auto vec = [&](const std::string& name, int64_t n) {
    Tensor t = r.param(name, 1);
    r.expect("params/" + name, t, Shape{n}, fmt::format("[{}]", n));
    return t;
  };
  auto conv1d = [&](const std::string& name, int64_t in, int64_t out) {  // Conv1D [in, out] -> nn.Linear [out, in]
    Tensor t = r.param(name, 2);
    r.expect("params/" + name, t, Shape{in, out}, "Conv1D [in, out]");
    return transpose(t, 0, 1);
  };
  Gpt2BlockWeights w;
  w.ln1_w = vec("ln_1.weight", D), w.ln1_b = vec("ln_1.bias", D);
  w.attn_w = conv1d("attn.c_attn.weight", D, 3 * D), w.attn_b = vec("attn.c_attn.bias", 3 * D);
  w.attn_proj_w = conv1d("attn.c_proj.weight", D, D), w.attn_proj_b = vec("attn.c_proj.bias", D);
  w.ln2_w = vec("ln_2.weight", D), w.ln2_b = vec("ln_2.bias", D);
  Tensor fc_raw = r.param("mlp.c_fc.weight", 2);
  const int64_t F = fc_raw.size(1);
  r.expect("params/mlp.c_fc.weight", fc_raw, Shape{D, F}, "Conv1D [D, F]");
  w.fc_w = transpose(fc_raw, 0, 1), w.fc_b = vec("mlp.c_fc.bias", F);
  w.mlp_proj_w = conv1d("mlp.c_proj.weight", F, D), w.mlp_proj_b = vec("mlp.c_proj.bias", D);
  r.output("y", gpt2_block(w, x, H, eps, 0.0));
}

// mla: x [B,T,D] and the KimiMLAAttention weights (docs/model.md#gated-mla) under params/; attribute H.
void run_mla(OpRun& r) {
  Tensor x = r.input("x", 3);
  std::optional<int64_t> H = r.int_attr("H");
  if (!H) r.fail("{} has no attribute H (the number of heads; shapes do not say it)", r.where_group());
  if (*H < 1) r.fail("attribute H of {} is {}; expected >= 1", r.where_group(), *H);
  OpParams params(r, r.reader());
  MlaConfig c;
  c.n_head = *H;
  c.lora_norm_eps = r.attr("eps", 1e-6);
  c.rope = r.bool_attr("rope").value_or(false);
  c.rope_theta = r.attr("rope_theta", 10000.0);
  c = hf_mla_config(params, x.size(2), c);
  ParamFactory bound(hf_layer_supplier(params, /*moe=*/false), x.dtype());
  MlaLayer layer(c, bound, "");
  QkClipSite site;  // the layer records its heads' max logits here, as in training (nn/language_model.h)
  site.n_head = c.n_head;
  layer.record_max_logits(&site);
  r.output("y", layer.forward(x));
  r.value("max_logit", site.max_logit);
}

// muon: one Muon step (docs/model.md#muon, optim/muon.h muon_update) on param [A,B] or [E,A,B]
// with grad and momentum (absent: zeros); attributes lr (required), weight_decay, momentum,
// nesterov (0/1), ns_steps, eps (MuonOptions' defaults). Writes param and momentum; no gradients.
void run_muon(OpRun& r) {
  Tensor param = r.state("param", 0);
  if (param.dim() != 2 && param.dim() != 3)
    r.fail("{} is {}; expected a matrix [A, B] or a batch of matrices [E, A, B]", r.where("param"), param.shape());
  Tensor grad = r.state("grad", 0);
  r.expect("grad", grad, param.shape(), "param's shape");
  Tensor momentum = r.has_input("momentum") ? r.state("momentum", 0) : zeros_like(param);
  r.expect("momentum", momentum, param.shape(), "param's shape");
  const std::optional<double> lr = r.optional_attr("lr");
  if (!lr) r.fail("{} has no attribute lr (the learning rate)", r.where_group());
  if (!std::isfinite(*lr) || *lr < 0)
    r.fail("attribute lr of {} is {}; expected a finite learning rate >= 0", r.where_group(), *lr);
  MuonOptions o;
  o.weight_decay = r.attr("weight_decay", o.weight_decay);
  o.momentum = r.attr("momentum", o.momentum);
  o.nesterov = r.bool_attr("nesterov").value_or(o.nesterov);
  o.ns_steps = r.int_attr("ns_steps").value_or(o.ns_steps);
  o.eps = r.attr("eps", o.eps);
  try {
    validate(o);
  } catch (const Error& e) {
    r.fail("the attributes of {} (weight_decay, momentum, ns_steps, eps): {}", r.where_group(), e.what());
  }
  muon_update(param, grad, momentum, *lr, o);  // in place
  r.value("param", param);
  r.value("momentum", momentum);
}

// qk_clip: QK-Clip of one MLA layer (docs/model.md#qk-clip, optim/qk_clip.h qk_clip_mla_):
// params/q_b_proj.weight (or q_proj.weight without query LoRA) [H(dn+dr), .] and
// params/kv_b_proj.weight [H(dn+dv), r_kv] in moetrain's [out, in] layout (= Hugging Face's
// nn.Linear), max_logit [H]; attributes H, tau (100), qk_rope_head_dim (dn and dv follow
// from the shapes; qk_nope_head_dim and v_head_dim are checked when given). Writes the
// clipped weights under params/ and gamma [H]; no gradients.
void run_qk_clip(OpRun& r) {
  std::optional<int64_t> H = r.int_attr("H");
  if (!H) r.fail("{} has no attribute H (the number of heads; shapes do not say it)", r.where_group());
  if (*H < 1) r.fail("attribute H of {} is {}; expected >= 1", r.where_group(), *H);
  const std::string kind = r.string_attr("kind", "mla");
  if (kind != "mla")
    r.fail("attribute kind of {} is \"{}\"; op qk_clip clips MLA layers (kind \"mla\") only", r.where_group(), kind);
  const double tau = r.attr("tau", 100.0);
  if (!std::isfinite(tau) || tau <= 0)
    r.fail("attribute tau of {} is {}; expected a finite threshold > 0", r.where_group(), tau);
  Tensor max_logit = r.state("max_logit", 1);
  r.expect("max_logit", max_logit, Shape{*H}, "[H]");
  const bool lora = r.has_param("q_b_proj.weight");
  if (lora && r.has_param("q_proj.weight"))
    r.fail("{} holds both q_b_proj.weight (query LoRA) and q_proj.weight; give one", r.where("params"));
  const std::string q_name = lora ? "q_b_proj.weight" : "q_proj.weight";
  if (!r.has_param(q_name))
    r.fail("{} has neither q_b_proj.weight nor q_proj.weight (the query weight)", r.where("params"));
  if (!r.has_param("kv_b_proj.weight")) r.fail("{} is missing", r.where("params/kv_b_proj.weight"));
  Tensor wq = r.buffer(q_name, 2), wkv = r.buffer("kv_b_proj.weight", 2);
  std::optional<int64_t> dr = r.int_attr("qk_rope_head_dim");
  if (!dr) r.fail("{} has no attribute qk_rope_head_dim (the shapes give only dn + dr)", r.where_group());
  if (*dr < 0 || wq.size(0) % *H != 0 || wq.size(0) / *H < *dr)
    r.fail("{} is {}; expected [H*(dn+dr), .] with H = {}, qk_rope_head_dim = {}", r.where("params/" + q_name),
           wq.shape(), *H, *dr);
  MlaHeadDims dims{*H, wq.size(0) / *H - *dr, *dr, 0};
  if (wkv.size(0) % *H != 0 || wkv.size(0) / *H < dims.qk_nope_head_dim)
    r.fail("{} is {}; expected [H*(dn+dv), r_kv] with H = {}, dn = {}", r.where("params/kv_b_proj.weight"),
           wkv.shape(), *H, dims.qk_nope_head_dim);
  dims.v_head_dim = wkv.size(0) / *H - dims.qk_nope_head_dim;
  r.check_attr("qk_nope_head_dim", dims.qk_nope_head_dim, "query rows / H - qk_rope_head_dim");
  r.check_attr("v_head_dim", dims.v_head_dim, "kv_b_proj.weight rows / H - qk_nope_head_dim");
  const std::vector<double> gamma = qk_clip_factors(max_logit, tau);
  qk_clip_mla_(wq, wkv, gamma, dims);  // in place
  r.value("params/" + q_name, wq);
  r.value("params/kv_b_proj.weight", wkv);
  r.value("gamma", from_vector(gamma, Shape{*H}, r.dtype()));
}

// latent_moe: x [N, D] or [B, T, D] through the model's own MoeLayer (docs/model.md#moe-router
// router, docs/model.md#moe-experts latent routed experts + shared experts), weights under HF names. The
// per-expert weights experts.{j}.w1/w3/w2.weight are stacked into the layer's
// [E, F, W] tensors by a differentiable concat, so each gets its own gradient; the
// router bias is a buffer (selection only, no gradient). Without the three latent
// weights the experts work on x (plain MoE); without shared_experts.* there is none.
// Also writes the router's choice: topk_idx [N, k] (i64, descending biased score,
// ties lower index first) and topk_weight [N, k] (values only, no upstream gradient).
void run_latent_moe(OpRun& r) {
  Tensor x = r.input("x", 0);
  if (x.dim() != 2 && x.dim() != 3) r.fail("{} is {}; expected [N, D] or [B, T, D]", r.where("x"), x.shape());
  const int64_t D = x.size(-1), N = x.numel() / D;
  std::optional<int64_t> k = r.int_attr("top_k");
  if (!k) r.fail("{} has no attribute top_k (experts per token; shapes do not say it)", r.where_group());
  OpParams params(r, r.reader());
  MoeConfig c;
  c.top_k = *k;
  c.routed_scaling_factor = r.attr("routed_scaling_factor", 1.0);
  const std::string score = r.string_attr("router_score", "sigmoid");
  if (score != "sigmoid" && score != "softmax")
    r.fail("attribute router_score of {} is \"{}\"; expected \"sigmoid\" or \"softmax\"", r.where_group(), score);
  c.score = parse_router_score(score);
  c.renormalize = r.bool_attr("renormalize").value_or(true);
  c.bias_update_rate = 0;
  c = hf_moe_config(params, D, c);
  if (c.latent_dim > 0) c.latent_norm_eps = r.attr("eps", 1e-5);  // a plain MoE has no latent norm
  r.check_attr("num_experts", c.num_experts, "gate.weight rows");
  r.check_attr("num_shared_experts", c.num_shared_experts, "shared_experts.gate_proj.weight rows / F");
  FfnConfig ffn;
  const std::string act = r.string_attr("activation", "situ_glu");
  if (act == "situ_glu") {
    ffn.kind = FfnKind::situ_glu;
    ffn.situ_beta = r.attr("beta", 4.0);
    const std::optional<double> lin = r.optional_attr("linear_beta");  // absent: no cap on `up`
    if (ffn.situ_beta <= 0 || (lin && *lin <= 0))
      r.fail("{}: attributes beta = {} and linear_beta = {} must be > 0 (linear_beta may be absent)", r.where_group(),
             ffn.situ_beta, lin ? fmt::format("{}", *lin) : "absent");
    ffn.situ_linear_beta = lin.value_or(0.0);
  } else if (act == "swiglu") {
    ffn.kind = FfnKind::swiglu;
  } else {
    r.fail("attribute activation of {} is \"{}\"; expected \"situ_glu\" (K3) or \"swiglu\" (Kimi-Linear)",
           r.where_group(), act);
  }
  ParamFactory bound(hf_layer_supplier(params, /*moe=*/true), x.dtype());
  MoeLayer layer(c, D, ffn, 0.02, bound, "");
  Routing routing;
  Tensor y = layer.forward(reshape(x, {x.dim() == 3 ? x.size(0) : 1, x.dim() == 3 ? x.size(1) : N, D}),
                           /*training=*/false, &routing);
  r.output("y", reshape(y, x.shape()));
  Tensor idx = empty({N, c.top_k}, DType::i64);
  std::copy(routing.experts.begin(), routing.experts.end(), idx.data<int64_t>());
  r.value("topk_idx", idx);
  r.value("topk_weight", routing.weights);
}

struct OpEntry {
  const char* name;
  bool kda_mode;  // uses --mode / --chunk-size
  void (*run)(OpRun&);
};
constexpr OpEntry kOps[] = {
    {"kda", true, run_kda},
    {"kda_fused", true, run_kda_fused},
    {"attention", false, run_attention},
    {"attnres", false, run_attnres},
    {"situ_glu", false, run_situ_glu},
    {"kda_layer", true, run_kda_layer},
    {"gpt2_block", false, run_gpt2_block},
    {"mla", false, run_mla},
    {"latent_moe", false, run_latent_moe},
    {"muon", false, run_muon},
    {"qk_clip", false, run_qk_clip},
};

std::string op_names() {
  std::string s;
  for (const OpEntry& e : kOps) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

struct Options {
  std::string op, in, out, group = "/", mode = "chunked", device = "cpu";
  int64_t chunk_size = 64;
};

int run_op(const Options& o) {
  const OpEntry* entry = nullptr;
  for (const OpEntry& e : kOps)
    if (o.op == e.name) entry = &e;
  MT_CHECK(entry, "op: unknown op '{}' (inputs {}); expected one of {}", o.op, o.in, op_names());
  const KdaMode mode = parse_kda_mode(o.mode);
  MT_CHECK(o.chunk_size >= 1, "op: --chunk-size {}; expected >= 1", o.chunk_size);
  Device device = kCpu;
  if (o.device == "cuda") {
    MT_CHECK(cuda::built_with_cuda(),
             "op: --device cuda, but this build has no CUDA backend (configure with -DMOETRAIN_CUDA=ON on a machine "
             "with the CUDA toolkit), or use --device cpu");
    MT_CHECK(cuda::device_count() > 0, "op: --device cuda, but no CUDA device is visible (moetrain info lists them)");
    device = kCuda;
  } else {
    MT_CHECK(o.device == "cpu", "op: unknown --device '{}'; expected cpu or cuda", o.device);
  }

  // Before any work: the final rename must not replace a device, a FIFO or the input itself.
  check_output_file(o.out, "op --out", {o.in});
  hdf5::Reader in(o.in);
  MT_CHECK(in.has_group(o.group), "op {}: {} has no group {} (groups at the root: {})", o.op, o.in,
           hdf5::normalize_group(o.group), fmt::join(in.groups("/"), ", "));
  OpRun r(in, o.group, o.op, mode, o.chunk_size, device);
  try {
    entry->run(r);
  } catch (const OpInputError&) {
    throw;
  } catch (const Error& e) {
    // An op's own check (shape, dtype): it names the argument, which is the dataset name.
    throw Error(fmt::format("op {}: {}: {}", o.op, r.where_group(), e.what()));
  }

  // Upstream gradients: dX for output X; absent ones are zeros.
  Tensors roots, grads;
  std::vector<std::string> given;
  for (const Named& out : r.outputs()) {
    const std::string name = "d" + out.name;
    Tensor g;
    if (in.has_dataset(r.group(), name)) {
      MT_CHECK(in.shape(r.group(), name) == out.tensor.shape(), "op {}: {} is {} but output {} is {}; they must match",
               o.op, r.where(name), in.shape(r.group(), name), out.name, out.tensor.shape());
      g = in.read(r.group(), name);
      MT_CHECK(g.shape() == out.tensor.shape(), "op {}: {} is {} but output {} is {}; they must match", o.op,
               r.where(name), g.shape(), out.name, out.tensor.shape());
      MT_CHECK(g.dtype() == r.dtype(), "op {}: {} is {} but the inputs are {}", o.op, r.where(name), g.dtype(),
               r.dtype());
      given.push_back(name);
      if (!device.is_cpu()) g = g.to(device);
    } else {
      g = zeros(out.tensor.shape(), out.tensor.dtype(), out.tensor.device());
    }
    roots.push_back(out.tensor);
    grads.push_back(g);
  }
  const bool backward = !given.empty();
  if (backward) autograd::backward(roots, grads);

  for (const std::string& u : r.unused())
    spdlog::warn("op {}: {} was not used (not an input of this op)", o.op, r.where(u));
  for (const std::string& a : r.unused_attributes())
    spdlog::warn("op {}: attribute {} of {} was not used (not a hyper-parameter of this op)", o.op, a,
                 r.where_group());

  hdf5::Writer out(o.out);
  const std::string g = r.group();
  out.create_group(g);
  out.set_attribute(g, "op", o.op);
  out.set_attribute(g, "dtype", std::string(dtype_name(r.dtype())));
  if (entry->kda_mode) {
    out.set_attribute(g, "mode", std::string(kda_mode_name(mode)));
    out.set_attribute(g, "chunk_size", o.chunk_size);
  }
  int64_t written = 0;
  for (const Named& n : r.outputs()) {
    out.write(g, n.name, n.tensor.detach());
    ++written;
  }
  for (const Named& n : r.values()) {  // "params/<name>": under the subgroup
    const size_t slash = n.name.rfind('/');
    if (slash == std::string::npos) out.write(g, n.name, n.tensor.detach());
    else out.write(hdf5::join(g, n.name.substr(0, slash)), n.name.substr(slash + 1), n.tensor.detach());
    ++written;
  }
  if (backward) {
    auto grad_of = [](const Tensor& t) {
      Tensor gr = t.grad();
      return gr.defined() ? gr : zeros(t.shape(), t.dtype(), t.device());
    };
    for (const Named& n : r.inputs()) {
      out.write(g, "d" + n.name, grad_of(n.tensor));
      ++written;
    }
    for (const Named& n : r.params()) {
      out.write(hdf5::join(g, "grad"), n.name, grad_of(n.tensor));
      ++written;
    }
  }
  out.commit();
  spdlog::info("op {}{}: {} -> {} ({} datasets; {})", o.op,
               entry->kda_mode ? fmt::format(" ({}{})", kda_mode_name(mode),
                                             mode == KdaMode::chunked ? fmt::format(", C = {}", o.chunk_size) : "")
                               : "",
               r.where_group(), o.out, written,
               backward ? fmt::format("upstream {}", fmt::join(given, ", ")) : "no upstream gradients: outputs only");
  return 0;
}

}  // namespace

void add_op_command(CLI::App& app, Commands& commands) {
  CLI::App* cmd = app.add_subcommand(
      "op", "Run one op or layer on HDF5 inputs; write outputs and gradients (docs/op.md)");
  auto o = std::make_shared<Options>();
  cmd->add_option("name", o->op, "op: " + op_names())->required();
  cmd->add_option("--in", o->in, "input HDF5 file")->required();
  cmd->add_option("--out", o->out, "output HDF5 file (written to a temp name, then renamed)")->required();
  cmd->add_option("--group", o->group, "group holding the inputs; the output uses the same");
  cmd->add_option("--mode", o->mode, "KDA form: recurrent or chunked");
  cmd->add_option("--chunk-size", o->chunk_size, "KDA chunk size C");
  cmd->add_option("--device", o->device, "cpu or cuda");
  commands.push_back({cmd, [o] { return run_op(*o); }});
}

}  // namespace moetrain::cli
