// Launches of the MoE grouped GEMM bodies on tensor cores (ops/moe/grouped_gemm_tc.h):
// bf16, 4 warps a block, a 64x64 output tile a block, the experts' row offsets
// read on the device. Forward and data gradient: grid (gg_row_slots(M, E),
// column tiles), a bound the host knows without the offsets; weight gradient:
// grid (E, out tiles, in tiles). 37 KiB of shared memory a block (no opt-in).
// docs/cuda.md, "Grouped expert GEMM on tensor cores".
#include "ops/moe/grouped_gemm_tc_kernels.h"

#include "ops/common/cuda_helpers.cuh"
#include "ops/moe/grouped_gemm_tc.h"

namespace moetrain::cuda {

namespace {

using simt::DeviceBlock;
using simt::DeviceMma;
using simt::GgArgs;
using simt::GgProduct;
using simt::kGgThreads;
using simt::kGgTile;

__global__ void __launch_bounds__(kGgThreads) gg_forward_kernel(GgArgs<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char gg_smem[];
  simt::gg_rows_product<DeviceMma, GgProduct::forward>(DeviceBlock{kGgThreads}, a, blockIdx.x, blockIdx.y, gg_smem);
}

__global__ void __launch_bounds__(kGgThreads) gg_data_kernel(GgArgs<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char gg_smem[];
  simt::gg_rows_product<DeviceMma, GgProduct::data>(DeviceBlock{kGgThreads}, a, blockIdx.x, blockIdx.y, gg_smem);
}

__global__ void __launch_bounds__(kGgThreads) gg_weight_kernel(GgArgs<bf16_t> a) {
  extern __shared__ __align__(128) unsigned char gg_smem[];
  simt::gg_weight_product<DeviceMma>(DeviceBlock{kGgThreads}, a, blockIdx.x, blockIdx.y, blockIdx.z, gg_smem);
}

size_t gg_smem_bytes() { return simt::GgSmem<bf16_t>(nullptr).bytes; }

constexpr const char* kGgWhat = "grouped_linear (CUDA, tensor cores): fewer rows, experts or columns";

// The contract's shapes (grouped_gemm_tc_kernels.h): the lead's op checks them for
// users; this names a caller's mistake before a kernel reads out of bounds.
GgArgs<bf16_t> gg_args_of(const Tensor& x, const Tensor& w, const Tensor& offsets, const char* op) {
  MT_CHECK(x.dtype() == DType::bf16 && w.dtype() == DType::bf16, "{}: x ({}) and w ({}) must be bf16", op, x.dtype(),
           w.dtype());
  MT_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == x.size(1),
           "{}: x is {} and w {}; expected x [M, in] and w [E, out, in]", op, x.shape(), w.shape());
  MT_CHECK(offsets.dtype() == DType::i64 && (offsets.shape() == Shape{w.size(0) + 1}) && offsets.is_cuda(),
           "{}: offsets is {} {}; expected i64 [{}] on the GPU", op, offsets.dtype(), offsets.shape(), w.size(0) + 1);
  GgArgs<bf16_t> a;
  a.M = x.size(0);
  a.in = x.size(1);
  a.out = w.size(1);
  a.E = w.size(0);
  a.offsets = ptr<int64_t>(offsets);
  a.x = ptr<bf16_t>(x);
  a.w = ptr<bf16_t>(w);
  return a;
}

}  // namespace

void grouped_linear_forward_dev(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  GgArgs<bf16_t> a = gg_args_of(x, w, offsets, "grouped_linear_forward_dev");
  MT_CHECK(y.dtype() == DType::bf16 && (y.shape() == Shape{a.M, a.out}),
           "grouped_linear_forward_dev: y is {} {}; expected bf16 [{}, {}]", y.dtype(), y.shape(), a.M,
           a.out);
  if (a.M == 0 || a.out == 0) return;
  a.y = ptr<bf16_t>(y);
  launch_with_shared(gg_forward_kernel, LaunchDims(simt::gg_row_slots(a.M, a.E), simt::gg_tiles(a.out)), kGgThreads,
                     gg_smem_bytes(), stream_of(x), "gg_forward_kernel", kGgWhat, a);
}

void grouped_linear_backward_dev(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                                 const Tensor& offsets) {
  GgArgs<bf16_t> a = gg_args_of(x, w, offsets, "grouped_linear_backward_dev");
  MT_CHECK(dy.dtype() == DType::bf16 && (dy.shape() == Shape{a.M, a.out}),
           "grouped_linear_backward_dev: dy is {} {}; expected bf16 [{}, {}]", dy.dtype(), dy.shape(), a.M,
           a.out);
  MT_CHECK(dx.dtype() == DType::bf16 && dx.shape() == x.shape() && dw.dtype() == DType::bf16 &&
               dw.shape() == w.shape(),
           "grouped_linear_backward_dev: dx is {} {} and dw {} {}; expected bf16 {} and {}", dx.dtype(),
           dx.shape(), dw.dtype(), dw.shape(), x.shape(), w.shape());
  a.dy = ptr<bf16_t>(dy);
  a.dx = ptr<bf16_t>(dx);
  a.dw = ptr<bf16_t>(dw);
  cudaStream_t s = stream_of(x);
  if (a.M > 0 && a.in > 0)
    launch_with_shared(gg_data_kernel, LaunchDims(simt::gg_row_slots(a.M, a.E), simt::gg_tiles(a.in)), kGgThreads,
                       gg_smem_bytes(), s, "gg_data_kernel", kGgWhat, a);
  // Every expert's block runs, rows or not: an expert without rows writes zeros.
  if (a.E > 0 && a.out > 0 && a.in > 0)
    launch_with_shared(gg_weight_kernel, LaunchDims(a.E, simt::gg_tiles(a.out), simt::gg_tiles(a.in)), kGgThreads,
                       gg_smem_bytes(), s, "gg_weight_kernel", kGgWhat, a);
}

}  // namespace moetrain::cuda
