// Launches of the tensor-core attention bodies (ops/attention/attention_tc.h): bf16 q, k,
// v with head dims that are multiples of 16; a block of 4 warps per tile of 64
// query rows (forward, dQ) or 64 keys (dK/dV), grid.y = B·H. The *_registers
// kernels are instantiated for the register path's head dims
// (simt::tc_register_dims); the others are the shared path of every other shape
// (docs/cuda.md, "Attention on tensor cores", has ptxas's registers and spills).
#include <algorithm>
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
using simt::TcAccumulators;
using simt::TcAttention;

std::atomic<bool> g_tensor_cores{true};
std::atomic<bool> g_register_accumulators{true};

__global__ void __launch_bounds__(kTcThreads) tc_forward_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_forward<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

// dK/dV's second bound (2 blocks an SM: up to 255 registers): with the plain
// bound ptxas trims the shared-path kernel to 72 registers and 96/64's register
// kernel to 168, both with 4-8 bytes of spills (CUDA 13.0).
__global__ void __launch_bounds__(kTcThreads, 2) tc_grad_kv_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_kv<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

__global__ void __launch_bounds__(kTcThreads) tc_grad_q_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_q<DeviceMma>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

// The register path. The forward's second bound (2 blocks an SM, which asks
// for no fewer registers than 255) keeps ptxas from trimming 32/32 and 96/64 to
// 64 and 80 registers with 4-8 bytes of spills.
template <int DK, int DV>
__global__ void __launch_bounds__(kTcThreads, 2) tc_forward_registers_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_forward<DeviceMma, DK, DV>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

template <int DK, int DV>  // the second bound as tc_grad_kv_kernel's
__global__ void __launch_bounds__(kTcThreads, 2) tc_grad_kv_registers_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_kv<DeviceMma, DK, DV>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

template <int DK, int DV>
__global__ void __launch_bounds__(kTcThreads) tc_grad_q_registers_kernel(TcAttention<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char tc_smem[];
  simt::tc_attention_grad_q<DeviceMma, DK, DV>(DeviceBlock{kTcThreads}, a, blockIdx.x, blockIdx.y, tc_smem);
}

// dK/dV at 192/128 holds 20 fragments (160 registers a lane) and ptxas spills
// it (255 registers, 48 bytes): that kernel keeps the shared path.
template <int DK, int DV>
constexpr bool kGradKvInRegisters = !(DK == 192 && DV == 128);

// The three kernels for heads Dk, Dv and where each keeps its accumulators.
struct TcKernels {
  using Kernel = void (*)(TcAttention<bf16_t>);
  Kernel forward = tc_forward_kernel, grad_kv = tc_grad_kv_kernel, grad_q = tc_grad_q_kernel;
  TcAccumulators forward_acc = TcAccumulators::shared, grad_kv_acc = TcAccumulators::shared,
                 grad_q_acc = TcAccumulators::shared;
};

TcKernels kernels_for(int Dk, int Dv) {
  TcKernels k;
  if (!g_register_accumulators.load()) return k;
  simt::tc_register_dims(Dk, Dv, [&](auto dims) {
    constexpr int DK = decltype(dims)::Dk, DV = decltype(dims)::Dv;
    k.forward = tc_forward_registers_kernel<DK, DV>;
    k.forward_acc = TcAccumulators::registers;
    k.grad_q = tc_grad_q_registers_kernel<DK, DV>;
    k.grad_q_acc = TcAccumulators::registers;
    if constexpr (kGradKvInRegisters<DK, DV>) {
      k.grad_kv = tc_grad_kv_registers_kernel<DK, DV>;
      k.grad_kv_acc = TcAccumulators::registers;
    }
  });
  return k;
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

size_t forward_bytes(int Dk, int Dv, TcAccumulators acc) {
  return simt::TcForwardSmem<bf16_t>(nullptr, Dk, Dv, acc).bytes;
}
size_t backward_bytes(int Dk, int Dv, bool key_tile, TcAccumulators acc) {
  return simt::TcBackwardSmem<bf16_t>(nullptr, Dk, Dv, key_tile, acc).bytes;
}

LaunchDims grid_of(int64_t rows, int64_t bh) { return LaunchDims((rows + kTcTile - 1) / kTcTile, bh); }

constexpr const char* kWhat = "causal_attention (CUDA, tensor cores): smaller heads";

}  // namespace

void set_attention_tensor_cores(bool enabled) { g_tensor_cores.store(enabled); }
void set_attention_register_accumulators(bool enabled) { g_register_accumulators.store(enabled); }

bool attention_tensor_cores_apply(const Tensor& q, int64_t Dk, int64_t Dv) {
  if (!g_tensor_cores.load() || q.dtype() != DType::bf16) return false;
  if (Dk % 16 != 0 || Dv % 16 != 0 || Dk > simt::kTcMaxDim || Dv > simt::kTcMaxDim) return false;
  const int dk = static_cast<int>(Dk), dv = static_cast<int>(Dv);
  const TcKernels k = kernels_for(dk, dv);
  const size_t need = std::max({forward_bytes(dk, dv, k.forward_acc), backward_bytes(dk, dv, true, k.grad_kv_acc),
                                backward_bytes(dk, dv, false, k.grad_q_acc)});
  return has_tensor_cores() && need <= static_cast<size_t>(max_shared_bytes());
}

void attention_tc_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                          Tensor* row_max) {
  TcAttention<bf16_t> a = args_of(q, k, v, scale);
  if (a.B * a.H * a.Tq == 0) return;
  a.o = ptr<bf16_t>(o);
  a.lse = ptr<float>(lse);
  a.row_max = row_max ? ptr<float>(*row_max) : nullptr;
  const TcKernels kern = kernels_for(a.Dk, a.Dv);
  launch_with_shared(kern.forward, grid_of(a.Tq, a.B * a.H), kTcThreads, forward_bytes(a.Dk, a.Dv, kern.forward_acc),
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
  const TcKernels kern = kernels_for(a.Dk, a.Dv);
  if (a.Tk > 0)
    launch_with_shared(kern.grad_kv, grid_of(a.Tk, a.B * a.H), kTcThreads,
                       backward_bytes(a.Dk, a.Dv, true, kern.grad_kv_acc), s, "attention_tc_grad_kv", kWhat, a);
  if (a.Tq > 0)
    launch_with_shared(kern.grad_q, grid_of(a.Tq, a.B * a.H), kTcThreads,
                       backward_bytes(a.Dk, a.Dv, false, kern.grad_q_acc), s, "attention_tc_grad_q", kWhat, a);
}

}  // namespace moetrain::cuda
