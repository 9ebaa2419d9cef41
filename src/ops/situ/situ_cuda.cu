// CUDA kernels of SiTU-GLU (twins of situ_cpu.cpp, same formulas), elementwise
// in acc_t<T>. The β gradient is summed in f64: per thread, then per block, and
// the block sums are added in a fixed order by one more block, so it is
// deterministic and stays on the device.
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
#include "ops/situ/situ_kernels.h"

namespace moetrain::cuda {

namespace {

constexpr unsigned kMaxBlocks = 1024;  // fixed for a given n: the β sum's order depends on n only

template <class T>
__global__ void situ_forward_kernel(T* out, const T* gate, const T* up, int64_t n, double beta, double lambda) {
  using A = acc_t<T>;
  const A b = static_cast<A>(beta), inv_b = static_cast<A>(1.0 / beta);
  const bool cap = lambda > 0;
  const A l = static_cast<A>(lambda), inv_l = cap ? static_cast<A>(1.0 / lambda) : A(0);
  MT_GRID_LOOP(i, n) {
    A g = load(gate, i);
    A a = b * tanh_a(g * inv_b) * sigmoid_a(g);
    A u = cap ? l * tanh_a(load(up, i) * inv_l) : load(up, i);
    store(out, i, a * u);
  }
}

// grad_gate = dout u ∂a/∂g, grad_up = dout a ∂u/∂up; partial[block] = this
// block's Σ dout u σ(g) (tanh(g/β) - (g/β)(1 - tanh²(g/β))) when beta_partial is set.
template <class T>
__global__ void situ_backward_kernel(T* dg, T* du, double* beta_partial, const T* dout, const T* gate, const T* up,
                                     int64_t n, double beta, double lambda) {
  using A = acc_t<T>;
  const A b = static_cast<A>(beta), inv_b = static_cast<A>(1.0 / beta);
  const bool cap = lambda > 0;
  const A l = static_cast<A>(lambda), inv_l = cap ? static_cast<A>(1.0 / lambda) : A(0);
  double beta_sum = 0;
  MT_GRID_LOOP(i, n) {
    A g = load(gate, i), s = sigmoid_a(g), th = tanh_a(g * inv_b);
    A a = b * th * s;
    A u = load(up, i), du_dup = A(1);
    if (cap) {
      A tu = tanh_a(u * inv_l);
      u = l * tu;
      du_dup = A(1) - tu * tu;
    }
    A da_dg = (A(1) - th * th) * s + b * th * s * (A(1) - s);
    A d = load(dout, i);
    store(dg, i, d * u * da_dg);
    store(du, i, d * a * du_dup);
    if (beta_partial) {
      A r = g * inv_b;
      beta_sum += static_cast<double>(d * u * s * (th - r * (A(1) - th * th)));
    }
  }
  if (beta_partial) {  // uniform over the block: block_sum's barriers are safe
    beta_sum = block_sum(beta_sum);
    if (threadIdx.x == 0) beta_partial[blockIdx.x] = beta_sum;
  }
}

}  // namespace

void situ_glu_forward(Tensor& out, const Tensor& gate, const Tensor& up, double beta, double lambda) {
  int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_float_cuda(gate.dtype(), "situ_glu", [&](auto tag) {
    using T = decltype(tag);
    launch("situ_forward_kernel", situ_forward_kernel<T>, blocks_for(n), kThreads, 0, stream_of(gate), ptr<T>(out),
           ptr<T>(gate), ptr<T>(up), n, beta, lambda);
  });
}

void situ_glu_backward(Tensor& grad_gate, Tensor& grad_up, Tensor* grad_beta, const Tensor& grad_out,
                       const Tensor& gate, const Tensor& up, double beta, double lambda) {
  int64_t n = gate.numel();
  unsigned blocks = std::min<unsigned>(kMaxBlocks, blocks_for(n));
  Tensor partial;
  if (grad_beta) partial = empty({static_cast<int64_t>(blocks)}, DType::f64, gate.device());
  dispatch_float_cuda(gate.dtype(), "situ_glu_backward", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t s = stream_of(gate);
    launch("situ_backward_kernel", situ_backward_kernel<T>, blocks, kThreads, 0, s, ptr<T>(grad_gate), ptr<T>(grad_up),
           grad_beta ? ptr<double>(partial) : nullptr, ptr<T>(grad_out), ptr<T>(gate), ptr<T>(up), n, beta, lambda);
    if (grad_beta) {
      launch("store_sum_of_partials", store_sum_of_partials<T>, 1, 1024, 0, s, ptr<T>(*grad_beta), ptr<double>(partial),
             blocks);
    }
  });
}

}  // namespace moetrain::cuda
