// The CUDA harness (built with the CUDA backend; run by launch/gpu-check.sh):
// one table of TFLOP/s, each as a share of the best cuBLAS bf16 GEMM rate
// measured in the same run (the "peak" row), and of the datasheet bf16 dense
// peak when the GPU is a known one. Every time is CUDA events around the work
// on the device's stream, after a warm-up.
//   build/moetrain_bench_cuda [--steps N] [--out FILE.md] [--components FILE.md] [--list | --case NAME]
// --list names the cases (one per line, no GPU needed); --case NAME runs that one
// alone, appending to FILE.md (launch/gpu-check.sh runs each in its own process, so a
// crash costs one row); its table's header comes with the first case of each table.
// Each row is printed and appended to FILE.md as soon as it is measured (flushed),
// so a run stopped at a time limit keeps its rows. No CUDA device: exit 69
// (kExitNoDevice), distinct from the loader's 127.
// Cases, most important first: training steps (as the trainer's: host ids, forward,
// backward, clipping, the finite and update checks, AdamW) of GPT-2 small at B = 8 and
// 16, T = 1024, and k3-small at B = 4, in bf16 mixed precision as train.dtype bf16 runs
// them, with tokens/s, MFU and launches per step (core/launch_count.h); each one's
// per-component device time (the profiler on CUDA events) goes to --components.
// Then GEMMs (GPT-2 small's shapes, the head padded and not, f32 with and
// without TF32), causal attention forward+backward at T = 4096 / 8192 (tensor
// cores; and the scalar kernels at 4096), chunked KDA forward+backward (scalar
// and TF32 tensor-core state products) and the recurrent form, the router's
// expert selection on the GPU against the host path it replaced, and the f32
// (TF32) training steps for comparison.
// A case whose op has no CUDA kernel yet prints the error instead of a number.
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "backend/cuda/cublas.h"
#include "backend/cuda/runtime.h"
#include "config/config.h"
#include "core/grad_mode.h"
#include "core/launch_count.h"
#include "core/profile.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/moe.h"
#include "ops/moe/moe.h"
#include "nn/parameters.h"
#include "ops/attention/attention_kernels.h"
#include "ops/kda/kda_kernels.h"
#include "optim/adamw.h"
#include "train/graph_step.h"
#include "train/model_source.h"

using namespace moetrain;

namespace {

const Device kGpu{DeviceKind::cuda, 0};

struct Row {
  Row(std::string name_, std::string shape_, double ms_ = -1, double flops_ = 0, double tokens_ = 0)
      : name(std::move(name_)), shape(std::move(shape_)), ms(ms_), flops(flops_), tokens(tokens_) {}
  std::string name, shape;
  double ms, flops, tokens;
  std::string note;
  std::string launches_per_step;  // training steps: format_launches_per_step of the timed steps
};

// Warm-up (unless the caller ran it), then the mean of `steps` runs of fn, timed with events.
double time_ms(int steps, const std::function<void()>& fn, bool warm_up = true) {
  if (warm_up) fn();
  cuda::synchronize(0);
  cuda::EventTimer timer(0);
  timer.start();
  for (int s = 0; s < steps; ++s) fn();
  return timer.stop_ms() / steps;
}

Row gemm_row(const std::string& name, DType dtype, int64_t m, int64_t n, int64_t k, int steps, bool tf32 = false) {
  Tensor a = randn({m, k}, DType::f32, 1).to(kGpu).to(dtype), b = randn({n, k}, DType::f32, 2).to(kGpu).to(dtype);
  Tensor c = empty({m, n}, dtype, kGpu);
  cuda::set_allow_tf32(tf32);
  Row r{name, fmt::format("{}x{}x{} {}{}", m, n, k, dtype_name(dtype), tf32 ? " tf32" : ""), 0, 2.0 * m * n * k};
  r.ms = time_ms(steps, [&] {
    cuda::gemm(dtype, false, true, m, n, k, 1.0, a.raw_data(), k, 0, b.raw_data(), k, 0, 0.0, c.raw_data(), n, 0, 1, 0);
  });
  cuda::set_allow_tf32(false);
  return r;
}

Row guarded(const std::string& name, const std::string& shape, const std::function<Row()>& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    Row r{name, shape};
    r.note = e.what();
    if (r.note.size() > 160) r.note = r.note.substr(0, 157) + "...";
    return r;
  }
}

// An MoE layer's expert GEMM (x w^T for N tokens' top-k rows, E experts of [F, W])
// forward and backward, bf16, the plan on the device: tensor_cores true reads the
// offsets there (grouped_gemm_tc.h), false the host path (offsets copied back,
// cuBLAS's grouped GEMM; one wait per call). FLOPs 2 A W F forward, twice that back.
Row grouped_row(int64_t E, int64_t k, int64_t N, int64_t W, int64_t F, int steps, bool tensor_cores) {
  const std::string shape =
      fmt::format("E{} top{} N{} {}x{} bf16{}", E, k, N, W, F, tensor_cores ? "" : " (offsets on the host, cuBLAS)");
  set_grouped_gemm_tensor_cores(tensor_cores);
  struct Restore {
    ~Restore() { set_grouped_gemm_tensor_cores(true); }
  } restore;
  return guarded("moe grouped gemm fwd+bwd", shape, [&] {
    Tensor ids = empty({N, k}, DType::i64);
    for (int64_t a = 0; a < N * k; ++a) ids.data<int64_t>()[a] = (a * 7919 + a / k) % E;  // spread, deterministic
    const ExpertRows plan = plan_expert_rows(ids.to(kGpu), E, 0);
    Tensor x = randn({N * k, W}, DType::f32, 1).to(kGpu).to(DType::bf16).detach().set_requires_grad();
    Tensor w = mul_scalar(randn({E, F, W}, DType::f32, 2), 0.05).to(kGpu).to(DType::bf16).detach().set_requires_grad();
    Tensor g = randn({N * k, F}, DType::f32, 3).to(kGpu).to(DType::bf16);
    Row r{"moe grouped gemm fwd+bwd", shape, 0, 6.0 * static_cast<double>(N * k) * W * F};
    r.ms = time_ms(steps, [&] {
      Tensor y = grouped_linear(x, w, plan.offsets);
      autograd::backward({y}, {g});
    });
    return r;
  });
}

// Causal attention forward + backward, B = 1, H heads of D: FLOPs of the causal
// half: forward 2 * 2 * T^2/2 * D * H, backward 2.5x forward (recomputes scores).
// tensor_cores false: the scalar kernels (the baseline of the tensor-core rows).
Row attention_row(int64_t T, int64_t H, int64_t D, int steps, bool tensor_cores = true) {
  std::string shape = fmt::format("B1 T{} H{} D{} bf16{}", T, H, D, tensor_cores ? "" : " (scalar kernels)");
  cuda::set_attention_tensor_cores(tensor_cores);
  struct Restore {
    ~Restore() { cuda::set_attention_tensor_cores(true); }
  } restore;
  return guarded("attention fwd+bwd", shape, [&] {
    Tensor q = randn({1, T, H, D}, DType::f32, 1).to(kGpu).to(DType::bf16).detach().set_requires_grad();
    Tensor k = randn({1, T, H, D}, DType::f32, 2).to(kGpu).to(DType::bf16).detach().set_requires_grad();
    Tensor v = randn({1, T, H, D}, DType::f32, 3).to(kGpu).to(DType::bf16).detach().set_requires_grad();
    Tensor g = randn({1, T, H, D}, DType::f32, 4).to(kGpu).to(DType::bf16);
    double fwd = 2.0 * 2.0 * (static_cast<double>(T) * T / 2) * D * H;
    Row r{"attention fwd+bwd", shape, 0, fwd * 3.5};
    r.ms = time_ms(steps, [&] {
      Tensor o = causal_attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(D)));
      autograd::backward({o}, {g});
      for (Tensor* t : {&q, &k, &v}) t->zero_grad();
    });
    return r;
  });
}

// The recurrent row counts the chunked form's FLOPs too, so the two rates compare times.
// tensor_cores: the chunked form's products on TF32 tensor cores (ops/kda/kda_tc.h).
// columns: the chunked scans' tile of columns of S: 0 the fixed tile of before the
// automatic choice (64 columns scalar, 32 on tensor cores), kKdaAutoColumns the
// automatic choice from the shape and the SM count (kda_scan_columns), else that
// tile; the shape names the tile run.
constexpr int kKdaAutoColumns = -1;
Row kda_row(int64_t T, int steps, KdaMode mode = KdaMode::chunked, bool tensor_cores = false, int columns = 0,
            int64_t B = 1) {
  const int64_t H = 16, K = 128;
  const std::string name = fmt::format("kda {} fwd+bwd", kda_mode_name(mode));
  const int fixed = columns == 0 ? (tensor_cores ? 32 : 64) : std::max(columns, 0);
  cuda::set_kda_tensor_cores(tensor_cores);
  cuda::set_kda_scan_columns(fixed);
  struct Restore {
    ~Restore() {
      cuda::set_kda_tensor_cores(false);
      cuda::set_kda_scan_columns(0);
    }
  } restore;
  const std::string shape = fmt::format("B{} T{} H{} K=V={}{}{}", B, T, H, K,
                                        mode == KdaMode::chunked ? " chunk 64" : "",
                                        tensor_cores ? " tf32 tensor cores" : "");
  return guarded(name, shape, [&] {
    const std::string tiled =
        mode == KdaMode::chunked ? fmt::format("{}, {} columns{}", shape, cuda::kda_chunked_scan_columns(B * H, K, K, 64),
                                               columns == kKdaAutoColumns ? " (automatic)" : "")
                                 : shape;
    auto leaf = [&](Shape s, uint64_t seed, double scale) {
      return mul_scalar(randn(s, DType::f32, seed), scale).to(kGpu).detach().set_requires_grad();
    };
    Tensor q = leaf({B, T, H, K}, 1, 0.1), k = leaf({B, T, H, K}, 2, 0.1), v = leaf({B, T, H, K}, 3, 1.0);
    Tensor g = leaf({B, T, H, K}, 4, 0.01), beta = leaf({B, T, H}, 5, 0.5);
    Tensor grad = randn({B, T, H, K}, DType::f32, 6).to(kGpu);
    // Chunked forward+backward FLOPs are dominated by the chunk GEMMs (docs/model.md#kda-chunked-form):
    // ~ 6 * B * T * 64 * K * H * 4.
    Row r{name, tiled, 0, 6.0 * B * T * 64 * K * H * 4};
    r.ms = time_ms(steps, [&] {
      KdaResult out = kda(q, k, v, g, beta, Tensor(), 1.0 / std::sqrt(static_cast<double>(K)), mode, 64);
      autograd::backward({out.o}, {grad});
      for (Tensor* t : {&q, &k, &v, &g, &beta}) t->zero_grad();
    });
    return r;
  });
}

// A training step as the trainer runs it on a GPU (Trainer::train_step, one rank,
// train.grad_accum 1): host token ids (the batch stays on the host; the embedding and
// the loss move what they need), forward and backward, the loss read back once (f64),
// the gradient norm and clipping (train.grad_clip 1.0, as the shipped configs), the
// finite checks of the loss and the norm, the update check (train.check_update, on by
// default: AdamW's read pass), then AdamW. A step whose loss, norm or update would not
// be finite throws (the row then says so): the trainer would skip it, the bench does
// not time skipped steps. The launches per step (core/launch_count.h) are counted over
// the timed steps: kernels and cuBLAS/cuBLASLt calls.
// bf16: train.dtype bf16 (bf16 parameters and activations, f32 master weights and
// moments, the parameters the trainer keeps in f32 kept so, the KDA state
// products on TF32 tensor cores); otherwise f32 with train.tf32. The FLOPs are
// the model's own count (6N + attention per token), so the datasheet column is
// the step's MFU. After the timed steps, `profiled` more run with the profiler on
// the device's event clock (core/profile.h): their per-component table is `table`.
// graphed: the forward and backward replayed from a CUDA graph, as train.cuda_graph
// on runs them (train/graph_step.h): the first step eager, the second captures and
// checks (neither timed), the timed ones replay; no profiled steps (a profiled run
// does not capture).
struct TrainResult {
  Row row;
  std::string table;
};

// The trainer's train.grad_clip (configs/gpt2-small.yaml, configs/k3-base.yaml).
constexpr double kBenchGradClip = 1.0;
constexpr double kBenchLr = 1e-4;

TrainResult train_row(const std::string& name, std::unique_ptr<LanguageModel> model, int64_t vocab, int64_t B,
                      int64_t T, int steps, bool bf16, int profiled, bool graphed = false) {
  const std::string shape = fmt::format("B{} T{} {}{}", B, T, bf16 ? "bf16 (f32 masters)" : "f32 (tf32 GEMMs and KDA products)",
                                        graphed ? ", CUDA graph" : "");
  if (graphed) profiled = 0;
  TrainResult out{Row{name + " train step", shape}, {}};
  out.row = guarded(name + " train step", shape, [&] {
    cuda::set_allow_tf32(!bf16);  // what train.tf32 sets
    cuda::set_kda_tensor_cores(true);
    AdamW opt(model->parameters(), {});
    for (const NamedParameter& p : model->parameters()) move_to_device_(p.tensor, kGpu);
    for (const Tensor& t : opt.exp_avg()) move_to_device_(t, kGpu);
    for (const Tensor& t : opt.exp_avg_sq()) move_to_device_(t, kGpu);
    if (bf16) opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
    Generator gen(7);
    // Host ids, as the trainer's batches (data::Batch: [B, T] i32 on the host).
    Tensor ids = randint({B, T}, vocab, DType::i32, gen), targets = randint({B, T}, vocab, DType::i32, gen);
    Row r{name + " train step", shape, 0, model->flops_per_token(T) * B * T, static_cast<double>(B * T)};
    auto forward_backward = [&](const Tensor& x, const Tensor& y) {
      Tensor loss = model->loss(x, y, true);
      Tensor loss_f64;
      {
        NoGradGuard no_grad;
        loss_f64 = loss.detach().to(DType::f64);
      }
      loss.backward();
      return loss_f64;
    };
    std::unique_ptr<GraphStep> graph;
    if (graphed)
      graph = std::make_unique<GraphStep>(*model, kGpu, CudaGraphMode::on,
                                          [&](const std::vector<Tensor>& x, const std::vector<Tensor>& y) {
                                            return forward_backward(x[0], y[0]);
                                          });
    int64_t taken = 0;
    auto step = [&] {  // the regions as the trainer names them
      {
        profile::Region region("optimizer");
        opt.zero_grad();
      }
      const Tensor loss_f64 =
          graph ? graph->run({data::Batch{ids, targets}}, taken++ > 0) : forward_backward(ids, targets);
      const double l = loss_f64.item<double>();  // the trainer's one wait for the GPU per step
      double norm = 0;
      {
        profile::Region region("grad sync+clip");
        norm = clip_grad_norm(model->parameters(), kBenchGradClip);
      }
      if (!std::isfinite(l) || !std::isfinite(norm))
        throw NumericalError(fmt::format("loss {}, gradient norm {}: the trainer would skip this step", l, norm));
      {
        profile::Region region("update check");
        if (std::optional<NonFiniteTensor> bad = opt.non_finite_update(kBenchLr))
          throw NumericalError(
              fmt::format("the update would make {}: the trainer would skip this step", describe(*bad)));
      }
      profile::Region region("optimizer");
      opt.step(kBenchLr);
    };
    step();  // the warm-up (its launches not counted: the first step allocates and plans)
    if (graph) step();  // the capture and its check
    cuda::synchronize(0);
    const LaunchCounts launches_from = launch_counts();
    r.ms = time_ms(steps, step, /*warm_up=*/false);
    r.launches_per_step = format_launches_per_step(launch_counts() - launches_from, steps, true);
    if (profiled > 0) {
      struct Off {  // a step that throws leaves the profiler off and on the host clock for the next rows
        ~Off() {
          try {
            profile::set_device_clock(nullptr);  // reads the events: a GPU in an error state throws here too
          } catch (const std::exception&) {
          }
        }
      } off;
      profile::set_device_clock(cuda::event_clock(0));
      profile::reset();
      profile::set_enabled(true);
      for (int s = 0; s < profiled; ++s) step();
      profile::set_enabled(false);
      out.table = profile::format_table(profile::entries(), profiled);
    }
    cuda::set_allow_tf32(false);
    cuda::set_kda_tensor_cores(false);
    return r;
  });
  return out;
}

// The router's expert selection for N tokens, E experts, top-k (f32 scores, a
// bias): on the GPU (select_experts on CUDA scores: the ids come back), and the
// host path it replaced (the scores copied back and ranked on the CPU), timed alike.
Row router_row(int64_t N, int64_t E, int64_t k, int steps, bool on_gpu) {
  const std::string shape = fmt::format("N{} E{} k{} f32 ({})", N, E, k, on_gpu ? "GPU" : "host: scores copied back, ranked on the CPU");
  return guarded("router selection", shape, [&] {
    Tensor scores = sigmoid(randn({N, E}, DType::f32, 3)).to(kGpu), bias = zeros({E}, DType::f32).to(kGpu);
    Row r{"router selection", shape, 0, 0, static_cast<double>(N)};
    r.ms = time_ms(steps, [&] {
      if (on_gpu)
        select_experts(scores, bias, k);
      else
        select_experts(scores.to(kCpu), bias.to(kCpu), k);
    });
    return r;
  });
}

// Memory-bound kernel families against the copy roofline: the bytes each must
// move at least (every input read once, every output written once, in the
// dtypes a bf16 run uses), over its time, as a share of what a device-to-device
// copy reaches in the same run. Forward and backward together where there is one.
struct BwRow {
  std::string name, shape;
  double ms = -1, bytes = 0;
  std::string note;
};

BwRow bw_guarded(const std::string& name, const std::string& shape, double bytes, const std::function<double()>& fn) {
  BwRow r{name, shape, -1, bytes, {}};
  try {
    r.ms = fn();
  } catch (const std::exception& e) {
    r.note = e.what();
    if (r.note.size() > 160) r.note = r.note.substr(0, 157) + "...";
  }
  return r;
}

Tensor bf16_leaf(Shape s, uint64_t seed) {
  return randn(s, DType::f32, seed).to(kGpu).to(DType::bf16).detach().set_requires_grad();
}

BwRow copy_row(int64_t bytes, int steps) {
  return bw_guarded("copy (roofline probe)", fmt::format("{} MiB device to device", bytes >> 20), 2.0 * bytes, [&] {
    Tensor a = empty({bytes / 4}, DType::f32, kGpu), b = empty({bytes / 4}, DType::f32, kGpu);
    return time_ms(steps, [&] { cuda::copy_device_to_device(b.raw_data(), a.raw_data(), bytes, 0); });
  });
}

BwRow layer_norm_row(int64_t N, int64_t D, int steps) {
  // forward reads x, writes y; backward reads dy and x, writes dx (w, b: D each, left out)
  return bw_guarded("layer_norm fwd+bwd", fmt::format("[{}, {}] bf16", N, D), 5.0 * N * D * 2, [&] {
    Tensor x = bf16_leaf({N, D}, 1), w = bf16_leaf({D}, 2), b = bf16_leaf({D}, 3);
    Tensor g = randn({N, D}, DType::f32, 4).to(kGpu).to(DType::bf16);
    return time_ms(steps, [&] {
      autograd::backward({layer_norm(x, w, b)}, {g});
      for (Tensor* t : {&x, &w, &b}) t->zero_grad();
    });
  });
}

BwRow cross_entropy_row(int64_t N, int64_t V, int steps) {
  // forward reads the logits; backward reads them again and writes their gradient
  return bw_guarded("cross_entropy fwd+bwd", fmt::format("[{}, {}] bf16 logits", N, V), 3.0 * N * V * 2, [&] {
    Tensor logits = bf16_leaf({N, V}, 5);
    Generator gen(8);
    Tensor targets = randint({N}, V, DType::i32, gen).to(kGpu);
    return time_ms(steps, [&] {
      cross_entropy(logits, targets).backward();
      logits.zero_grad();
    });
  });
}

BwRow embedding_row(int64_t N, int64_t V, int64_t D, int steps) {
  // forward gathers N rows and writes them; backward reads their gradient and
  // writes the [V, D] table's gradient once
  return bw_guarded("embedding fwd+bwd", fmt::format("{} ids into [{}, {}] bf16", N, V, D),
                    (3.0 * N * D + 1.0 * V * D) * 2, [&] {
    Tensor wte = bf16_leaf({V, D}, 6);
    Generator gen(9);
    Tensor ids = randint({N}, V, DType::i32, gen);  // host ids, as the trainer's batches
    Tensor g = randn({N, D}, DType::f32, 10).to(kGpu).to(DType::bf16);
    return time_ms(steps, [&] {
      autograd::backward({embedding(wte, ids)}, {g});
      wte.zero_grad();
    });
  });
}

BwRow adamw_row(int steps) {
  // per element: gradient read (2 bytes bf16, 4 f32), master or f32 weight read
  // and written, both moments read and written, the bf16 copy written
  Gpt2Config c;
  c.vocab_pad_multiple = 64;
  Gpt2 model(c, 1);
  double bytes = 0;
  for (const NamedParameter& p : model.parameters())
    bytes += static_cast<double>(p.tensor.numel()) * (stays_f32_in_mixed_precision(p) ? 28.0 : 2 + 8 + 8 + 8 + 2);
  return bw_guarded("AdamW step", fmt::format("GPT-2 small, {:.0f}M parameters, bf16 (f32 masters)",
                                              static_cast<double>(count_parameters(model.parameters())) / 1e6),
                    bytes, [&] {
    AdamW opt(model.parameters(), {});
    for (const NamedParameter& p : model.parameters()) move_to_device_(p.tensor, kGpu);
    for (const Tensor& t : opt.exp_avg()) move_to_device_(t, kGpu);
    for (const Tensor& t : opt.exp_avg_sq()) move_to_device_(t, kGpu);
    opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
    uint64_t seed = 11;
    for (const NamedParameter& p : model.parameters())
      p.tensor.set_grad(mul_scalar(randn(p.tensor.shape(), DType::f32, seed++), 1e-3).to(kGpu).to(p.tensor.dtype()));
    return time_ms(steps, [&] { opt.step(1e-4); });
  });
}

// Steps of each training row run again under the profiler for its component table.
constexpr int kProfiledSteps = 2;

// No CUDA device visible: as `moetrain info --require-cuda`, distinct from the loader's 127.
constexpr int kExitNoDevice = 69;

// Dense bf16 tensor-core peak of known GPUs (datasheet, without sparsity).
double datasheet_bf16_tflops(const std::string& name) {
  if (name.find("H200") != std::string::npos || name.find("H100") != std::string::npos) return 989.4;
  if (name.find("A100") != std::string::npos) return 312.0;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 10;
  std::string out_path, components_path, only;
  bool list = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc) out_path = argv[++i];
    else if (a == "--components" && i + 1 < argc) components_path = argv[++i];
    else if (a == "--case" && i + 1 < argc) only = argv[++i];
    else if (a == "--list") list = true;
    else {
      fmt::print(stderr,
                 "usage: moetrain_bench_cuda [--steps N] [--out FILE.md] [--components FILE.md] [--list | --case NAME]\n");
      return 2;
    }
  }
  // The cases, in the table's order; each prints its rows. Sections: 0 the compute
  // table (its header with the peak probe), 1 the memory-bound table, 2 the compute
  // table again (the f32 steps). With --case one runs alone (its own process: launch/
  // gpu-check.sh), its section's header printed when it is the section's first case.
  struct BenchCase {
    std::string name;
    int section;
    std::function<void()> run;
  };
  std::vector<BenchCase> cases;
  auto add = [&](std::string name, int section, std::function<void()> run) {
    cases.push_back({std::move(name), section, std::move(run)});
  };
  // Filled below, once the device is known; the cases only run after that.
  std::function<void(const Row&)> row;
  std::function<void(const BwRow&)> bw;
  std::function<void(TrainResult)> train;
  std::function<TrainResult(int64_t, bool, bool)> k3_row;
  std::function<void()> peak_rows;
  std::function<void(const BwRow&)> set_copy;

  add("peak", 0, [&] { peak_rows(); });
  for (int64_t B : {8, 16})
    add(fmt::format("gpt2-small train bf16 B{}", B), 0, [&, B] {
      Gpt2Config c;  // GPT-2 small, 124M, its head on the vocabulary padded to 50,304 (model.vocab_pad_multiple 64)
      c.vocab_pad_multiple = 64;
      train(train_row("gpt2-small (head 50304)", std::make_unique<Gpt2>(c, 1), c.vocab_size, B, 1024, steps, true,
                      kProfiledSteps));
    });
  add("k3-small train bf16 B4", 0, [&] { train(k3_row(4, true, false)); });
  add("k3-small train bf16 B4 graph", 0, [&] { train(k3_row(4, true, true)); });
  add("gpt2-small train bf16 B8 graph", 0, [&] {
    Gpt2Config c;
    c.vocab_pad_multiple = 64;
    train(train_row("gpt2-small (head 50304)", std::make_unique<Gpt2>(c, 1), c.vocab_size, 8, 1024, steps, true, 0,
                    true));
  });
  // GPT-2 small's GEMMs at B*T = 8192 tokens (qkv, attention proj, fc, mlp proj, head).
  const int64_t N = 8192;
  add("gemm gpt2 qkv", 0, [&] { row(gemm_row("gemm gpt2 qkv", DType::bf16, N, 2304, 768, steps)); });
  add("gemm gpt2 fc", 0, [&] { row(gemm_row("gemm gpt2 fc", DType::bf16, N, 3072, 768, steps)); });
  add("gemm gpt2 mlp proj", 0, [&] { row(gemm_row("gemm gpt2 mlp proj", DType::bf16, N, 768, 3072, steps)); });
  add("gemm gpt2 head", 0, [&] { row(gemm_row("gemm gpt2 head", DType::bf16, N, 50304, 768, steps)); });
  add("gemm gpt2 head unpadded", 0,
      [&] { row(gemm_row("gemm gpt2 head (unpadded vocab)", DType::bf16, N, 50257, 768, steps)); });
  add("gemm f32", 0, [&] { row(gemm_row("gemm f32", DType::f32, 8192, 8192, 8192, steps)); });
  add("gemm f32 tf32", 0, [&] { row(gemm_row("gemm f32", DType::f32, 8192, 8192, 8192, steps, true)); });
  for (bool tc : {true, false}) {  // k3-small's experts, then K3's 896 (latent 1024, d_ff 512 as a stand-in)
    add(fmt::format("moe grouped k3-small{}", tc ? "" : " cublas"), 0,
        [&, tc] { row(grouped_row(64, 8, 1024, 128, 112, steps, tc)); });
    add(fmt::format("moe grouped E896{}", tc ? "" : " cublas"), 0,
        [&, tc] { row(grouped_row(896, 16, 4096, 1024, 512, steps, tc)); });
  }
  for (int64_t T : {4096, 8192})
    add(fmt::format("attention tc T{}", T), 0, [&, T] { row(attention_row(T, 16, 128, steps)); });
  add("attention scalar T4096", 0, [&] { row(attention_row(4096, 16, 128, steps, false)); });
  for (int64_t T : {4096, 8192}) add(fmt::format("kda chunked T{}", T), 0, [&, T] { row(kda_row(T, steps)); });
  for (int64_t T : {4096, 8192})
    add(fmt::format("kda chunked tc T{}", T), 0, [&, T] { row(kda_row(T, steps, KdaMode::chunked, true)); });
  add("kda chunked tc T8192 cols16", 0,
      [&] { row(kda_row(8192, steps, KdaMode::chunked, true, 16)); });  // twice the scan blocks
  add("kda recurrent T4096", 0, [&] { row(kda_row(4096, steps, KdaMode::recurrent)); });
  for (bool tc : {false, true})
    add(fmt::format("kda chunked{} auto T8192", tc ? " tc" : ""), 0,
        [&, tc] { row(kda_row(8192, steps, KdaMode::chunked, tc, kKdaAutoColumns)); });
  for (bool tc : {false, true})
    add(fmt::format("kda chunked{} auto B8 T1024", tc ? " tc" : ""), 0,
        [&, tc] { row(kda_row(1024, steps, KdaMode::chunked, tc, kKdaAutoColumns, 8)); });
  add("kda chunked fixed B8 T1024", 0,
      [&] { row(kda_row(1024, steps, KdaMode::chunked, false, 0, 8)); });  // B8 on the fixed tile, beside the automatic one
  for (bool on_gpu : {true, false})
    add(fmt::format("router {}", on_gpu ? "gpu" : "host"), 0,
        [&, on_gpu] { row(router_row(8192, 896, 16, steps, on_gpu)); });  // K3's router
  // The memory-bound families, each against the copy rate of this run (the copy row first).
  add("memory copy", 1, [&] {
    const BwRow probe = copy_row(int64_t{1} << 30, steps);
    set_copy(probe);
    bw(probe);
  });
  add("memory layer_norm", 1, [&] { bw(layer_norm_row(8192, 768, steps)); });
  add("memory cross_entropy", 1, [&] { bw(cross_entropy_row(8192, 50304, steps)); });
  add("memory embedding", 1, [&] { bw(embedding_row(8192, 50304, 768, steps)); });
  add("memory adamw", 1, [&] { bw(adamw_row(steps)); });
  // The f32 step (TF32 GEMMs) beside the bf16 one: its MFU column is against the bf16 peak, so compare times.
  add("gpt2-small train f32 B8", 2, [&] {
    Gpt2Config c;
    c.vocab_pad_multiple = 64;
    train(train_row("gpt2-small (head 50304)", std::make_unique<Gpt2>(c, 1), c.vocab_size, 8, 1024, steps, false, 0));
  });
  add("k3-small train f32 B4", 2, [&] { train(k3_row(4, false, false)); });

  if (list) {  // no device needed
    for (const BenchCase& c : cases) fmt::print("{}\n", c.name);
    return 0;
  }
  const BenchCase* chosen = nullptr;
  for (const BenchCase& c : cases)
    if (c.name == only) chosen = &c;
  if (!only.empty() && !chosen) {
    fmt::print(stderr, "moetrain_bench_cuda: --case '{}' is not a case (--list names them)\n", only);
    return 2;
  }
  if (cuda::device_count() == 0) {
    fmt::print(stderr, "moetrain_bench_cuda: no CUDA device is visible\n");
    return kExitNoDevice;
  }
  cuda::set_device(0);
  const std::string gpu = cuda::device_name(0);
  // Each row is printed (and appended to --out) the moment it is measured, flushed:
  // a run stopped at a time limit keeps the rows it finished. With --case the files
  // are appended to (one process per case adds its rows to the table).
  const char* mode = chosen ? "a" : "w";
  std::FILE* out = out_path.empty() ? nullptr : std::fopen(out_path.c_str(), mode);
  std::FILE* components = components_path.empty() ? nullptr : std::fopen(components_path.c_str(), mode);
  for (const auto& [path, file] : {std::pair{out_path, out}, std::pair{components_path, components}})
    if (!path.empty() && !file) {
      fmt::print(stderr, "moetrain_bench_cuda: cannot write {}\n", path);
      return 2;
    }
  auto write = [](std::FILE* file, const std::string& text) {
    fmt::print("{}", text);
    std::fflush(stdout);
    if (file) {
      std::fputs(text.c_str(), file);
      std::fflush(file);
    }
  };
  auto emit = [&](const std::string& text) { write(out, text); };
  const double sheet = datasheet_bf16_tflops(gpu);
  const std::string compute_header =
      "| case | shape | ms | TFLOP/s | of peak | tokens/s | MFU (datasheet) | launches per step |\n"
      "|---|---|---|---|---|---|---|---|\n";
  // The peak: the best of a few large bf16 GEMMs, measured before the table starts (in
  // each --case process of the compute table too: its "of peak" column needs it).
  std::vector<Row> probes;
  double peak = 0;
  bool peak_measured = false;
  auto measure_peak = [&] {
    peak_measured = true;
    for (int64_t s : {4096, 8192, 16384})
      probes.push_back(gemm_row("gemm (peak probe)", DType::bf16, s, s, s, steps));
    for (const Row& r : probes)
      if (r.ms > 0) peak = std::max(peak, r.flops / (r.ms * 1e-3) / 1e12);
  };
  auto line = [&](const Row& r) {
    if (r.ms < 0) return fmt::format("| {} | {} | n/a | | | | {} | |\n", r.name, r.shape, r.note);
    if (r.flops == 0)  // bookkeeping, not FLOPs: the time and the rate only
      return fmt::format("| {} | {} | {:.3f} | | | {:.0f} | | |\n", r.name, r.shape, r.ms, r.tokens / (r.ms * 1e-3));
    double tf = r.flops / (r.ms * 1e-3) / 1e12;
    return fmt::format("| {} | {} | {:.3f} | {:.1f} | {:.0f}% | {} | {} | {} |\n", r.name, r.shape, r.ms, tf,
                       100 * tf / peak, r.tokens > 0 ? fmt::format("{:.0f}", r.tokens / (r.ms * 1e-3)) : "",
                       r.tokens > 0 && sheet > 0 ? fmt::format("{:.1f}%", 100 * tf / sheet) : "",
                       r.launches_per_step);
  };
  peak_rows = [&] {
    emit(fmt::format(
        "GPU: {}; peak = best bf16 cuBLAS GEMM of this run: {:.1f} TFLOP/s{}\n\n", gpu, peak,
        sheet > 0 ? fmt::format(" ({:.0f}% of the {:.1f} TFLOP/s datasheet bf16 dense peak)", 100 * peak / sheet, sheet)
                  : ""));
    emit(compute_header);
    for (const Row& r : probes) emit(line(r));
  };
  row = [&](const Row& r) { emit(line(r)); };
  // Training steps first (what the targets are about), each followed by its
  // per-component table in --components, then the kernel families.
  train = [&](TrainResult t) {
    row(t.row);
    if (!t.table.empty())
      write(components, fmt::format("{} {} ({} profiled steps, device time per step, ms)\n```\n{}\n```\n\n",
                                    t.row.name, t.row.shape, kProfiledSteps, t.table));
  };
  k3_row = [&](int64_t B, bool bf16, bool graphed) {
    TrainResult t{Row{"k3-small train step", fmt::format("B{} T1024", B)}, {}};
    t.row = guarded(t.row.name, t.row.shape, [&] {  // loading the config may fail too: the row says so
      const Config k3 = Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml");
      t = train_row("k3-small", build_model(k3), k3.get_int("model.vocab_size"), B, 1024, steps, bf16, kProfiledSteps,
                    graphed);
      return t.row;
    });
    return t;
  };
  double copy_gbs = 0;
  bool copy_measured = false;
  set_copy = [&](const BwRow& probe) {
    copy_gbs = probe.ms > 0 ? probe.bytes / (probe.ms * 1e-3) / 1e9 : 0;
    copy_measured = true;
  };
  bw = [&](const BwRow& r) {
    if (!copy_measured) set_copy(copy_row(int64_t{1} << 30, steps));  // a --case process: a silent copy first
    if (r.ms < 0) return emit(fmt::format("| {} | {} | n/a | | {} |\n", r.name, r.shape, r.note));
    const double gbs = r.bytes / (r.ms * 1e-3) / 1e9;
    emit(fmt::format("| {} | {} | {:.3f} | {:.0f} | {} |\n", r.name, r.shape, r.ms, gbs,
                     copy_gbs > 0 ? fmt::format("{:.0f}%", 100 * gbs / copy_gbs) : ""));
  };
  // Section headers: the compute table's comes with the peak rows; the others before
  // their section's first case (in a --case run, when the case is that first one).
  auto section_header = [&](int section) {
    if (section == 1) emit("\n| memory-bound case | shape | ms | GB/s | of copy |\n|---|---|---|---|---|\n");
    if (section == 2) emit("\n" + compute_header);
  };
  int previous = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const BenchCase& c = cases[i];
    if (chosen && chosen != &c) continue;
    if (c.section != 1 && !peak_measured) measure_peak();
    const bool first_of_section = i > 0 && cases[i - 1].section != c.section;
    if (chosen ? first_of_section : c.section != previous) section_header(c.section);
    previous = c.section;
    c.run();
  }
  if (out) std::fclose(out);
  if (components) std::fclose(components);
  return 0;
}
