// The CUDA recurrent KDA / linear-attention kernel bodies (ops/kda/kda_simt.h), run
// on the host block by block (HostBlock: threads one after the other, phase by
// phase) against the CPU kernels. This runs on every machine: what a GPU run of
// kda_cuda.cu adds is the launch and the hardware's rounding, checked by the
// [cuda] cases in kda_test.cpp and linear_attention_test.cpp.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "moetrain.h"
#include "ops/kda/kda_kernels.h"
#include "ops/kda/kda_simt.h"
#include "ops/kda/kda_tc.h"
#include "ops/linear_attention/linear_attention_kernels.h"
#include "ops/simt_orders.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::rel_error;
using moetrain::testing::run_in_all_orders;
using simt::HostOrder;

namespace {

struct Dims {
  int64_t B, T, H, HV, K, V;
};

struct Problem {
  Tensor q, k, v, g, beta, h0, grad_o, grad_state;  // g, beta undefined for linear attention
};

// Random inputs in dtype: unit-scale q, k (divided by sqrt(K)), g = -0.5 e^{N(0,1)}
// (decays from mild to strong), β in (0, 1), a random h0 and upstream gradients.
Problem make_problem(const Dims& d, bool delta_rule, DType dtype, uint64_t seed) {
  const double inv = 1.0 / std::sqrt(static_cast<double>(d.K));
  Problem p;
  p.q = (randn({d.B, d.T, d.H, d.K}, DType::f64, seed) * inv).to(dtype);
  p.k = (randn({d.B, d.T, d.H, d.K}, DType::f64, seed + 1) * inv).to(dtype);
  p.v = randn({d.B, d.T, d.HV, d.V}, DType::f64, seed + 2).to(dtype);
  if (delta_rule) {
    std::vector<double> g = randn({d.B, d.T, d.HV, d.K}, DType::f64, seed + 3).to_vector();
    for (double& x : g) x = -0.5 * std::exp(x);
    p.g = from_vector(g, {d.B, d.T, d.HV, d.K}, DType::f64).to(dtype);
    std::vector<double> b = randn({d.B, d.T, d.HV}, DType::f64, seed + 4).to_vector();
    for (double& x : b) x = 1.0 / (1.0 + std::exp(-x));
    p.beta = from_vector(b, {d.B, d.T, d.HV}, DType::f64).to(dtype);
  }
  p.h0 = (randn({d.B, d.HV, d.K, d.V}, DType::f64, seed + 5) * 0.5).to(dtype);
  p.grad_o = randn({d.B, d.T, d.HV, d.V}, DType::f64, seed + 6).to(dtype);
  p.grad_state = randn({d.B, d.HV, d.K, d.V}, DType::f64, seed + 7).to(dtype);
  return p;
}

struct Results {
  Tensor o, state, checkpoints, grad_q, grad_k, grad_v, grad_g, grad_beta, grad_h0;
  long long forward_exps = 0, backward_exps = 0;  // run_chunked_bodies: the bodies' exp_a calls
};

// Shapes, scale and inputs of either body's arguments.
template <class T>
void set_inputs(simt::KdaInputs<T, T>& a, const Problem& p, const Dims& d, double scale) {
  a.B = d.B;
  a.Tn = d.T;
  a.H = d.H;
  a.HV = d.HV;
  a.K = d.K;
  a.V = d.V;
  a.scale = static_cast<T>(scale);
  a.q = p.q.data<T>();
  a.k = p.k.data<T>();
  a.v = p.v.data<T>();
  a.g = p.g.defined() ? p.g.data<T>() : nullptr;
  a.beta = p.beta.defined() ? p.beta.data<T>() : nullptr;
}

template <class T>
simt::KdaSimtArgs<T, T> recurrent_args(const Problem& p, const Dims& d, double scale, int64_t segment) {
  const bool delta_rule = p.g.defined();
  simt::KdaSimtArgs<T, T> a;
  set_inputs<T>(a, p, d, scale);
  a.segment = segment;
  a.delta_rule = delta_rule;
  return a;
}

// The backward body on the host from r.checkpoints (states every `segment` steps),
// then the group sums: fills r's gradients.
template <class T>
void run_backward_body(Results& r, const Problem& p, const Dims& d, double scale, int64_t segment, int threads,
                       HostOrder order) {
  const DType dt = dtype_v<T>;
  simt::KdaSimtArgs<T, T> a = recurrent_args<T>(p, d, scale, segment);
  const int64_t tasks = d.B * d.HV;
  Tensor states = empty({tasks, a.segment + 1, d.K, d.V}, dt), deltas = empty({tasks, a.segment, d.V}, dt);
  Tensor dS = empty({tasks, d.K, d.V}, dt), dq = empty({d.B, d.T, d.HV, d.K}, dt), dk = empty({d.B, d.T, d.HV, d.K}, dt);
  r.grad_q = empty(p.q.shape(), dt);
  r.grad_k = empty(p.k.shape(), dt);
  r.grad_v = empty(p.v.shape(), dt);
  r.grad_h0 = empty(p.h0.shape(), dt);
  a.checkpoints = r.checkpoints.data<T>();
  a.grad_o = p.grad_o.data<T>();
  a.grad_state = p.grad_state.data<T>();
  a.states = states.data<T>();
  a.deltas = deltas.data<T>();
  a.dS = dS.data<T>();
  a.dq = dq.data<T>();
  a.dk = dk.data<T>();
  a.grad_v = r.grad_v.data<T>();
  if (a.delta_rule) {
    r.grad_g = empty(p.g.shape(), dt);
    r.grad_beta = empty(p.beta.shape(), dt);
    a.grad_g = r.grad_g.data<T>();
    a.grad_beta = r.grad_beta.data<T>();
  }
  a.grad_state0 = r.grad_h0.data<T>();
  std::vector<T> shared(static_cast<size_t>(simt::kda_simt_shared_elements(d.K, d.V)));
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t task = 0; task < tasks; ++task) simt::kda_simt_backward(blk, a, task, shared.data());
  for (int64_t e = 0; e < p.q.numel(); ++e) {
    simt::group_sum_element(r.grad_q.data<T>(), dq.data<T>(), e, d.HV / d.H, d.K);
    simt::group_sum_element(r.grad_k.data<T>(), dk.data<T>(), e, d.HV / d.H, d.K);
  }
}

// The recurrent bodies on the host, blocks of `threads`, as kda_cuda.cu launches them.
template <class T>
Results run_bodies(const Problem& p, const Dims& d, double scale, int threads, HostOrder order) {
  const DType dt = dtype_v<T>;
  simt::KdaSimtArgs<T, T> a = recurrent_args<T>(p, d, scale, cpu::kKdaRecurrentSegment);
  const int64_t tasks = d.B * d.HV;
  Results r;
  r.o = empty(p.v.shape(), dt);
  r.state = p.h0.clone();
  r.checkpoints = empty({d.B, d.HV, a.segments(), d.K, d.V}, dt);
  Tensor work = empty({tasks, d.K, d.V}, dt);
  a.o = r.o.data<T>();
  a.state = r.state.data<T>();
  a.work = work.data<T>();
  a.checkpoints = r.checkpoints.data<T>();
  std::vector<T> shared(static_cast<size_t>(simt::kda_simt_shared_elements(d.K, d.V)));
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t task = 0; task < tasks; ++task) simt::kda_simt_forward(blk, a, task, shared.data());
  run_backward_body<T>(r, p, d, scale, a.segment, threads, order);
  return r;
}

// The chunked forward and backward bodies (chunks of C), as kda_cuda.cu runs kda_chunked;
// tensor_cores (T = float): the scans and the output by the bodies of ops/kda/kda_tc.h,
// kda_chunk_prepare and kda_chunk_grad with their tile products (HostTf32, blocks
// of 4 warps), as with cuda::set_kda_tensor_cores(true). columns: the scans' tile of
// columns of S (kda_scan_columns' choice on a GPU; a scalar scan block has that many
// threads); 0: `threads` (scalar), 32 where it divides V, else 16 (tensor cores).
template <class T>
Results run_chunked_bodies(const Problem& p, const Dims& d, double scale, int64_t C, int threads,
                           bool tensor_cores = false, HostOrder order = HostOrder::natural, int64_t columns = 0) {
  const DType dt = dtype_v<T>;
  simt::KdaChunkArgs<T, T> a;
  set_inputs<T>(a, p, d, scale);
  a.C = C;
  const int64_t tasks = d.B * d.HV, chunks = a.chunks();
  Results r;
  r.o = empty(p.v.shape(), dt);
  r.state = p.h0.clone();
  r.checkpoints = empty({d.B, d.HV, chunks, d.K, d.V}, dt);
  Tensor work = empty({tasks, d.K, d.V}, dt), gamma = empty({tasks, chunks, C, d.K}, DType::f64);
  Tensor Aqk = empty({tasks, chunks, C, C}, dt), N = empty({tasks, chunks, C, C}, dt);
  Tensor W = empty({tasks, chunks, C, d.K}, dt), Qd = empty({tasks, chunks, C, d.K}, dt),
         Kd = empty({tasks, chunks, C, d.K}, dt);
  Tensor U = empty({tasks, chunks, C, d.V}, dt), Vnew = empty({tasks, chunks, C, d.V}, dt),
         decay = empty({tasks, chunks, d.K}, dt);
  a.o = r.o.data<T>();
  a.state = r.state.data<T>();
  a.work = work.data<T>();
  a.states = r.checkpoints.data<T>();
  a.gamma = gamma.data<double>();
  a.Aqk = Aqk.data<T>();
  a.N = N.data<T>();
  a.W = W.data<T>();
  a.Qd = Qd.data<T>();
  a.Kd = Kd.data<T>();
  a.U = U.data<T>();
  a.Vnew = Vnew.data<T>();
  a.decay = decay.data<T>();
  const simt::HostBlock blk = testing::host_block(threads, order);
  const simt::HostBlock tc_blk = testing::host_block(simt::kKdaTcThreads, order);
  const int64_t BV = columns > 0 ? columns : tensor_cores ? (d.V % 32 == 0 ? 32 : 16) : threads;
  const simt::HostBlock scan_blk = testing::host_block(static_cast<int>(BV), order);
  std::vector<T> shared(static_cast<size_t>(simt::kda_chunk_shared_elements(C)));
  auto prepare = [&](int64_t task, int64_t n) {
    if constexpr (std::is_same_v<T, float>) {
      if (tensor_cores) return simt::kda_chunk_prepare<simt::HostTf32>(tc_blk, a, task, n, shared.data());
    }
    simt::kda_chunk_prepare(blk, a, task, n, shared.data());
  };
  const long long exps0 = simt::host_exp_calls;
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t n = 0; n < chunks; ++n) prepare(task, n);
  std::vector<float> tc_shared;
  if constexpr (std::is_same_v<T, float>) {
    if (tensor_cores) {
      tc_shared.resize(static_cast<size_t>(std::max({simt::kda_tc_scan_shared_elements(d.K, C, BV),
                                                     simt::kda_tc_backward_scan_shared_elements(d.K, C, BV),
                                                     simt::kda_tc_output_shared_elements(C, d.V)})));
      for (int64_t task = 0; task < tasks; ++task)
        for (int64_t column0 = 0; column0 < d.V; column0 += BV)
          simt::kda_chunk_scan_tc<simt::HostTf32>(tc_blk, a, task, column0, BV, tc_shared.data());
      for (int64_t task = 0; task < tasks; ++task)
        for (int64_t n = 0; n < chunks; ++n) simt::kda_chunk_output_tc<simt::HostTf32>(tc_blk, a, task, n, tc_shared.data());
    }
  }
  if (!tensor_cores) {
    for (int64_t task = 0; task < tasks; ++task)
      for (int64_t column0 = 0; column0 < d.V; column0 += BV) simt::kda_chunk_scan(scan_blk, a, task, column0);
    for (int64_t task = 0; task < tasks; ++task)
      for (int64_t n = 0; n < chunks; ++n) simt::kda_chunk_output(blk, a, task, n);
  }
  r.forward_exps = simt::host_exp_calls - exps0;

  // Backward: prepare again (with A^kk's β-free part), scan back, then every chunk.
  auto chunk_tensor = [&](int64_t per) { return empty({tasks, chunks, per}, dt); };
  Tensor Ekk = chunk_tensor(C * C), dS = empty({tasks, d.K, d.V}, dt), dS_exit = chunk_tensor(d.K * d.V),
         dVnew = chunk_tensor(C * d.V);
  Tensor dW = chunk_tensor(C * d.K), dKd = chunk_tensor(C * d.K), dOS = chunk_tensor(C * d.K),
         dKe = chunk_tensor(C * d.K), dgamma = chunk_tensor(C * d.K);
  Tensor dAqk = chunk_tensor(C * C), dTm = chunk_tensor(C * C), Y = chunk_tensor(C * C), dAkk = chunk_tensor(C * C),
         dbeta = chunk_tensor(2 * C);
  Tensor dq = empty({d.B, d.T, d.HV, d.K}, dt), dk = empty({d.B, d.T, d.HV, d.K}, dt);
  r.grad_q = empty(p.q.shape(), dt);
  r.grad_k = empty(p.k.shape(), dt);
  r.grad_v = empty(p.v.shape(), dt);
  r.grad_g = empty(p.g.shape(), dt);
  r.grad_beta = empty(p.beta.shape(), dt);
  r.grad_h0 = empty(p.h0.shape(), dt);
  a.Ekk = Ekk.data<T>();
  a.grad_o = p.grad_o.data<T>();
  a.grad_state = p.grad_state.data<T>();
  a.dS = dS.data<T>();
  a.dS_exit = dS_exit.data<T>();
  a.dVnew = dVnew.data<T>();
  a.dW = dW.data<T>();
  a.dKd = dKd.data<T>();
  a.dOS = dOS.data<T>();
  a.dKe = dKe.data<T>();
  a.dgamma = dgamma.data<T>();
  a.dAqk = dAqk.data<T>();
  a.dTm = dTm.data<T>();
  a.Y = Y.data<T>();
  a.dAkk = dAkk.data<T>();
  a.dbeta = dbeta.data<T>();
  a.dq = dq.data<T>();
  a.dk = dk.data<T>();
  a.grad_v = r.grad_v.data<T>();
  a.grad_g = r.grad_g.data<T>();
  a.grad_beta = r.grad_beta.data<T>();
  a.grad_state0 = r.grad_h0.data<T>();
  const long long exps1 = simt::host_exp_calls;
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t n = 0; n < chunks; ++n) prepare(task, n);
  if constexpr (std::is_same_v<T, float>) {
    if (tensor_cores)
      for (int64_t task = 0; task < tasks; ++task)
        for (int64_t column0 = 0; column0 < d.V; column0 += BV)
          simt::kda_chunk_backward_scan_tc<simt::HostTf32>(tc_blk, a, task, column0, BV, tc_shared.data());
  }
  if (!tensor_cores)
    for (int64_t task = 0; task < tasks; ++task)
      for (int64_t column0 = 0; column0 < d.V; column0 += BV)
        simt::kda_chunk_backward_scan(scan_blk, a, task, column0);
  for (int64_t task = 0; task < tasks; ++task)
    for (int64_t n = 0; n < chunks; ++n) {
      if constexpr (std::is_same_v<T, float>) {
        if (tensor_cores) {
          simt::kda_chunk_grad<simt::HostTf32>(tc_blk, a, task, n);
          continue;
        }
      }
      simt::kda_chunk_grad(blk, a, task, n);
    }
  r.backward_exps = simt::host_exp_calls - exps1;
  for (int64_t e = 0; e < p.q.numel(); ++e) {
    simt::group_sum_element(r.grad_q.data<T>(), dq.data<T>(), e, d.HV / d.H, d.K);
    simt::group_sum_element(r.grad_k.data<T>(), dk.data<T>(), e, d.HV / d.H, d.K);
  }
  return r;
}

// Every output and gradient bit for bit (run_in_all_orders compares the orders by it).
bool same_bits(const Results& a, const Results& b) {
  return testing::same_bits(
      {&a.o, &a.state, &a.checkpoints, &a.grad_q, &a.grad_k, &a.grad_v, &a.grad_g, &a.grad_beta, &a.grad_h0},
      {&b.o, &b.state, &b.checkpoints, &b.grad_q, &b.grad_k, &b.grad_v, &b.grad_g, &b.grad_beta, &b.grad_h0});
}

// The CPU chunked kernels (chunks of C) on the same problem.
Results run_cpu_chunked(const Problem& p, const Dims& d, double scale, int64_t C) {
  Results r;
  const DType dt = p.q.dtype();
  r.o = empty(p.v.shape(), dt);
  r.state = p.h0.clone();
  r.checkpoints = empty({d.B, d.HV, cpu::kda_num_segments(d.T, C), d.K, d.V}, dt);
  cpu::kda_chunked_forward(r.o, r.state, &r.checkpoints, p.q, p.k, p.v, p.g, p.beta, scale, C);
  r.grad_q = empty(p.q.shape(), dt);
  r.grad_k = empty(p.k.shape(), dt);
  r.grad_v = empty(p.v.shape(), dt);
  r.grad_g = empty(p.g.shape(), dt);
  r.grad_beta = empty(p.beta.shape(), dt);
  r.grad_h0 = empty(p.h0.shape(), dt);
  cpu::kda_chunked_backward(r.grad_q, r.grad_k, r.grad_v, r.grad_g, r.grad_beta, r.grad_h0, p.grad_o, p.grad_state,
                            p.q, p.k, p.v, p.g, p.beta, r.checkpoints, scale, C);
  return r;
}

// The CPU recurrent kernels on the same problem.
Results run_cpu(const Problem& p, const Dims& d, double scale) {
  Results r;
  const DType dt = p.q.dtype();
  r.o = empty(p.v.shape(), dt);
  r.state = p.h0.clone();
  r.grad_q = empty(p.q.shape(), dt);
  r.grad_k = empty(p.k.shape(), dt);
  r.grad_v = empty(p.v.shape(), dt);
  r.grad_h0 = empty(p.h0.shape(), dt);
  if (p.g.defined()) {
    r.checkpoints = empty({d.B, d.HV, cpu::kda_num_segments(d.T, cpu::kKdaRecurrentSegment), d.K, d.V}, dt);
    cpu::kda_recurrent_forward(r.o, r.state, &r.checkpoints, p.q, p.k, p.v, p.g, p.beta, scale);
    r.grad_g = empty(p.g.shape(), dt);
    r.grad_beta = empty(p.beta.shape(), dt);
    cpu::kda_recurrent_backward(r.grad_q, r.grad_k, r.grad_v, r.grad_g, r.grad_beta, r.grad_h0, p.grad_o,
                                p.grad_state, p.q, p.k, p.v, p.g, p.beta, r.checkpoints, scale);
  } else {
    cpu::linear_attention_recurrent_forward(r.o, r.state, p.q, p.k, p.v);
    cpu::linear_attention_recurrent_backward(r.grad_q, r.grad_k, r.grad_v, r.grad_h0, p.grad_o, p.grad_state, p.q,
                                             p.k, p.v, p.h0);
  }
  return r;
}

void compare(const Results& simt, const Results& ref, double tol) {
  const char* names[] = {"o", "state", "checkpoints", "grad_q", "grad_k", "grad_v", "grad_g", "grad_beta", "grad_h0"};
  const Tensor* a[] = {&simt.o, &simt.state, &simt.checkpoints, &simt.grad_q, &simt.grad_k,
                       &simt.grad_v, &simt.grad_g, &simt.grad_beta, &simt.grad_h0};
  const Tensor* b[] = {&ref.o, &ref.state, &ref.checkpoints, &ref.grad_q, &ref.grad_k,
                       &ref.grad_v, &ref.grad_g, &ref.grad_beta, &ref.grad_h0};
  for (int i = 0; i < 9; ++i) {
    if (!b[i]->defined()) continue;  // linear attention: no checkpoints, g or beta on the CPU side
    INFO(fmt::format("{} {}", names[i], b[i]->shape()));
    REQUIRE(a[i]->shape() == b[i]->shape());
    CHECK(rel_error(*a[i], *b[i]) <= tol);
  }
}

// Off the segment (64) and block-size boundaries: several segments with a short
// last one, K and V below, at and above the thread count, grouped value heads.
const Dims kShapes[] = {
    {2, 70, 2, 4, 20, 12},   // G = 2, two segments
    {1, 129, 1, 1, 7, 33},   // three segments, V > K
    {1, 1, 1, 3, 5, 4},      // one step, G = 3
    {2, 64, 1, 2, 16, 16},   // exactly one segment
};

}  // namespace

TEST_CASE("kda: the CUDA kernel bodies, run on the host, match the CPU recurrent kernels", "[ops][kda][simt]") {
  for (const Dims& d : kShapes) {
    for (int threads : {1, 8, 32}) {
      DYNAMIC_SECTION("B" << d.B << " T" << d.T << " H" << d.H << " HV" << d.HV << " K" << d.K << " V" << d.V
                          << " threads " << threads) {
        const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
        Problem p64 = make_problem(d, true, DType::f64, 11);
        compare(run_in_all_orders([&](HostOrder o) { return run_bodies<double>(p64, d, scale, threads, o); }),
                run_cpu(p64, d, scale), 1e-12);
        Problem p32 = make_problem(d, true, DType::f32, 11);
        compare(run_in_all_orders([&](HostOrder o) { return run_bodies<float>(p32, d, scale, threads, o); }),
                run_cpu(p32, d, scale), 2e-5);
      }
    }
  }
}

TEST_CASE("kda: the CUDA chunked kernel bodies, run on the host, match the CPU chunked kernels",
          "[ops][kda][simt]") {
  for (const Dims& d : kShapes) {
    for (int64_t C : {16, 64}) {
      for (int threads : {1, 8, 32}) {
        DYNAMIC_SECTION("B" << d.B << " T" << d.T << " H" << d.H << " HV" << d.HV << " K" << d.K << " V" << d.V
                            << " chunk " << C << " threads " << threads) {
          const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
          Problem p64 = make_problem(d, true, DType::f64, 31);
          compare(run_in_all_orders(
                      [&](HostOrder o) { return run_chunked_bodies<double>(p64, d, scale, C, threads, false, o); }),
                  run_cpu_chunked(p64, d, scale, C), 1e-10);
          // f32 against the f64 reference: both forms round differently in f32.
          Problem p32 = make_problem(d, true, DType::f32, 31);
          Results ref = run_cpu_chunked(p64, d, scale, C);
          Results got = run_in_all_orders(
              [&](HostOrder o) { return run_chunked_bodies<float>(p32, d, scale, C, threads, false, o); });
          compare(got, ref, 2e-4);
        }
      }
    }
  }
}

TEST_CASE("linear_attention: the CUDA kernel bodies, run on the host, match the CPU recurrent kernels",
          "[ops][linear_attention][simt]") {
  for (const Dims& d0 : kShapes) {
    const Dims d{d0.B, d0.T, d0.HV, d0.HV, d0.K, d0.V};  // no grouped heads
    for (int threads : {1, 8, 32}) {
      DYNAMIC_SECTION("B" << d.B << " T" << d.T << " H" << d.H << " K" << d.K << " V" << d.V << " threads "
                          << threads) {
        Problem p64 = make_problem(d, false, DType::f64, 21);
        compare(run_in_all_orders([&](HostOrder o) { return run_bodies<double>(p64, d, 1.0, threads, o); }),
                run_cpu(p64, d, 1.0), 1e-12);
        Problem p32 = make_problem(d, false, DType::f32, 21);
        compare(run_in_all_orders([&](HostOrder o) { return run_bodies<float>(p32, d, 1.0, threads, o); }),
                run_cpu(p32, d, 1.0), 2e-5);
      }
    }
  }
}

TEST_CASE("kda: the CUDA chunked bodies take exps per row and channel, not per pair and channel",
          "[ops][kda][simt]") {
  // Two full chunks of C = 64 (four sub-chunks of S = 16). Per chunk and channel the
  // bodies may take: pairs inside a sub-chunk directly, subs·S(S+1)/2 (forward: A^qk/A^kk;
  // backward: their rows and columns again, twice that); the middle factors, one per
  // pair of sub-chunks; and at most five exps per row in each direction (forward: the
  // two factored rows, K ⊙ e^γ, Q̄ ⊙ e^γ, K ⊙ e^{γ_C - γ}; backward: K ⊙ e^γ, the two
  // factored rows, e^γ, e^{γ_C - γ}), plus e^{γ_C}. The backward runs prepare again.
  // One exp per pair and channel would be C(C+1)/2 = 2080 for A^qk alone.
  const Dims d{1, 128, 1, 1, 32, 16};
  const int64_t C = 64, S = simt::kKdaSubChunk, subs = C / S, chunks = 2;
  const int64_t inside = subs * S * (S + 1) / 2, middle = subs * (subs - 1) / 2;
  const int64_t forward = inside + middle + 5 * C + 1, backward = forward + 2 * inside + middle + 5 * C;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
  Problem p = make_problem(d, true, DType::f32, 41);
  Results r = run_chunked_bodies<float>(p, d, scale, C, 32);
  INFO("forward " << r.forward_exps << " backward " << r.backward_exps << " exps");
  CHECK(r.forward_exps <= forward * d.K * chunks);
  CHECK(r.backward_exps <= backward * d.K * chunks);
  // Still right: the CPU chunked kernels in f64.
  compare(r, run_cpu_chunked(make_problem(d, true, DType::f64, 41), d, scale, C), 2e-4);
}

TEST_CASE("kda: the tensor-core chunked bodies (TF32), run on the host, match the CPU chunked kernels",
          "[ops][kda][simt]") {
  // K, V and C multiples of 16 (the tensor-core shapes): short last chunks, grouped
  // value heads, V a multiple of 32 (tiles of 32 columns, one or two) or only of 16.
  const Dims shapes[] = {
      {2, 70, 2, 4, 32, 16}, {1, 129, 1, 1, 16, 48}, {1, 150, 1, 2, 64, 32}, {1, 80, 1, 1, 16, 64}};
  for (const Dims& d : shapes)
    for (int64_t C : {16, 64})
      DYNAMIC_SECTION("B" << d.B << " T" << d.T << " H" << d.H << " HV" << d.HV << " K" << d.K << " V" << d.V
                          << " chunk " << C) {
        REQUIRE(simt::kda_tc_shape_ok(d.K, d.V, C));
        const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
        Problem p32 = make_problem(d, true, DType::f32, 51);
        const Results ref = run_cpu_chunked(make_problem(d, true, DType::f64, 51), d, scale, C);
        const Results scalar = run_chunked_bodies<float>(p32, d, scale, C, 32);
        const Results tc =
            run_in_all_orders([&](HostOrder o) { return run_chunked_bodies<float>(p32, d, scale, C, 32, true, o); });
        // TF32 operands (11 significant bits) against f32 ones: ~1e-3 relative.
        compare(scalar, ref, 2e-4);
        compare(tc, ref, 5e-3);
        CHECK(rel_error(tc.o, ref.o) > 1e-6);  // the TF32 path ran: it rounds differently
      }
}

TEST_CASE("kda: the chunked scans give the same bits on every column tile, forward and gradients",
          "[ops][kda][simt]") {
  // A scan block takes a tile of columns of S (kda_cuda.cu picks it with
  // kda_scan_columns); every column is scanned alone, in the same order, so the
  // tile may not change a bit. Each tile in the three thread orders against the CPU
  // chunked kernels, then the tiles against each other. Scalar tiles of 64 to 8
  // columns, V off them (12, 20, 33: a last tile partly idle) and the K3 head
  // (K = V = 128); tensor-core tiles of 32 and 16 where they divide V (48: 16 only).
  const Dims shapes[] = {
      {2, 70, 2, 4, 20, 12}, {1, 129, 1, 1, 7, 33}, {1, 70, 1, 2, 16, 20}, {1, 80, 1, 1, 128, 128}};
  for (const Dims& d : shapes) {
    DYNAMIC_SECTION("scalar B" << d.B << " T" << d.T << " H" << d.H << " HV" << d.HV << " K" << d.K << " V" << d.V) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
      const Problem p64 = make_problem(d, true, DType::f64, 61), p32 = make_problem(d, true, DType::f32, 61);
      const Results ref = run_cpu_chunked(p64, d, scale, 64);
      Results first64, first32;
      for (int64_t columns : {64, 32, 16, 8}) {
        INFO("columns " << columns);
        Results r64 = run_in_all_orders(
            [&](HostOrder o) { return run_chunked_bodies<double>(p64, d, scale, 64, 32, false, o, columns); });
        Results r32 = run_in_all_orders(
            [&](HostOrder o) { return run_chunked_bodies<float>(p32, d, scale, 64, 32, false, o, columns); });
        compare(r64, ref, 1e-10);
        compare(r32, ref, 2e-4);
        if (columns == 64) {
          first64 = r64;
          first32 = r32;
        }
        CHECK(same_bits(r64, first64));
        CHECK(same_bits(r32, first32));
      }
    }
  }
  const Dims tc_shapes[] = {{1, 129, 1, 1, 16, 48}, {1, 150, 1, 2, 64, 32}, {1, 80, 1, 1, 128, 128}};
  for (const Dims& d : tc_shapes) {
    DYNAMIC_SECTION("tensor cores B" << d.B << " T" << d.T << " H" << d.H << " HV" << d.HV << " K" << d.K << " V"
                                     << d.V) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(d.K));
      const Problem p32 = make_problem(d, true, DType::f32, 62);
      const Results ref = run_cpu_chunked(make_problem(d, true, DType::f64, 62), d, scale, 64);
      Results first;
      int tiles = 0;
      for (int64_t columns : {32, 16}) {
        if (d.V % columns != 0) continue;  // the tensor-core scans take whole tiles only
        INFO("columns " << columns);
        Results r = run_in_all_orders(
            [&](HostOrder o) { return run_chunked_bodies<float>(p32, d, scale, 64, 32, true, o, columns); });
        compare(r, ref, 5e-3);
        CHECK(rel_error(r.o, ref.o) > 1e-6);  // the TF32 path ran
        if (tiles++ == 0) first = r;
        CHECK(same_bits(r, first));
      }
      CHECK(tiles == (d.V % 32 == 0 ? 2 : 1));
    }
  }
}

TEST_CASE("kda: the chunked scans' column tile gives two blocks per multiprocessor where the shape allows",
          "[ops][kda][simt]") {
  using simt::KdaScanPath;
  const KdaScanPath scalar = KdaScanPath::scalar, tc = KdaScanPath::tensor_cores;
  // An H200 (132 multiprocessors: 264 blocks wanted), tasks = B x H: the realistic
  // shapes of docs/cuda.md's table, worked out by hand. B1 H16 V128: 16 tasks of 128
  // columns have at most 256 scalar tiles of 8, 128 tensor-core tiles of 16: the
  // narrowest. B8: 128 tasks, tiles of 64 give 256 < 264, of 32 give 512.
  struct Case {
    int64_t B, H, V, scalar_columns, tc_columns;
  };
  const Case cases[] = {
      {1, 16, 128, 8, 16},  // bench's B1 T8192
      {8, 16, 128, 32, 32},  // bench's B8 T1024
      {2, 16, 128, 8, 16},   // 32 tasks: scalar 16 gives 256 < 264
      {1, 32, 64, 8, 16},    // 32 tasks of 64 columns
      {8, 4, 64, 8, 16},     // k3-small (B8, 4 heads of 64)
      {1, 96, 128, 32, 32},  // kimi-k3 (96 heads): 64 gives 192
      {8, 32, 64, 32, 32},   // 256 tasks: 64 gives 256 < 264
  };
  for (const Case& c : cases) {
    INFO("B" << c.B << " H" << c.H << " V" << c.V);
    CHECK(simt::kda_scan_columns(c.B * c.H, c.V, 132, scalar) == c.scalar_columns);
    CHECK(simt::kda_scan_columns(c.B * c.H, c.V, 132, tc) == c.tc_columns);
  }
  // The rule over many shapes, with the block count worked out here: a tile the path
  // takes (scalar: 8..64, at most V rounded up to 8; tensor cores: 16 or 32 dividing
  // V), at least 2 x SMs blocks unless no tile gets there (then the narrowest), and no
  // wider tile that also gets there.
  const int64_t scalar_tiles[] = {64, 32, 16, 8}, tc_tiles[] = {32, 16};
  for (int64_t sms : {1, 16, 108, 132})
    for (int64_t tasks : {1, 2, 3, 8, 16, 17, 32, 64, 96, 128, 256, 300})
      for (int64_t V = 1; V <= 256; V += (V < 40 ? 1 : 8))
        for (KdaScanPath path : {scalar, tc}) {
          if (path == tc && V % 16 != 0) continue;  // kda_tc_shape_ok
          const int64_t columns = simt::kda_scan_columns(tasks, V, sms, path);
          INFO("sms " << sms << " tasks " << tasks << " V " << V << " tensor cores " << (path == tc) << " columns "
                      << columns);
          auto blocks = [&](int64_t t) { return tasks * ((V + t - 1) / t); };
          auto takes = [&](int64_t t) { return path == tc ? V % t == 0 : t <= (V + 7) / 8 * 8; };
          const int64_t narrowest = path == tc ? 16 : 8;
          REQUIRE((path == tc ? (columns == 16 || columns == 32) : (columns >= 8 && columns <= 64)));
          REQUIRE(takes(columns));
          if (blocks(columns) < 2 * sms) CHECK(columns == narrowest);
          for (int64_t t : path == tc ? std::vector<int64_t>(tc_tiles, tc_tiles + 2)
                                      : std::vector<int64_t>(scalar_tiles, scalar_tiles + 4))
            if (t > columns && takes(t)) CHECK(blocks(t) < 2 * sms);
        }
  // The override (cuda::set_kda_scan_columns): taken where the path takes it, else
  // the automatic choice.
  CHECK(simt::kda_scan_columns(16, 128, 132, scalar, 64) == 64);
  CHECK(simt::kda_scan_columns(16, 128, 132, tc, 32) == 32);
  CHECK(simt::kda_scan_columns(16, 128, 132, tc, 8) == 16);   // no tensor-core tile of 8
  CHECK(simt::kda_scan_columns(16, 48, 132, tc, 32) == 16);   // 32 does not divide 48
  CHECK(simt::kda_scan_columns(16, 20, 132, scalar, 64) == 8);  // wider than V needs
}

TEST_CASE("kda: TF32 rounding of the host tensor core", "[ops][kda][simt]") {
  // 1 + 2^-11 is a tie between 1 and 1 + 2^-10: away from zero; 1 + 2^-12 rounds to 1.
  CHECK(simt::HostTf32::round(1.0f + 0x1p-11f) == 1.0f + 0x1p-10f);
  CHECK(simt::HostTf32::round(-(1.0f + 0x1p-11f)) == -(1.0f + 0x1p-10f));
  CHECK(simt::HostTf32::round(1.0f + 0x1p-12f) == 1.0f);
  CHECK(simt::HostTf32::round(1.0f + 0x1p-10f) == 1.0f + 0x1p-10f);
  CHECK(std::isinf(simt::HostTf32::round(INFINITY)));
}
