// The ledger and the cluster planner (docs/parallelism.md#the-ledger-flags for the
// accounting and the step-time model, docs/model.md#configs-and-parameter-counts for
// the counts). The model is built once on shapes only and summarised (ModelSummary);
// a layout is then a few sums over its parameters and layers, so the planner can
// evaluate every layout of a cluster in well under a second.
#include "nn/ledger.h"

#include <algorithm>
#include <functional>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "core/error.h"
#include "core/format.h"
#include "nn/model_family.h"
#include "nn/parameters.h"
#include "nn/pipeline_schedule.h"
#include "nn/pipeline_stages.h"

namespace moetrain {

namespace {

// A parameter as the ledger places it.
struct PlacedParam {
  std::string group;
  int64_t numel = 0;
  int64_t layer = 0;        // -1: before the layers (stage 0); n_layer: after them (the last stage)
  bool expert = false;      // group "experts": sharded over ep, replicated over dp
  bool keeps_f32 = false;   // stays f32 in bf16 runs (no master copy)
  bool muon = false;        // train.optimizer muon and a hidden matrix: one momentum, not two moments
  bool embedding_table = false;  // copied to the last stage when the head is tied to it
};

// What a layout's ledger needs from the model, computed once per config.
struct ModelSummary {
  std::unique_ptr<LanguageModel> model;
  std::string arch, description;
  std::vector<PlacedParam> params;
  std::map<std::string, int64_t> components;
  int64_t total = 0, active = 0, n_layer = 0, d_model = 0, vocab = 0;
  int64_t experts = 0, top_k = 0, moe_width = 0;  // moe_width: the dispatched row (latent L, else D)
  std::vector<bool> moe_layer;
  bool tied = false, mixed_precision = false, recompute = false;
  double param_bytes = 4;       // one weight (or gradient, or moment) in the run's dtype (f32, f64)
  double activation_bytes = 4;  // one value sent between ranks (bf16 runs: 2)
  double flops_per_token = 0;
  int64_t seq_len = 0, batch_size = 0, grad_accum = 1, pp_virtual = 1;
  double grad_bucket_bytes = 32.0 * 1048576.0;  // train.grad_bucket_mb
  std::string dtype;
  std::map<int64_t, int64_t> decode_cache_bytes;
  // The model's estimates over layers [first, end), with or without the head.
  std::function<double(int64_t, int64_t, bool)> flops, activations;
  // Forward FLOPs per token that train.recompute_modules runs again, over layers [first, end).
  std::function<double(int64_t, int64_t)> selective_flops = [](int64_t, int64_t) { return 0.0; };
  std::string recompute_modules;  // train.recompute_modules
  std::function<int64_t(int64_t)> boundary;  // values per token entering layer l
  CpuWidenedOp cpu_widened;  // bf16 on the CPU only (LedgerShapes::cpu_widened); else none
};

ModelSummary summarize(const Config& config) {
  ModelSummary m;
  m.seq_len = config.get_int("train.seq_len");
  m.batch_size = config.get_int("train.batch_size");
  m.grad_accum = config.get_int("train.grad_accum");
  m.pp_virtual = config.get_int("train.pp_virtual");
  m.grad_bucket_bytes = config.get_number("train.grad_bucket_mb") * 1048576.0;
  m.dtype = config.get_string("train.dtype");
  m.mixed_precision = m.dtype == "bf16";
  m.recompute = config.get_bool("train.activation_checkpointing");
  m.param_bytes = m.dtype == "f64" ? 8 : 4;
  m.activation_bytes = m.mixed_precision ? 2 : m.param_bytes;
  const ModelFamily& family = model_family(config);
  check_capabilities(config, family, /*layout=*/false);  // the ledger estimates layouts the trainer cannot run
  LedgerShapes shapes = family.ledger_shapes(config, m.seq_len, m.mixed_precision);
  const std::vector<ParamSpec>* specs = shapes.specs;
  const std::function<int64_t(const std::string&)> layer_of = shapes.layer_of;
  m.experts = shapes.experts;
  m.top_k = shapes.top_k;
  m.moe_width = shapes.moe_width;
  m.tied = shapes.tied;
  m.n_layer = shapes.n_layer;
  m.d_model = shapes.d_model;
  m.moe_layer = shapes.moe_layer;
  m.flops = shapes.flops;
  m.activations = shapes.activations;
  m.boundary = shapes.boundary;
  m.selective_flops = shapes.selective_flops;
  if (m.mixed_precision && config.get_string("train.device") == "cpu") m.cpu_widened = shapes.cpu_widened;
  m.recompute_modules = config.get_string("train.recompute_modules");  // empty unless the family recomputes selectively
  m.model = std::move(shapes.model);
  m.arch = m.model->arch();
  m.description = m.model->describe();
  m.vocab = m.model->padded_vocab_size();  // the embedding's rows (a padded vocabulary counts its padding)
  int64_t expert_params = 0, embedding_table = 0;
  const bool muon = config.get_string("train.optimizer") == "muon";
  for (const ParamSpec& s : *specs) {
    PlacedParam p;
    p.group = s.group;
    p.numel = s.shape.numel();
    p.layer = layer_of(s.name);
    p.expert = s.group == "experts";
    p.keeps_f32 = stays_f32_in_mixed_precision(NamedParameter{s.name, Tensor(), s.decay, s.group});
    p.muon = muon && is_hidden_matrix(s.name, s.group, static_cast<int64_t>(s.shape.ndim()));
    p.embedding_table = s.name == "model.embed_tokens.weight" || s.name == "wte.weight";
    MT_ASSERT(p.layer >= -1 && p.layer <= m.n_layer, "ledger: {} placed at layer {}", s.name, p.layer);
    m.components[s.group] += p.numel;
    m.total += p.numel;
    if (p.expert) expert_params += p.numel;
    if (p.embedding_table) embedding_table = p.numel;
    m.params.push_back(std::move(p));
  }
  m.active = m.total - (m.experts > 0 ? expert_params / m.experts * (m.experts - m.top_k) : 0) -
             (m.tied ? 0 : embedding_table);
  m.flops_per_token = m.model->flops_per_token(m.seq_len);
  for (int64_t length : {1024, 8192, 65536}) m.decode_cache_bytes[length] = m.model->decode_cache_bytes(length);
  return m;
}

void check_layout(const ModelSummary& m, const Config& config, const LedgerLayout& layout) {
  if (layout.pp < 1 || layout.dp < 1 || layout.ep < 1)
    throw Error(fmt::format("ledger: --pp {}, --dp {}, --ep {}: each must be at least 1", layout.pp, layout.dp,
                            layout.ep));
  if (layout.pp > m.n_layer)
    throw Error(fmt::format("ledger: --pp {} asks for more pipeline stages than the model has layers "
                            "(model.n_layer = {}); use --pp {} or fewer",
                            layout.pp, m.n_layer, m.n_layer));
  if (m.experts > 0 && m.experts % layout.ep != 0)
    config.fail("model.moe.num_experts",
                fmt::format("cannot be sharded over --ep {} ranks (not a multiple)", layout.ep));
  if (m.experts == 0 && layout.ep > 1)
    throw Error(fmt::format("ledger: --ep {}: this {} model has no routed experts to shard; use --ep 1 (and --dp)",
                            layout.ep, m.arch));
  if (layout.zero != 0 && layout.zero != 1)
    throw Error(fmt::format("ledger: --zero {}: expected 0 (replicated optimizer state) or 1 (sharded)", layout.zero));
  if (layout.micro_batch < 1 || layout.num_micro_batches < 1)
    throw Error(fmt::format("ledger: --micro-batch {} and --micro-batches {} must be at least 1", layout.micro_batch,
                            layout.num_micro_batches));
  if (layout.virtual_stages < 1)
    throw Error(fmt::format("ledger: --pp-virtual {} must be at least 1", layout.virtual_stages));
  if (layout.virtual_stages > 1 && layout.pp == 1)
    throw Error(fmt::format("ledger: --pp-virtual {} needs --pp > 1", layout.virtual_stages));
  if (layout.pp * layout.virtual_stages > m.n_layer)
    throw Error(fmt::format("ledger: --pp {} x --pp-virtual {} = {} virtual stages exceed the model's {} layers",
                            layout.pp, layout.virtual_stages, layout.pp * layout.virtual_stages, m.n_layer));
  if (layout.virtual_stages > 1 && layout.num_micro_batches % layout.pp != 0)
    throw Error(fmt::format("ledger: --micro-batches {} is not a multiple of --pp {}: the interleaved schedule of "
                            "--pp-virtual {} runs them in groups of pp",
                            layout.num_micro_batches, layout.pp, layout.virtual_stages));
}

// Bytes per element of one parameter's state.
struct StateBytes {
  double weight = 4, grad = 4, master = 0, moments = 8;
};

StateBytes state_bytes(const ModelSummary& m, const PlacedParam& p) {
  // bf16 runs: bf16 weight and grad, f32 master and 2 moments (16 bytes); the
  // f32-kept weights have no master (4 + 4 + 8). f32/f64: weight, grad, 2 moments.
  // Muon's matrices (train.optimizer muon) keep one momentum instead of two moments.
  const double slots = p.muon ? 1 : 2;
  if (m.mixed_precision) return p.keeps_f32 ? StateBytes{4, 4, 0, 4 * slots} : StateBytes{2, 2, 4, 4 * slots};
  return {m.param_bytes, m.param_bytes, 0, slots * m.param_bytes};
}

// True when the ranks first, first + stride, ..., first + (count - 1) stride share a node.
bool on_one_node(int64_t first, int64_t stride, int64_t count, const ClusterAssumptions& c) {
  return first / c.devices_per_node == (first + (count - 1) * stride) / c.devices_per_node;
}

// The most peers on other nodes that a rank of the EP groups of a stage has (the
// groups are ep consecutive ranks from first_rank on; one that straddles nodes
// leaves its ranks on the emptier node with the most remote peers).
int64_t remote_ep_peers(int64_t first_rank, int64_t dp, int64_t ep, const ClusterAssumptions& c) {
  const int64_t per_node = c.devices_per_node;
  int64_t most = 0;
  for (int64_t g = 0; g < dp; ++g) {
    const int64_t begin = first_rank + g * ep, end = begin + ep;
    for (int64_t node = begin / per_node; node * per_node < end; ++node) {
      const int64_t here = std::min(end, (node + 1) * per_node) - std::max(begin, node * per_node);
      most = std::max(most, ep - here);
    }
  }
  return most;
}

// Seconds to move `bytes` per rank in a ring collective over a group: the ring's
// slowest link sets the pace, NVLink inside a node, the NIC across nodes.
double ring_seconds(double bytes, bool one_node, const ClusterAssumptions& c) {
  return bytes / (one_node ? c.intra_bandwidth : c.inter_bandwidth);
}

}  // namespace

std::string StageLedger::layers_text() const {
  std::string out;
  for (const auto& [first, end] : chunks)
    out += fmt::format("{}{}-{}", out.empty() ? "" : ", ", first, end - 1);
  return out;
}

namespace {

Ledger evaluate_layout(const ModelSummary& m, const LedgerLayout& layout, const ClusterAssumptions& cluster) {
  Ledger l;
  l.arch = m.arch;
  l.description = m.description;
  l.components = m.components;
  l.total = m.total;
  l.active = m.active;
  l.flops_per_token = m.flops_per_token;
  l.seq_len = m.seq_len;
  l.batch_size = layout.micro_batch;
  l.dtype = m.dtype;
  l.recompute = m.recompute;
  l.recompute_modules = m.recompute_modules;
  l.layout = layout;
  l.cluster = cluster;
  l.decode_cache_bytes = m.decode_cache_bytes;
  const int64_t pp = layout.pp, dp = layout.dp, ep = layout.ep, M = layout.num_micro_batches;
  const int64_t V = layout.virtual_stages, S = pp * V;  // chunks per rank, virtual stages
  const int64_t stage_ranks = dp * ep;
  const double tokens = static_cast<double>(layout.micro_batch * m.seq_len);  // per micro-batch and rank
  const double grad_wire = m.param_bytes;  // gradients are summed in f32 buckets (f64 in f64 runs), bf16 ones too

  std::vector<int64_t> stage_of(static_cast<size_t>(m.n_layer));
  l.stages.resize(static_cast<size_t>(pp));
  for (int64_t g = 0; g < S; ++g) {  // virtual stage g is chunk g / pp of stage g % pp
    const StageLayers layers = stage_layers(m.n_layer, S, g);
    StageLedger& st = l.stages[static_cast<size_t>(g % pp)];
    if (g < pp) {
      st.first_layer = layers.first;
      st.end_layer = layers.end;
    }
    st.chunks.emplace_back(layers.first, layers.end);
    for (int64_t i = layers.first; i < layers.end; ++i) {
      stage_of[static_cast<size_t>(i)] = g % pp;
      st.num_moe_layers += m.moe_layer[static_cast<size_t>(i)];
    }
  }
  // Per stage: the weight bytes of its replicated and expert parameters (the ZeRO-1 all-gather).
  std::vector<double> replicated_weight_bytes(static_cast<size_t>(pp)), expert_weight_bytes(static_cast<size_t>(pp));
  auto place = [&](const PlacedParam& p, int64_t s) {
    StageLedger& st = l.stages[static_cast<size_t>(s)];
    const int64_t n = p.expert ? p.numel / ep : p.numel;
    const StateBytes b = state_bytes(m, p);
    const double replicas = static_cast<double>(p.expert ? dp : stage_ranks);
    st.components[p.group] += n;
    st.params += n;
    if (p.expert) st.expert_params += n;
    st.weight_grad_bytes += (b.weight + b.grad) * static_cast<double>(n);
    st.optimizer_bytes += (b.master + b.moments) * static_cast<double>(n) / (layout.zero ? replicas : 1.0);
    (p.expert ? expert_weight_bytes : replicated_weight_bytes)[static_cast<size_t>(s)] +=
        b.weight * static_cast<double>(n);
  };
  for (const PlacedParam& p : m.params) {
    const int64_t s = p.layer < 0 ? 0 : p.layer >= m.n_layer ? pp - 1 : stage_of[static_cast<size_t>(p.layer)];
    place(p, s);
    if (p.embedding_table && m.tied && pp > 1) place(p, pp - 1);  // the tied head's copy
  }

  const ClusterAssumptions& c = cluster;
  const double compute_rate = c.peak_flops * c.mfu;
  for (int64_t s = 0; s < pp; ++s) {
    StageLedger& st = l.stages[static_cast<size_t>(s)];
    const bool last = s == pp - 1;
    const int64_t first_rank = s * stage_ranks;
    // Activations per chunk: its layers (and the head on the last virtual stage),
    // plus what it received from the previous virtual stage; the stage keeps the
    // micro-batch chunks its schedule has in flight (nn/pipeline_schedule.h: 1F1B
    // keeps min(pp - s, M) on stage s, the interleaved order more, each smaller).
    std::vector<double> chunk_bytes;
    double widest = 0, flops = 0;
    for (int64_t k = 0; k < V; ++k) {
      const auto [first, end] = st.chunks[static_cast<size_t>(k)];
      const int64_t g = k * pp + s;
      const bool head = g == S - 1;
      const double received = g > 0 ? static_cast<double>(m.boundary(first)) * m.activation_bytes : 0.0;
      if (!m.recompute) {
        chunk_bytes.push_back(tokens * (m.activations(first, end, head) + received));
      } else {
        // Recompute: each micro-batch keeps its layers' inputs (the chunk's input, then
        // one D-wide hidden per further layer); one layer's full activations (and the
        // logits on the last) exist at a time, during that layer's backward.
        for (int64_t i = first; i < end; ++i) widest = std::max(widest, m.activations(i, i + 1, false));
        chunk_bytes.push_back(tokens * static_cast<double>(m.boundary(first) + (end - first - 1) * m.d_model) *
                              m.activation_bytes);
      }
      // Compute: forward + backward of one micro-batch (+ one more forward of the layers with
      // recompute, + the selective modules' forward again: also inside recomputed layers).
      flops += m.flops(first, end, head);
      if (m.recompute) flops += m.flops(first, end, false) / 3.0;
      flops += m.selective_flops(first, end);
    }
    const std::vector<PipelineAction> order = pipeline_actions(pp, V, M, s);
    st.num_micro_batches_in_flight = pipeline_max_in_flight(order);
    st.in_flight_bytes = pipeline_peak_in_flight(order, chunk_bytes);
    for (double b : chunk_bytes) st.activation_bytes_per_micro_batch += b;
    st.activation_bytes = st.in_flight_bytes;
    st.cpu_widen_bytes = tokens * static_cast<double>(m.cpu_widened.values_per_token) * 4.0;
    if (m.recompute) st.activation_bytes += tokens * (widest + (last ? m.activations(m.n_layer, m.n_layer, true) : 0.0));
    st.compute_s = tokens * flops / compute_rate;
    // MoE all-to-all: per token and MoE layer, top_k rows of the dispatched width go
    // out (dispatch) and come back (combine), in forward and again in backward; with
    // uniform routing 1/ep of them stay on the rank, the rest split evenly over the peers.
    if (st.num_moe_layers > 0 && ep > 1) {
      const double bytes = tokens * static_cast<double>(st.num_moe_layers) * 4.0 * static_cast<double>(m.top_k) *
                           static_cast<double>(m.moe_width) * m.activation_bytes;
      const double per_peer = bytes / static_cast<double>(ep);
      const int64_t remote = remote_ep_peers(first_rank, dp, ep, c);
      st.all_to_all_s = std::max(per_peer * static_cast<double>(ep - 1 - remote) / c.intra_bandwidth,
                                 per_peer * static_cast<double>(remote) / c.inter_bandwidth);
    }
    // Pipeline point-to-point: each chunk's activations in from the virtual stage
    // before and out to the one after (their gradients travel the other way on the
    // same full-duplex links); rank r talks to the same local rank of the stages
    // s -/+ 1 (around the ring from the last stage to the first with virtual
    // stages), over the NIC if any such pair of the two stages crosses nodes.
    auto pairs_on_nodes = [&](int64_t a, int64_t b) {  // stages a and b
      for (int64_t r = 0; r < stage_ranks; ++r)
        if (!on_one_node(std::min(a, b) * stage_ranks + r, std::abs(a - b) * stage_ranks, 2, c)) return false;
      return true;
    };
    for (int64_t k = 0; k < V; ++k) {
      const auto [first, end] = st.chunks[static_cast<size_t>(k)];
      const int64_t g = k * pp + s;
      if (g > 0)
        st.p2p_s += ring_seconds(tokens * static_cast<double>(m.boundary(first)) * m.activation_bytes,
                                 pairs_on_nodes(s, (s + pp - 1) % pp), c);
      if (g < S - 1)
        st.p2p_s += ring_seconds(tokens * static_cast<double>(m.boundary(end)) * m.activation_bytes,
                                 pairs_on_nodes(s, (s + 1) % pp), c);
    }
    // Gradient sync per step, ring collectives: zero 0 all-reduces the gradients
    // (2 (R - 1) / R of them per rank); zero 1 reduce-scatters them and all-gathers the
    // updated weights ((R - 1) / R each). Replicated parameters over the stage's dp x ep
    // ranks, expert shards over their dp replicas; a tied table also over {first, last}.
    auto sync = [&](double params, double weight_bytes, int64_t replicas, bool one_node) {
      if (replicas < 2 || params == 0) return 0.0;
      const double f = static_cast<double>(replicas - 1) / static_cast<double>(replicas);
      const double bytes = layout.zero ? f * (params * grad_wire + weight_bytes) : 2.0 * f * params * grad_wire;
      return ring_seconds(bytes, one_node, c);
    };
    const double replicated = static_cast<double>(st.params - st.expert_params);
    double largest_group = 0;  // gradient bytes summed over replicas
    if (stage_ranks > 1) largest_group = replicated * grad_wire;
    if (dp > 1) largest_group = std::max(largest_group, static_cast<double>(st.expert_params) * grad_wire);
    st.grad_sync_bytes = 2.0 * std::min(m.grad_bucket_bytes, largest_group);
    bool expert_groups_on_nodes = true;  // the dp ranks first_rank + e + d ep of each ep_index e
    for (int64_t e = 0; e < ep; ++e) expert_groups_on_nodes &= on_one_node(first_rank + e, ep, dp, c);
    st.grad_sync_s = sync(replicated, replicated_weight_bytes[static_cast<size_t>(s)], stage_ranks,
                          on_one_node(first_rank, 1, stage_ranks, c)) +
                     sync(static_cast<double>(st.expert_params), expert_weight_bytes[static_cast<size_t>(s)], dp,
                          expert_groups_on_nodes);
    if (m.tied && pp > 1 && (s == 0 || last))
      st.grad_sync_s += ring_seconds(static_cast<double>(m.vocab * m.d_model) * grad_wire,
                                     on_one_node(0, (pp - 1) * stage_ranks, 2, c), c);
  }

  // The rank that needs the most memory sets the layout's per-rank numbers.
  size_t worst = 0;
  double slowest = 0;
  for (size_t s = 0; s < l.stages.size(); ++s) {
    const StageLedger& st = l.stages[s];
    if (st.total_bytes() > l.stages[worst].total_bytes()) worst = s;
    slowest = std::max(slowest, st.micro_batch_s());
    l.step.grad_sync_s = std::max(l.step.grad_sync_s, st.grad_sync_s);
  }
  const StageLedger& w = l.stages[worst];
  l.worst_stage = static_cast<int64_t>(worst);
  l.params_per_rank = w.params;
  l.state_bytes_per_rank = w.weight_grad_bytes + w.optimizer_bytes;
  l.grad_sync_bytes_per_rank = w.grad_sync_bytes;
  l.activation_bytes_per_rank = w.activation_bytes;
  l.cpu_widen_bytes_per_rank = w.cpu_widen_bytes;
  if (m.cpu_widened.values_per_token > 0) l.cpu_widen_op = m.cpu_widened.name;
  l.bytes_per_rank = w.total_bytes();
  l.fits = l.bytes_per_rank <= c.usable();

  StepEstimate& e = l.step;
  // The interleaved schedule's fill and drain take one chunk (1 / V of a stage's micro-batch) per stage.
  e.bubble = pipeline_bubble_model(pp, V, M);
  e.pipeline_s = (static_cast<double>(M) + static_cast<double>(pp - 1) / static_cast<double>(V)) * slowest;
  e.step_s = e.pipeline_s + e.grad_sync_s;
  e.sequences_per_step = M * layout.micro_batch * stage_ranks;
  const double step_tokens = static_cast<double>(e.sequences_per_step * m.seq_len);
  e.tokens_per_second = e.step_s > 0 ? step_tokens / e.step_s : 0.0;
  e.mfu = e.step_s > 0 ? m.flops_per_token * step_tokens /
                             (static_cast<double>(layout.ranks()) * c.peak_flops * e.step_s)
                       : 0.0;
  return l;
}

LedgerLayout resolved(const ModelSummary& m, LedgerLayout layout) {
  if (layout.micro_batch == 0) layout.micro_batch = m.batch_size;
  if (layout.num_micro_batches == 0) layout.num_micro_batches = m.grad_accum;
  // train.pp_virtual splits pipeline stages: a layout without a pipeline has none to split.
  if (layout.virtual_stages == 0) layout.virtual_stages = layout.pp > 1 ? m.pp_virtual : 1;
  return layout;
}

std::string seconds(double s) {
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.1f} ms", s * 1e3);
  return fmt::format("{:.0f} us", s * 1e6);
}

std::string count(double n) {  // 6.2B, 350M
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f}M", n / 1e6);
  return fmt::format("{:.0f}", n);
}

// What the trainer cannot run yet of what the ledger was asked to count.
std::vector<std::string> trainer_notes(const Ledger& l) {
  std::vector<std::string> notes;
  if (l.layout.pp > 1 && !model_family(l.arch).capabilities.pipeline_parallel)
    notes.push_back(fmt::format("note: train.pp runs {} only; the {} stages here are an estimate\n",
                                families_with(&ModelCapabilities::pipeline_parallel), l.arch));
  return notes;
}

std::string cluster_text(const ClusterAssumptions& c) {
  return fmt::format("{} per device, {} usable after a {} reserve", human_bytes(c.gpu_memory), human_bytes(c.usable()),
                     human_bytes(c.reserve));
}

std::string step_text(const Ledger& l) {
  const StepEstimate& e = l.step;
  const ClusterAssumptions& c = l.cluster;
  const StageLedger* slowest = &l.stages[0];
  for (const StageLedger& st : l.stages)
    if (st.micro_batch_s() > slowest->micro_batch_s()) slowest = &st;
  std::string out = fmt::format(
      "step estimate (M = {} micro-batches of {} x {} per pipeline, {} sequences per step; {:.0f} TFLOP/s x {:.2f} "
      "MFU, "
      "{:.0f} GB/s in a node of {}, {:.0f} GB/s across nodes{}):\n",
      l.layout.num_micro_batches, l.layout.micro_batch, l.seq_len, with_commas(e.sequences_per_step),
      c.peak_flops / 1e12, c.mfu, c.intra_bandwidth / 1e9, c.devices_per_node, c.inter_bandwidth / 1e9,
      l.recompute || !l.recompute_modules.empty() ? "; " + l.recompute_text() : std::string());
  out += fmt::format("  slowest stage per micro-batch: compute {} + all-to-all {} + p2p {} = {}\n",
                     seconds(slowest->compute_s), seconds(slowest->all_to_all_s), seconds(slowest->p2p_s),
                     seconds(slowest->micro_batch_s()));
  out += fmt::format("  pipeline ({} + ({} - 1) / {}) x {} = {} (bubble {:.1f}%), gradient sync {}: step {}, {} "
                     "tokens/s, MFU {:.1f}%\n",
                     l.layout.num_micro_batches, l.layout.pp, l.layout.virtual_stages, seconds(slowest->micro_batch_s()),
                     seconds(e.pipeline_s),
                     100.0 * e.bubble, seconds(e.grad_sync_s), seconds(e.step_s),
                     with_commas(static_cast<int64_t>(e.tokens_per_second)), 100.0 * e.mfu);
  return out;
}

std::string memory_text(const Ledger& l) {
  const StageLedger& w = l.stages[static_cast<size_t>(l.worst_stage)];
  const ClusterAssumptions& c = l.cluster;
  const double alive = w.in_flight_bytes;
  const std::string held =
      l.layout.virtual_stages > 1
          ? fmt::format("{} micro-batch chunks alive at the peak, {} a micro-batch over the {} chunks{}",
                        w.num_micro_batches_in_flight, human_bytes(w.activation_bytes_per_micro_batch),
                        l.layout.virtual_stages, l.recompute ? ", layer inputs" : "")
          : fmt::format("{} x {}{}", w.num_micro_batches_in_flight, human_bytes(w.activation_bytes_per_micro_batch),
                        l.recompute ? " layer inputs" : "");
  std::string out = fmt::format(
      "memory per rank{}: weights+grads {} + optimizer {} + activations {} ({}{}){}{} = {}\n",
      l.layout.pp > 1 ? fmt::format(" (worst: stage {}, layers {})", l.worst_stage, w.layers_text()) : "",
      human_bytes(w.weight_grad_bytes), human_bytes(w.optimizer_bytes), human_bytes(w.activation_bytes), held,
      l.recompute ? fmt::format(" + {} for the layer being recomputed", human_bytes(w.activation_bytes - alive)) : "",
      w.grad_sync_bytes > 0 ? fmt::format(" + gradient buckets {}", human_bytes(w.grad_sync_bytes)) : "",
      w.cpu_widen_bytes > 0
          ? fmt::format(" + f32 transients of bf16 ops on the CPU {} ({})", human_bytes(w.cpu_widen_bytes),
                        l.cpu_widen_op)
          : "",
      human_bytes(l.bytes_per_rank));
  out += fmt::format("  against {}: {}\n", cluster_text(c),
                     l.fits ? fmt::format("fits, {} to spare", human_bytes(c.usable() - l.bytes_per_rank))
                            : fmt::format("does not fit, {} over", human_bytes(l.bytes_per_rank - c.usable())));
  return out;
}

std::string stage_table(const Ledger& l) {
  std::string out = fmt::format("  {:>5} {:>7} {:>4} {:>10} {:>13} {:>11} {:>6} {:>12} {:>11} {:>12}\n", "stage",
                                "layers", "moe", "params", "weights+grads", "optimizer", "alive", "activations",
                                "total", "micro-batch");
  for (size_t s = 0; s < l.stages.size(); ++s) {
    const StageLedger& st = l.stages[s];
    out += fmt::format("  {:>5} {:>7} {:>4} {:>10} {:>13} {:>11} {:>6} {:>12} {:>11} {:>12}{}\n", s,
                       st.layers_text(), st.num_moe_layers,
                       count(static_cast<double>(st.params)), human_bytes(st.weight_grad_bytes),
                       human_bytes(st.optimizer_bytes), st.num_micro_batches_in_flight,
                       human_bytes(st.activation_bytes), human_bytes(st.total_bytes()), seconds(st.micro_batch_s()),
                       static_cast<int64_t>(s) == l.worst_stage ? "  <- worst" : "");
  }
  return out;
}

nlohmann::json layout_json(const Ledger& l) {
  nlohmann::json j = {{"layout",
                       {{"pp", l.layout.pp},
                        {"dp", l.layout.dp},
                        {"ep", l.layout.ep},
                        {"zero", l.layout.zero},
                        {"virtual_stages", l.layout.virtual_stages},
                        {"micro_batch", l.layout.micro_batch},
                        {"num_micro_batches", l.layout.num_micro_batches}}},
                      {"params_per_rank", l.params_per_rank},
                      {"state_bytes_per_rank", l.state_bytes_per_rank},
                      {"activation_bytes_per_rank", l.activation_bytes_per_rank},
                      {"bytes_per_rank", l.bytes_per_rank},
                      {"gpu_usable_bytes", l.cluster.usable()},
                      {"cpu_widen_bytes_per_rank", l.cpu_widen_bytes_per_rank},
                      {"cpu_widen_op", l.cpu_widen_op},
                      {"fits", l.fits},
                      {"peak_stage", l.worst_stage}};
  const StepEstimate& e = l.step;
  j["step"] = {{"bubble", e.bubble},         {"pipeline_s", e.pipeline_s},
               {"grad_sync_s", e.grad_sync_s}, {"step_s", e.step_s},
               {"sequences_per_step", e.sequences_per_step}, {"tokens_per_second", e.tokens_per_second},
               {"mfu", e.mfu}};
  return j;
}

}  // namespace

Ledger make_ledger(const Config& config, LedgerLayout layout, const ClusterAssumptions& cluster) {
  ModelSummary m = summarize(config);
  layout = resolved(m, layout);
  check_layout(m, config, layout);
  return evaluate_layout(m, layout, cluster);
}

std::string ledger_text(const Ledger& l) {
  std::string out = fmt::format("model {}: {}\n", l.arch, l.description);
  for (const auto& [group, n] : l.components)
    out += fmt::format("  {:<16} {:>20} ({:5.1f}%)\n", group, with_commas(n),
                       100.0 * static_cast<double>(n) / static_cast<double>(l.total));
  out += fmt::format("  {:<16} {:>20}\n", "total", with_commas(l.total));
  out += fmt::format("  {:<16} {:>20}  (per token; no input embedding table unless tied)\n", "active",
                     with_commas(l.active));
  out += fmt::format("training FLOPs/token at seq_len {}: {:.4g}\n", l.seq_len, l.flops_per_token);
  const bool plain = l.layout.pp == 1 && l.layout.zero == 0;
  if (plain)
    out += fmt::format("per rank (dp {} x ep {}): {} parameters, {} weights+grads+optimizer (fp32), ~{} activations "
                       "per micro-batch of {} x {}\n",
                       l.layout.dp, l.layout.ep, with_commas(l.params_per_rank), human_bytes(l.state_bytes_per_rank),
                       human_bytes(l.activation_bytes_per_rank), l.batch_size, l.seq_len);
  else
    out += fmt::format(
        "per rank (pp {} x dp {} x ep {}, zero {}): {} parameters, {} weights+grads+optimizer ({}), ~{} "
        "activations ({} micro-batches of {} x {} in flight)\n",
        l.layout.pp, l.layout.dp, l.layout.ep, l.layout.zero, with_commas(l.params_per_rank),
        human_bytes(l.state_bytes_per_rank), l.dtype == "bf16" ? "bf16, f32 master" : l.dtype,
        human_bytes(l.activation_bytes_per_rank),
        l.stages[static_cast<size_t>(l.worst_stage)].num_micro_batches_in_flight, l.batch_size, l.seq_len);
  std::string cache;
  for (const auto& [length, bytes] : l.decode_cache_bytes)
    cache += fmt::format("{}T={}: {}", cache.empty() ? "" : ", ", length, human_bytes(static_cast<double>(bytes)));
  out += fmt::format("decode cache per sequence: {}\n", cache);
  out += memory_text(l);
  if (l.layout.pp > 1) out += stage_table(l);
  out += step_text(l);
  for (const std::string& note : trainer_notes(l)) out += note;
  return out;
}

std::string ledger_json(const Ledger& l) {
  nlohmann::json j = {{"arch", l.arch},
                      {"description", l.description},
                      {"components", l.components},
                      {"dp", l.layout.dp},
                      {"ep", l.layout.ep},
                      {"total", l.total},
                      {"active", l.active},
                      {"flops_per_token", l.flops_per_token},
                      {"seq_len", l.seq_len},
                      {"batch_size", l.batch_size},
                      {"dtype", l.dtype},
                      {"recompute", l.recompute},
                      {"recompute_modules", l.recompute_modules},
                      {"gpu_memory_bytes", l.cluster.gpu_memory},
                      {"reserve_bytes", l.cluster.reserve}};
  j.update(layout_json(l));
  for (const StageLedger& st : l.stages) {
    nlohmann::json s = {{"first_layer", st.first_layer},
                        {"end_layer", st.end_layer},
                        {"components", st.components},
                        {"params", st.params},
                        {"expert_params", st.expert_params},
                        {"num_moe_layers", st.num_moe_layers},
                        {"weight_grad_bytes", st.weight_grad_bytes},
                        {"optimizer_bytes", st.optimizer_bytes},
                        {"activation_bytes_per_micro_batch", st.activation_bytes_per_micro_batch},
                        {"num_micro_batches_in_flight", st.num_micro_batches_in_flight},
                        {"activation_bytes", st.activation_bytes},
                        {"grad_sync_bytes", st.grad_sync_bytes},
                        {"cpu_widen_bytes", st.cpu_widen_bytes},
                        {"total_bytes", st.total_bytes()},
                        {"compute_s", st.compute_s},
                        {"all_to_all_s", st.all_to_all_s},
                        {"p2p_s", st.p2p_s},
                        {"grad_sync_s", st.grad_sync_s}};
    j["stages"].push_back(s);
  }
  for (const auto& [length, bytes] : l.decode_cache_bytes) j["decode_cache_bytes"][std::to_string(length)] = bytes;
  return j.dump(2);
}

Plan plan_layouts(const Config& config, PlanOptions options, const ClusterAssumptions& cluster) {
  ModelSummary m = summarize(config);
  if (options.devices < 1)
    throw Error(fmt::format("ledger: --plan {}: expected a number of devices >= 1", options.devices));
  if (options.micro_batch == 0) options.micro_batch = m.batch_size;
  if (options.global_batch == 0) options.global_batch = options.devices * m.batch_size * m.grad_accum;
  if (options.global_batch < 1 || options.micro_batch < 1)
    throw Error(fmt::format("ledger: --global-batch {} and --micro-batch {} must be at least 1", options.global_batch,
                            options.micro_batch));
  Plan plan;
  plan.options = options;
  std::vector<Ledger> all;
  const int64_t N = options.devices;
  for (int64_t pp = 1; pp <= std::min(N, m.n_layer); ++pp) {
    if (N % pp) continue;
    for (int64_t ep = 1; ep <= N / pp; ++ep) {
      if ((N / pp) % ep || (m.experts > 0 ? m.experts % ep != 0 : ep > 1)) continue;
      const int64_t dp = N / pp / ep;
      const int64_t per_pipeline = options.micro_batch * dp * ep;  // sequences per micro-batch over the stage's ranks
      if (options.global_batch % per_pipeline) continue;
      const int64_t M = options.global_batch / per_pipeline;
      for (int64_t V = 1; V <= 8 && pp * V <= m.n_layer; ++V) {
        if (V > 1 && (pp == 1 || M % pp != 0)) break;
        for (int64_t zero : {0, 1}) {
          LedgerLayout layout{dp, ep, pp, zero, options.micro_batch, M, V};
          all.push_back(evaluate_layout(m, layout, cluster));
          ++plan.searched;
        }
      }
    }
  }
  for (Ledger& l : all)
    if (l.fits) plan.feasible.push_back(l);
  std::sort(plan.feasible.begin(), plan.feasible.end(), [](const Ledger& a, const Ledger& b) {
    return a.step.step_s != b.step.step_s ? a.step.step_s < b.step.step_s : a.bytes_per_rank < b.bytes_per_rank;
  });
  if (plan.feasible.empty()) {
    std::sort(all.begin(), all.end(),
              [](const Ledger& a, const Ledger& b) { return a.bytes_per_rank < b.bytes_per_rank; });
    all.resize(std::min<size_t>(all.size(), static_cast<size_t>(options.top)));
    plan.closest = std::move(all);
  }
  return plan;
}

std::string plan_text(const Plan& plan) {
  const PlanOptions& o = plan.options;
  const std::vector<Ledger>& shown = plan.feasible.empty() ? plan.closest : plan.feasible;
  std::string out;
  if (!shown.empty()) {
    const Ledger& l = shown.front();
    out += fmt::format("model {}: {}\n", l.arch, l.description);
    out += fmt::format(
        "plan for {} devices ({}); global batch {} sequences of {} tokens, micro-batch {}; {}; {:.0f} TFLOP/s x "
        "{:.2f} MFU, {:.0f} GB/s in a node of {}, {:.0f} GB/s across nodes\n",
        o.devices, cluster_text(l.cluster), with_commas(o.global_batch), l.seq_len, o.micro_batch,
        l.recompute_text(), l.cluster.peak_flops / 1e12, l.cluster.mfu,
        l.cluster.intra_bandwidth / 1e9, l.cluster.devices_per_node, l.cluster.inter_bandwidth / 1e9);
  }
  if (plan.feasible.empty()) {
    out += fmt::format("nothing fits: none of the {} layouts searched fits in {} per rank", plan.searched,
                       shown.empty() ? std::string("the usable memory") : human_bytes(shown.front().cluster.usable()));
    if (shown.empty()) return out + " (no layout divides the global batch: try another --global-batch)\n";
    out += "; the smallest per-rank totals:\n";
  } else {
    out += fmt::format("{} of {} layouts fit; the {} fastest:\n", plan.feasible.size(), plan.searched,
                       std::min<size_t>(plan.feasible.size(), static_cast<size_t>(o.top)));
  }
  out += fmt::format("  {:>3} {:>4} {:>2} {:>4} {:>4} {:>4} {:>4} {:>6} {:>9} {:>10} {:>11} {:>10} {:>6} {:>9} {:>9} "
                     "{:>9} {:>9} {:>9} {:>6}\n",
                     "#", "pp", "V", "dp", "ep", "zero", "M", "bubble", "params", "state", "activations", "total", "stage",
                     "compute", "a2a", "p2p", "grad sync", "step", "MFU");
  for (size_t i = 0; i < shown.size() && i < static_cast<size_t>(o.top); ++i) {
    const Ledger& l = shown[i];
    const StageLedger* slowest = &l.stages[0];
    for (const StageLedger& st : l.stages)
      if (st.micro_batch_s() > slowest->micro_batch_s()) slowest = &st;
    out += fmt::format("  {:>3} {:>4} {:>2} {:>4} {:>4} {:>4} {:>4} {:>5.1f}% {:>9} {:>10} {:>11} {:>10} {:>6} {:>9} "
                       "{:>9} {:>9} {:>9} {:>9} {:>5.1f}%\n",
                       i + 1, l.layout.pp, l.layout.virtual_stages, l.layout.dp, l.layout.ep, l.layout.zero, l.layout.num_micro_batches,
                       100.0 * l.step.bubble, count(static_cast<double>(l.params_per_rank)),
                       human_bytes(l.state_bytes_per_rank), human_bytes(l.activation_bytes_per_rank),
                       human_bytes(l.bytes_per_rank), l.worst_stage, seconds(slowest->compute_s),
                       seconds(slowest->all_to_all_s), seconds(slowest->p2p_s), seconds(l.step.grad_sync_s),
                       seconds(l.step.step_s), 100.0 * l.step.mfu);
  }
  out += "  (params, state, activations, total: per rank on the stage that needs the most; compute, a2a, p2p: one "
         "micro-batch on the slowest stage, all its V chunks; step = (M + (pp - 1) / V) x that + grad sync; V: "
         "virtual stages per rank, train.pp_virtual)\n";
  std::string notes;
  for (size_t i = 0; i < shown.size() && i < static_cast<size_t>(o.top); ++i)
    for (const std::string& note : trainer_notes(shown[i]))
      if (notes.find(note) == std::string::npos) notes += note;
  return out + notes;
}

std::string plan_json(const Plan& plan) {
  nlohmann::json j = {{"devices", plan.options.devices},
                      {"global_batch", plan.options.global_batch},
                      {"micro_batch", plan.options.micro_batch},
                      {"searched", plan.searched},
                      {"feasible", nlohmann::json::array()},
                      {"closest", nlohmann::json::array()}};
  for (const Ledger& l : plan.feasible) j["feasible"].push_back(layout_json(l));
  for (const Ledger& l : plan.closest) j["closest"].push_back(layout_json(l));
  return j.dump(2);
}

std::string Ledger::recompute_text() const {
  // The names as HybridConfig::from read them (checked there).
  const std::vector<std::string> names = split_comma_list(recompute_modules);
  const std::string modules =
      names.empty() ? std::string() : fmt::format("{} recomputed in backward", fmt::join(names, ", "));
  if (recompute && !modules.empty()) return "layers recomputed in backward, " + modules + " again inside them";
  if (recompute) return "layers recomputed in backward";
  return modules.empty() ? "no recompute" : modules;
}

}  // namespace moetrain
