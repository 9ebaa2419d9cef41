// The CPU speed harness (issue 8): each case against the machine's own limit,
// measured in the same process. For every case: ms per step (warm-up step, then
// the mean of --steps), tokens/s, GFLOP/s, the fraction of the f32 FMA peak that a
// probe measured at the start of this run, and per step the kernel (system) time
// and minor page faults (getrusage), so allocation churn shows. GPT-2 and KDA are
// also timed in PyTorch (Debian torch, /usr/bin/python3, same shapes and threads,
// environment as is) right after ours, with the ratio torch / ours.
//
//   build/moetrain_bench_cpu [--steps N] [--no-torch] [--no-profile] [--cases gemm,gpt2-64,...]
//   build/moetrain_bench_cpu --cases gemm,gemm-step --no-torch     (the f32 GEMM routes side by side)
//
// Cases (f32, default thread count = cores / ranks, MOETRAIN_NUM_THREADS to change):
//   gemm               f32 GEMM on GPT-2 step shapes on each GEMM route (openblas, blis, blis-threaded)
//   gemm-step          GPT-2 124M train steps (B=4, T=64) with the GEMM route switched between
//                      steps, in turn, --steps rounds: whole steps per route in one process
//   gpt2-64, gpt2-256  GPT-2 124M train step (forward, backward, AdamW) at B=4, T=64 / 256
//   k3-small           configs/k3-small.yaml train step at B=4, T=256, plus time per component
//   kda-2048, kda-8192 chunked KDA op forward+backward (bench/kda_case.h: B=1, H=4, K=V=64, chunk 64)
//   kda-2048-128, kda-8192-128   the same at K = V = 128
//   moe                the MoE layer of k3-small (EP=1) forward+backward on B·T = 1024 tokens
//   gemm-bf16          the gemm shapes on the f32 route in use, oneDNN f32 and oneDNN bf16 (f32 accumulation)
//   bf16-step-64, bf16-step-256   GPT-2 124M train steps at B=4, T=64 / 256, an f32 and a bf16
//                      model taking turns step by step (--steps rounds): on a shared machine a
//                      changing load falls on both alike; best and median ms per step
//   bf16-step-k3       k3-small steps at B=4, T=256, f32 and bf16 taking turns (as bf16-step-*)
//   gpt2-64-bf16, gpt2-256-bf16, k3-small-bf16, moe-bf16, kda-2048-bf16, kda-8192-bf16
//                      those cases in mixed precision (train.dtype bf16: bf16 parameters and
//                      activations, f32 masters and moments; docs/cuda.md, bf16 on the CPU); the
//                      kda ones run the op on bf16 inputs, which the trainer's KDA layer never
//                      does (it runs KDA in f32), so they show the widened op's cost
//   The bf16-step-* tables print each dtype's median CPU time (user + system) as well:
//   with MOETRAIN_NUM_THREADS=1 it is the work per step even on a loaded machine.
//   After the table, each case that ran oneDNN products lists its matmul calls per
//   timed step by oneDNN implementation (onednn::impl_counts): on an AMX CPU, what is
//   not "brg:avx512_core_amx..." does not use AMX.
// FLOP counts: the models' own flops_per_token (6N + attention), the KDA chunked
// FLOP model of bench/kda_case.h, and 3x the MoE layer's forward multiply-adds.
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "backend/cpu/allocator.h"
#include "backend/cpu/blas.h"
#include "backend/cpu/onednn.h"
#include "bench/harness.h"
#include "bench/kda_case.h"
#include "config/config.h"
#include "core/profile.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/hybrid.h"
#include "nn/moe.h"
#include "nn/parameters.h"
#include "ops/kda/kda.h"
#include "optim/adamw.h"
#include "train/model_source.h"

using namespace moetrain;
using namespace moetrain::bench;

namespace {

struct Result {
  std::string name;
  double ms = 0, tokens = 0, flops = 0;  // per step
  Usage usage;                           // per step
  double torch_ms = -1;
  std::map<std::string, int64_t> onednn_calls;  // oneDNN matmul calls over the timed steps, by implementation
};

// Warm-up step, then the mean of `steps`; usage per step over the timed steps.
Result measure(const std::string& name, int steps, double tokens, double flops, const std::function<void()>& step) {
  step();
  cpu::onednn::reset_impl_counts();
  Usage u0 = Usage::now();
  auto t0 = Clock::now();
  for (int s = 0; s < steps; ++s) step();
  double sec = seconds_since(t0) / steps;
  Usage du = Usage::now() - u0;
  Result r;
  r.onednn_calls = cpu::onednn::impl_counts();
  r.name = name;
  r.ms = sec * 1e3;
  r.tokens = tokens;
  r.flops = flops;
  r.usage = {du.user_s / steps, du.sys_s / steps, du.minor_faults / steps};
  return r;
}

// "brg:avx512_core_bf16 2,094, gemm:jit 6,912" per step.
std::string calls_text(const Result& r, int steps) {
  std::vector<std::string> parts;
  for (const auto& [impl, n] : r.onednn_calls)
    parts.push_back(fmt::format("{} {:.0f}", impl, static_cast<double>(n) / std::max(steps, 1)));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// Wall time per component of a step (profile regions, core/profile.h), by case.
std::vector<std::pair<std::string, std::string>> g_breakdowns;
bool g_profile = true;  // --no-profile: skip the profiled steps

// Runs `steps` more steps with the profiler on (not part of the timing) and keeps
// the table of time per component.
void profile_steps(const std::string& name, int steps, const std::function<void()>& step) {
  if (!g_profile) return;
  profile::reset();
  profile::set_enabled(true);
  for (int s = 0; s < steps; ++s) step();
  profile::set_enabled(false);
  g_breakdowns.emplace_back(name, profile::format_table(profile::entries(), steps));
}

// One training step with the optimizer's share marked.
void train_step(LanguageModel& model, AdamW& opt, const Tensor& ids, const Tensor& targets) {
  {
    profile::Region region("optimizer");
    opt.zero_grad();
  }
  model.loss(ids, targets).backward();
  profile::Region region("optimizer");
  opt.step(1e-4);
}

// Mixed precision as the trainer sets it up (Trainer::place_on_device).
void to_mixed_precision(Optimizer& opt) {
  opt.convert_to_bf16([](const NamedParameter& p) { return !stays_f32_in_mixed_precision(p); });
}

Result gpt2_case(int64_t B, int64_t T, int steps, bool torch, bool bf16 = false) {
  Gpt2Config config;  // GPT-2 small, 124M
  Gpt2 model(config, 1);
  AdamW opt(model.parameters(), {});
  if (bf16) to_mixed_precision(opt);
  Generator gen(7);
  Tensor ids = randint({B, T}, config.vocab_size, DType::i32, gen);
  Tensor targets = randint({B, T}, config.vocab_size, DType::i32, gen);
  auto step = [&] { train_step(model, opt, ids, targets); };
  Result r = measure(fmt::format("gpt2-{}{}", T, bf16 ? "-bf16" : ""), steps, static_cast<double>(B * T),
                     model.flops_per_token(T) * static_cast<double>(B * T), step);
  profile_steps(r.name, steps, step);
  if (torch && !bf16)
    r.torch_ms = torch_ms(fmt::format("gpt2_step_torch.py --batch {} --seq {} --steps {} --threads {}", B, T, steps,
                                      cpu::num_threads()));
  return r;
}

Result k3_case(int steps, bool bf16 = false) {
  Config config = Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml");
  std::unique_ptr<LanguageModel> model = build_model(config);
  AdamW opt(model->parameters(), {});
  if (bf16) to_mixed_precision(opt);
  const int64_t B = 4, T = 256;
  Generator gen(7);
  const int64_t vocab = config.get_int("model.vocab_size");
  Tensor ids = randint({B, T}, vocab, DType::i32, gen), targets = randint({B, T}, vocab, DType::i32, gen);
  auto step = [&] { train_step(*model, opt, ids, targets); };
  Result r = measure(bf16 ? "k3-small-bf16" : "k3-small", steps, static_cast<double>(B * T),
                     model->flops_per_token(T) * B * T, step);
  profile_steps(r.name, steps, step);
  return r;
}

// K = V = dim; scale K^-1/2 as the layer. bf16: the op on bf16 copies of the inputs
// (the trainer's KDA layer never calls it so: it runs KDA in f32, docs/model.md#mixed-precision).
Result kda_case(int64_t T, int64_t dim, int steps, bool torch, bool bf16 = false) {
  KdaInputs in = make_kda_inputs(T, dim, dim);
  if (bf16) {
    for (Tensor& t : in.leaves) {
      t = t.to(DType::bf16).detach();
      t.set_requires_grad(true);
    }
    in.grad_o = in.grad_o.to(DType::bf16);
  }
  const Tensors& x = in.leaves;
  const std::string name = (dim == kKdaK ? fmt::format("kda-{}", T) : fmt::format("kda-{}-{}", T, dim)) +
                           (bf16 ? "-bf16" : "");
  const double scale = 1.0 / std::sqrt(static_cast<double>(dim));
  Result r = measure(name, steps, static_cast<double>(T), kda_chunked_flops(T, dim, dim), [&] {
    KdaResult out = kda(x[0], x[1], x[2], x[3], x[4], Tensor(), scale, KdaMode::chunked, kKdaC);
    autograd::backward({out.o}, {in.grad_o});
    for (const Tensor& t : x) t.zero_grad();
  });
  if (torch && !bf16)
    r.torch_ms = torch_ms(fmt::format("kda_torch.py --seq {} --heads {} --dim {} --chunk {} --batch 1 --threads {} "
                                      "--steps {}",
                                      T, kKdaH, dim, kKdaC, cpu::num_threads(), steps));
  return r;
}

// bf16: the layer's parameters as a mixed-precision run has them (bf16 but for those
// that stay f32; AdamW's f32 masters), bf16 input.
Result moe_case(int steps, bool bf16 = false) {
  Config config = Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml");
  const HybridConfig hc = HybridConfig::from(config);  // k3-small's MoE layer as the model builds it
  const int64_t D = hc.d_model;
  const MoeConfig& c = hc.moe;
  ParamFactory f(true, DType::f32, 1);
  MoeLayer layer(c, D, hc.ffn, hc.init_std, f, "mlp.", {0, 1});
  const int64_t N = 4 * 256;
  AdamW opt(f.params(), {});
  if (bf16) to_mixed_precision(opt);
  Tensor x = randn({4, 256, D}, DType::f32, 100);
  if (bf16) x = x.to(DType::bf16).detach();
  x.set_requires_grad(true);
  const double L = static_cast<double>(c.latent_dim), F = static_cast<double>(c.expert_d_ff);
  const double per_token = 2.0 * D * static_cast<double>(c.num_experts)            // router
                           + 2.0 * D * L + 2.0 * L * D                             // latent down / up
                           + static_cast<double>(c.top_k) * 3 * 2 * L * F          // routed experts
                           + 3 * 2.0 * D * F * static_cast<double>(c.num_shared_experts);  // shared
  return measure(bf16 ? "moe-bf16" : "moe", steps, static_cast<double>(N), 3 * per_token * static_cast<double>(N), [&] {
    sum(layer.forward(x, true)).backward();
    x.zero_grad();
    for (const NamedParameter& p : f.params()) p.tensor.zero_grad();
  });
}

// The GEMMs of a GPT-2 step at B·T = 256 (and one square-ish shape): the gemm tables' rows.
struct GemmShape {
  int64_t m, k, n;
  bool ta, tb;
  const char* what;
};
constexpr GemmShape kGpt2GemmShapes[] = {{256, 768, 2304, false, true, "c_attn forward (x W^T)"},
                                         {256, 3072, 768, false, true, "mlp c_proj forward"},
                                         {256, 768, 50304, false, true, "lm head forward"},
                                         {256, 3072, 768, false, false, "dX = dY W (c_fc)"},
                                         {768, 256, 3072, true, false, "dW = dY^T X (c_fc)"},
                                         {50304, 256, 768, true, false, "lm head dW"},
                                         {1024, 768, 3072, false, false, "1024 x 768 x 3072"}};

// f32 GEMM on the shapes of a GPT-2 step at B·T = 256 (and one square-ish
// shape), on each route (backend/cpu/blas.h): best of 5, GFLOP/s and share of peak.
void gemm_table(double peak) {
  std::vector<cpu::GemmRoute> routes{cpu::GemmRoute::openblas};
  if (cpu::blis_available()) routes.insert(routes.end(), {cpu::GemmRoute::blis, cpu::GemmRoute::blis_threaded});
  const cpu::GemmRoute saved = cpu::gemm_route();
  fmt::print("\nf32 GEMM by route (GFLOP/s, share of the FMA peak; route in use: {}):\n",
             cpu::gemm_route_name(saved));
  std::string header = fmt::format("  {:<24} {:>17}", "shape", "M x K x N");
  for (cpu::GemmRoute route : routes) header += fmt::format(" {:>15}", cpu::gemm_route_name(route));
  fmt::print("{}\n", header);
  for (const GemmShape& s : kGpt2GemmShapes) {
    Tensor a = randn({s.ta ? s.k : s.m, s.ta ? s.m : s.k}, DType::f32, 1);
    Tensor b = randn({s.tb ? s.n : s.k, s.tb ? s.k : s.n}, DType::f32, 2), c = empty({s.m, s.n});
    std::string row = fmt::format("  {:<24} {:>17}", s.what, fmt::format("{}x{}x{}", s.m, s.k, s.n));
    for (cpu::GemmRoute route : routes) {
      cpu::set_gemm_route(route);
      double best = 1e30;
      for (int rep = 0; rep < 5; ++rep) {
        auto t0 = Clock::now();
        cpu::gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a.data<float>(), a.size(1), b.data<float>(), b.size(1), 0.f,
                  c.data<float>(), s.n);
        best = std::min(best, seconds_since(t0));
      }
      const double gflops = 2.0 * s.m * s.n * s.k / best / 1e9;
      row += fmt::format(" {:>7.1f} ({:>3.0f}%)", gflops, 100 * gflops / peak);
    }
    fmt::print("{}\n", row);
  }
  cpu::set_gemm_route(saved);
}

// The gemm table's shapes on the f32 route in use, oneDNN's f32 matmul and oneDNN's
// bf16 matmul (bf16 inputs, f32 accumulation and output): best of 5.
void gemm_bf16_table(double peak) {
  fmt::print("\nGEMM: f32 route {} vs {} f32 and bf16 (ISA {}; GFLOP/s, share of the f32 FMA peak):\n",
             cpu::gemm_route_name(cpu::gemm_route()), cpu::onednn::version(), cpu::onednn::effective_isa());
  fmt::print("  {:<24} {:>17} {:>15} {:>15} {:>15}  {}\n", "shape", "M x K x N",
             cpu::gemm_route_name(cpu::gemm_route()), "onednn f32", "onednn bf16", "bf16 impl");
  auto best_of = [](const std::function<void()>& fn) {
    double best = 1e30;
    fn();  // primitive creation
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = Clock::now();
      fn();
      best = std::min(best, seconds_since(t0));
    }
    return best;
  };
  for (const GemmShape& s : kGpt2GemmShapes) {
    Tensor a = randn({s.ta ? s.k : s.m, s.ta ? s.m : s.k}, DType::f32, 1);
    Tensor b = randn({s.tb ? s.n : s.k, s.tb ? s.k : s.n}, DType::f32, 2), c = empty({s.m, s.n});
    Tensor a16 = a.to(DType::bf16), b16 = b.to(DType::bf16);
    cpu::onednn::MatmulShape ms;
    ms.trans_a = s.ta, ms.trans_b = s.tb, ms.m = s.m, ms.n = s.n, ms.k = s.k, ms.lda = a.size(1), ms.ldb = b.size(1);
    ms.ldc = s.n;
    const double flop = 2.0 * s.m * s.n * s.k;
    const double t_route = best_of([&] {
      cpu::gemm(s.ta, s.tb, s.m, s.n, s.k, 1.f, a.data<float>(), a.size(1), b.data<float>(), b.size(1), 0.f,
                c.data<float>(), s.n);
    });
    const double t_f32 = best_of([&] {
      cpu::onednn::matmul(ms, DType::f32, a.data<float>(), b.data<float>(), DType::f32, c.data<float>());
    });
    const double t_bf16 = best_of([&] {
      cpu::onednn::matmul(ms, DType::bf16, a16.data<bf16>(), b16.data<bf16>(), DType::f32, c.data<float>());
    });
    auto cell = [&](double t) {
      return fmt::format("{:>7.1f} ({:>3.0f}%)", flop / t / 1e9, 100 * flop / t / 1e9 / peak);
    };
    fmt::print("  {:<24} {:>17} {:>15} {:>15} {:>15}  {}\n", s.what, fmt::format("{}x{}x{}", s.m, s.k, s.n),
               cell(t_route), cell(t_f32), cell(t_bf16), cpu::onednn::matmul_impl(s.m, s.n, s.k));
  }
}

// GPT-2 124M steps (B=4, T=64), the routes taking turns step by step, so that a
// changing load on a shared machine falls on all of them alike; best and median
// of `rounds` steps per route.
void gemm_step_table(int rounds) {
  std::vector<cpu::GemmRoute> routes{cpu::GemmRoute::openblas};
  if (cpu::blis_available()) routes.insert(routes.end(), {cpu::GemmRoute::blis, cpu::GemmRoute::blis_threaded});
  const cpu::GemmRoute saved = cpu::gemm_route();
  Gpt2Config config;
  Gpt2 model(config, 1);
  AdamW opt(model.parameters(), {});
  Generator gen(7);
  Tensor ids = randint({4, 64}, config.vocab_size, DType::i32, gen);
  Tensor targets = randint({4, 64}, config.vocab_size, DType::i32, gen);
  std::vector<std::vector<double>> ms(routes.size());
  train_step(model, opt, ids, targets);  // warm-up
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < routes.size(); ++i) {
      cpu::set_gemm_route(routes[i]);
      auto t0 = Clock::now();
      train_step(model, opt, ids, targets);
      ms[i].push_back(seconds_since(t0) * 1e3);
    }
  cpu::set_gemm_route(saved);
  fmt::print("\nGPT-2 124M step (B=4, T=64) by f32 GEMM route, {} rounds taking turns (ms per step):\n", rounds);
  fmt::print("  {:<15} {:>9} {:>9}   {}\n", "route", "best", "median", "all");
  for (size_t i = 0; i < routes.size(); ++i) {
    std::vector<double> v = ms[i];
    std::sort(v.begin(), v.end());
    fmt::print("  {:<15} {:>9.1f} {:>9.1f}   {:.0f}\n", cpu::gemm_route_name(routes[i]), v.front(), v[v.size() / 2],
               fmt::join(ms[i], " "));
  }
}

// Per-step wall and CPU (user + system, getrusage) milliseconds of two steps taking turns.
struct TurnTimes {
  std::vector<double> wall[2], cpu[2];
};

TurnTimes take_turns(int rounds, const std::function<void()>& f32_step, const std::function<void()>& bf16_step) {
  f32_step();  // warm-up
  bf16_step();
  TurnTimes t;
  const std::function<void()>* steps[2] = {&f32_step, &bf16_step};
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < 2; ++i) {
      const Usage u0 = Usage::now();
      const auto t0 = Clock::now();
      (*steps[i])();
      t.wall[i].push_back(seconds_since(t0) * 1e3);
      const Usage du = Usage::now() - u0;
      t.cpu[i].push_back((du.user_s + du.sys_s) * 1e3);
    }
  return t;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void print_turns(const std::string& title, const TurnTimes& t, int rounds) {
  fmt::print("\n{}, f32 and bf16 taking turns, {} rounds (ms per step; f32 GEMM {}, bf16 products {} {}; cpu = "
             "user + system time of the process, all threads):\n",
             title, rounds, cpu::gemm_route_name(cpu::gemm_route()), cpu::onednn::version(),
             cpu::onednn::effective_isa());
  fmt::print("  {:<6} {:>9} {:>9} {:>11}   {}\n", "dtype", "best", "median", "cpu median", "all");
  const char* names[2] = {"f32", "bf16"};
  double med[2], cpu_med[2];
  for (int i = 0; i < 2; ++i) {
    med[i] = median_of(t.wall[i]);
    cpu_med[i] = median_of(t.cpu[i]);
    fmt::print("  {:<6} {:>9.1f} {:>9.1f} {:>11.1f}   {:.0f}\n", names[i],
               *std::min_element(t.wall[i].begin(), t.wall[i].end()), med[i], cpu_med[i], fmt::join(t.wall[i], " "));
  }
  fmt::print("  bf16 speed-up (medians): {:.2f}x wall, {:.2f}x cpu\n", med[0] / med[1], cpu_med[0] / cpu_med[1]);
}

// GPT-2 124M steps at B=4, T, an f32 model and a bf16 one (mixed precision) taking
// turns, as gemm_step_table does for the GEMM routes.
void bf16_step_table(int64_t T, int rounds) {
  Gpt2Config config;
  Gpt2 f32_model(config, 1), bf16_model(config, 1);
  AdamW f32_opt(f32_model.parameters(), {}), bf16_opt(bf16_model.parameters(), {});
  to_mixed_precision(bf16_opt);
  Generator gen(7);
  Tensor ids = randint({4, T}, config.vocab_size, DType::i32, gen);
  Tensor targets = randint({4, T}, config.vocab_size, DType::i32, gen);
  const TurnTimes t = take_turns(
      rounds, [&] { train_step(f32_model, f32_opt, ids, targets); },
      [&] { train_step(bf16_model, bf16_opt, ids, targets); });
  print_turns(fmt::format("GPT-2 124M step (B=4, T={})", T), t, rounds);
}

// k3-small (configs/k3-small.yaml) steps at B=4, T=256, f32 and bf16 taking turns.
void bf16_k3_table(int rounds) {
  Config config = Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/k3-small.yaml");
  std::unique_ptr<LanguageModel> f32_model = build_model(config), bf16_model = build_model(config);
  AdamW f32_opt(f32_model->parameters(), {}), bf16_opt(bf16_model->parameters(), {});
  to_mixed_precision(bf16_opt);
  Generator gen(7);
  const int64_t vocab = config.get_int("model.vocab_size");
  Tensor ids = randint({4, 256}, vocab, DType::i32, gen), targets = randint({4, 256}, vocab, DType::i32, gen);
  const TurnTimes t = take_turns(
      rounds, [&] { train_step(*f32_model, f32_opt, ids, targets); },
      [&] { train_step(*bf16_model, bf16_opt, ids, targets); });
  print_turns("k3-small step (B=4, T=256)", t, rounds);
}

}  // namespace

int main(int argc, char** argv) {
  cpu::reexec_with_short_spin(argv);
  int steps = 3;
  bool torch = true;
  std::string cases = "gemm,gpt2-64,gpt2-256,k3-small,kda-2048,kda-8192,kda-2048-128,kda-8192-128,moe";
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (a == "--no-torch") torch = false;
    else if (a == "--no-profile") g_profile = false;
    else if (a == "--cases" && i + 1 < argc) cases = argv[++i];
    else {
      fmt::print(stderr, "usage: {} [--steps N] [--no-torch] [--no-profile] [--cases {}]\n", argv[0], cases);
      return 2;
    }
  }
  cpu::init_threads();
  const int threads = cpu::num_threads();
  const FmaPeak peak = fma_peak(threads);
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  fmt::print("CPU harness: {} threads, f32; FMA peak measured now: {:.1f} GFLOP/s ({} probe); BLAS: {}; OpenMP "
             "wait: {}\n",
             threads, peak.gflops, peak.isa, cpu::blas_name(),
             policy ? fmt::format("OMP_WAIT_POLICY={}", policy)
                    : fmt::format("GOMP_SPINCOUNT={}", spin ? spin : "libgomp default"));
  std::stringstream list(cases);
  bool header = false;
  std::vector<std::string> onednn_lines;  // per case with oneDNN products
  for (std::string name; std::getline(list, name, ',');) {
    Result r;
    if (name == "gemm") {
      gemm_table(peak.gflops);
      continue;
    }
    if (name == "gemm-bf16") {
      gemm_bf16_table(peak.gflops);
      continue;
    }
    if (name == "bf16-step-64" || name == "bf16-step-256") {
      bf16_step_table(name == "bf16-step-64" ? 64 : 256, steps);
      continue;
    }
    if (name == "bf16-step-k3") {
      bf16_k3_table(steps);
      continue;
    }
    if (name == "gemm-step") {
      gemm_step_table(steps);
      continue;
    }
    if (name == "gpt2-64") r = gpt2_case(4, 64, steps, torch);
    else if (name == "gpt2-256") r = gpt2_case(4, 256, steps, torch);
    else if (name == "k3-small") r = k3_case(steps);
    else if (name == "gpt2-64-bf16") r = gpt2_case(4, 64, steps, torch, true);
    else if (name == "gpt2-256-bf16") r = gpt2_case(4, 256, steps, torch, true);
    else if (name == "k3-small-bf16") r = k3_case(steps, true);
    else if (name == "kda-2048") r = kda_case(2048, kKdaK, steps, torch);
    else if (name == "kda-8192") r = kda_case(8192, kKdaK, steps, torch);
    else if (name == "kda-2048-128") r = kda_case(2048, 128, steps, torch);
    else if (name == "kda-8192-128") r = kda_case(8192, 128, steps, torch);
    else if (name == "moe") r = moe_case(steps);
    else if (name == "moe-bf16") r = moe_case(steps, true);
    else if (name == "kda-2048-bf16") r = kda_case(2048, kKdaK, steps, false, true);
    else if (name == "kda-8192-bf16") r = kda_case(8192, kKdaK, steps, false, true);
    else {
      fmt::print(stderr, "unknown case '{}'\n", name);
      return 2;
    }
    if (!header) {
      fmt::print("\n{:<13} {:>9} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9} {:>8}\n", "case", "ms/step", "tok/s", "GFLOP/s",
                 "of FMA", "sys ms", "faults", "torch ms", "torch/us");
      header = true;
    }
    const double gflops = r.flops / (r.ms / 1e3) / 1e9;
    fmt::print("{:<13} {:>9.1f} {:>8.0f} {:>8.1f} {:>6.0f}% {:>9.1f} {:>9} {:>9} {:>8}\n", r.name, r.ms,
               r.tokens / (r.ms / 1e3), gflops, 100 * gflops / peak.gflops, r.usage.sys_s * 1e3,
               r.usage.minor_faults, r.torch_ms > 0 ? fmt::format("{:.1f}", r.torch_ms) : "-",
               r.torch_ms > 0 ? fmt::format("{:.2f}x", r.torch_ms / r.ms) : "-");
    std::fflush(stdout);
    if (!r.onednn_calls.empty()) onednn_lines.push_back(fmt::format("  {:<13} {}", r.name, calls_text(r, steps)));
  }
  // Which of oneDNN's implementations ran the products: on an AMX CPU only brgemm
  // ("brg:avx512_core_amx...") uses AMX; gemm:jit never does (docs/performance.md).
  if (!onednn_lines.empty())
    fmt::print("\noneDNN matmul calls per timed step, by implementation (AMX: brg:avx512_core_amx only):\n{}\n",
               fmt::join(onednn_lines, "\n"));
  for (const auto& [name, table] : g_breakdowns)
    fmt::print("\n{} step by component (wall time, profiled steps after the timed ones):\n{}\n", name, table);
  const cpu::HostAllocatorStats a = cpu::host_allocator_stats();
  fmt::print("\nhost allocator: {} hits, {} misses (large blocks), {:.0f} MiB cached\n", a.hits, a.misses,
             static_cast<double>(a.cached_bytes) / (1 << 20));
  return 0;
}
