// Launches of the tensor-core attention bodies (ops/attention/attention_tc.h): bf16 q, k,
// v with head dims that are multiples of 16; a block of 4 warps per tile of 64
// query rows (forward, dQ) or 64 keys (dK/dV), grid.y = B·H.
#include <atomic>

#include "ops/attention/attention_kernels.h"
#include "ops/attention/attention_tc.h"
#include "ops/common/cuda_helpers.cuh"

namespace moetrain::cuda {

namespace {

using simt::DeviceBlock;
using simt::DeviceMma;
using simt::kTcThreads;
using simt::kTcTile;
using simt::TcAttention;

std::atomic<bool> g_tensor_cores{true};

__global__ void __launch_bounds__(kTcThreads) tc_forward_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_forward<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

__global__ void __launch_bounds__(kTcThreads) tc_grad_kv_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_kv<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

__global__ void __launch_bounds__(kTcThreads) tc_grad_q_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_q<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

TcAttention<bf16_t> args_of(const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TcAttention<bf16_t> a;
  a.B = q.size(0);
  a.Tq = q.size(1);
  a.Tk = k.size(1);
  a.off = a.Tk - a.Tq;
  a.H = q.size(2);
  a.Dk = static_cast<int>(q.size(3));
  a.Dv = static_cast<int>(v.size(3));
  a.scale = static_cast<float>(scale);
  a.q = ptr<bf16_t>(q);
  a.k = ptr<bf16_t>(k);
  a.v = ptr<bf16_t>(v);
  return a;
}

size_t forward_bytes(int Dk, int Dv) { return simt::TcForwardSmem<bf16_t>(nullptr, Dk, Dv).bytes; }
size_t backward_bytes(int Dk, int Dv, bool key_tile) {
  return simt::TcBackwardSmem<bf16_t>(nullptr, Dk, Dv, key_tile).bytes;
}

LaunchDims grid_of(int64_t rows, int64_t bh) { return LaunchDims((rows + kTcTile - 1) / kTcTile, bh); }

constexpr const char* kWhat = "causal_attention (CUDA, tensor cores): smaller heads";

}  // namespace

void set_attention_tensor_cores(bool enabled) { g_tensor_cores.store(enabled); }

bool attention_tensor_cores_apply(const Tensor& q, int64_t Dk, int64_t Dv) {
  if (!g_tensor_cores.load() || q.dtype() != DType::bf16) return false;
  if (Dk % 16 != 0 || Dv % 16 != 0 || Dk > simt::kTcMaxDim || Dv > simt::kTcMaxDim) return false;
  const size_t need = std::max(backward_bytes(static_cast<int>(Dk), static_cast<int>(Dv), true),
                               forward_bytes(static_cast<int>(Dk), static_cast<int>(Dv)));
  return has_tensor_cores() && need <= static_cast<size_t>(max_shared_bytes());
}

void attention_tc_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  TcAttention<bf16_t> a = args_of(q, k, v, scale);
  if (a.B * a.H * a.Tq == 0) return;
  a.o = ptr<bf16_t>(o);
  a.lse = ptr<float>(lse);
  launch_with_shared(tc_forward_kernel, grid_of(a.Tq, a.B * a.H), kTcThreads, forward_bytes(a.Dk, a.Dv),
                     stream_of(q), "attention_tc_forward", kWhat, a);
}

void attention_tc_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o, const Tensor& q,
                           const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& delta, double scale) {
  TcAttention<bf16_t> a = args_of(q, k, v, scale);
  if (a.B * a.H == 0) return;
  a.grad_o = ptr<bf16_t>(grad_o);
  a.grad_q = ptr<bf16_t>(grad_q);
  a.grad_k = ptr<bf16_t>(grad_k);
  a.grad_v = ptr<bf16_t>(grad_v);
  a.lse = ptr<float>(lse);
  a.delta = ptr<float>(delta);
  cudaStream_t s = stream_of(q);
  if (a.Tk > 0)
    launch_with_shared(tc_grad_kv_kernel, grid_of(a.Tk, a.B * a.H), kTcThreads, backward_bytes(a.Dk, a.Dv, true), s,
                       "attention_tc_grad_kv", kWhat, a);
  if (a.Tq > 0)
    launch_with_shared(tc_grad_q_kernel, grid_of(a.Tq, a.B * a.H), kTcThreads, backward_bytes(a.Dk, a.Dv, false), s,
                       "attention_tc_grad_q", kWhat, a);
}

}  // namespace moetrain::cuda
