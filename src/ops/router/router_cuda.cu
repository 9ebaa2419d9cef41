// The router's expert selection on the GPU: one block per token row runs the
// body of ops/router/router_simt.h (the code the host test runs against the CPU's
// select_experts), so a CUDA run picks the same experts as a CPU run and the
// host receives N·k ids instead of the N·E scores it would sort itself.
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
#include "ops/router/router_kernels.h"
#include "ops/router/router_simt.h"

namespace moetrain::cuda {

namespace {

constexpr int kSelectThreads = 128;  // a power of two (the body's tree)
constexpr unsigned kMaxRowBlocks = 1u << 20;

template <class T>
__global__ void select_experts_kernel(simt::ExpertSelectArgs<T> a) {
  extern __shared__ __align__(16) unsigned char select_shared[];
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x)
    simt::expert_select_row(simt::DeviceBlock{static_cast<int>(blockDim.x)}, a, row,
                            reinterpret_cast<double*>(select_shared));
}

template <class T>
void launch_select(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                   int64_t topk_group) {
  const int64_t N = scores.size(0), E = scores.size(1);
  simt::ExpertSelectArgs<T> a;
  a.scores = ptr<T>(scores);
  a.bias = ptr<double>(bias);
  a.experts = ptr<int64_t>(experts);
  a.N = N;
  a.E = E;
  a.k = k;
  a.n_group = n_group;
  a.topk_group = topk_group;
  const size_t bytes =
      static_cast<size_t>(simt::expert_select_shared_elements(E, n_group, kSelectThreads)) * sizeof(double);
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, kMaxRowBlocks));
  launch_with_shared(select_experts_kernel<T>, blocks, kSelectThreads, bytes, stream_of(scores), "select_experts",
                     "fewer experts per router", a);
}

}  // namespace

void select_experts(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                    int64_t topk_group) {
  if (scores.size(0) == 0) return;
  // bf16 scores widen to f32 exactly (the double sum is then the CPU's); f32 and f64 as they are.
  const Tensor s = scores.dtype() == DType::bf16 ? scores.to(DType::f32) : scores.contiguous();
  const Tensor b = bias.to(scores.device()).to(DType::f64).contiguous();
  if (s.dtype() == DType::f64)
    launch_select<double>(experts, s, b, k, n_group, topk_group);
  else
    launch_select<float>(experts, s, b, k, n_group, topk_group);
}

}  // namespace moetrain::cuda
