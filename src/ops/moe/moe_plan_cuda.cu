// The expert plan and the token gather on the GPU (moe_plan_simt.h's bodies): the
// assignments sorted by expert with CUB's stable radix sort (only the bits of the
// largest expert id), the starts by binary search, the offsets in one thread (E
// steps), the rows by one thread per sorted position. No host wait: everything the
// layer's GEMMs and combine need stays on the device (docs/cuda.md, "Host
// synchronisation"). The gather's backward sums each token's slots in row order,
// a block per token: no atomics, the same bits run to run.
#include <algorithm>

#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/kernel_utils.cuh"
#include "ops/moe/moe_kernels.h"
#include "ops/moe/moe_plan_simt.h"

namespace moetrain::cuda {

namespace {

__global__ void plan_keys_kernel(int32_t* expert, int32_t* slot, const int64_t* ids, int64_t A) {
  MT_GRID_LOOP(a, A) {
    expert[a] = static_cast<int32_t>(ids[a]);
    slot[a] = static_cast<int32_t>(a);
  }
}

__global__ void plan_start_kernel(int64_t* start, const int32_t* sorted, int64_t A, int64_t E) {
  MT_GRID_LOOP(e, E + 1) start[e] = simt::expert_plan_start(sorted, A, e);
}

__global__ void plan_offsets_kernel(int64_t* counts, int64_t* offsets, const int64_t* start, int64_t E,
                                    int64_t capacity) {
  if (blockIdx.x == 0 && threadIdx.x == 0) simt::expert_plan_offsets(start, E, capacity, counts, offsets);
}

__global__ void plan_scatter_kernel(int64_t* row_token, int64_t* slot_row, const int32_t* sorted_expert,
                                    const int32_t* sorted_slot, const int64_t* start, const int64_t* offsets,
                                    int64_t k, int64_t A) {
  MT_GRID_LOOP(i, A)
  simt::expert_plan_scatter(i, sorted_expert, sorted_slot, start, offsets, k, A, row_token, slot_row);
}

template <class T>
__global__ void moe_gather_kernel(T* rows, const T* z, const int64_t* row_token, int64_t M, int64_t W) {
  MT_GRID_LOOP(e, M * W) rows[e] = z[row_token[e / W] * W + e % W];
}

// A block per token: its rows sorted once (moe_gather_rows), then each thread sums
// its columns over them in that order (the CPU kernel's order and arithmetic).
template <class T>
__global__ void moe_gather_grad_kernel(T* grad_z, const T* grad_rows, const int64_t* slot_row, int64_t N, int64_t W,
                                       int64_t k, int64_t M) {
  __shared__ int64_t rows[64];
  __shared__ int64_t count;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    if (threadIdx.x == 0) count = simt::moe_gather_rows(slot_row, n, k, M, rows);
    __syncthreads();
    for (int64_t c = threadIdx.x; c < W; c += blockDim.x) {
      simt::acc_of_t<T> sum = 0;
      for (int64_t j = 0; j < count; ++j) sum += simt::acc_load(grad_rows[rows[j] * W + c]);
      simt::acc_store(grad_z[n * W + c], sum);
    }
    __syncthreads();  // rows and count are rewritten for the next token
  }
}

constexpr int kGatherGradThreads = 128;

int expert_bits(int64_t E) {
  int bits = 1;
  while ((int64_t{1} << bits) < E) ++bits;
  return bits;
}

}  // namespace

void plan_expert_rows(Tensor& counts, Tensor& offsets, Tensor& row_token, Tensor& slot_row, const Tensor& ids,
                      int64_t k, int64_t capacity) {
  const int64_t A = ids.numel(), E = counts.numel() - 1;
  const Device dev = ids.device();
  cudaStream_t st = stream_of(ids);
  Tensor keys = empty({4 * std::max<int64_t>(A, 1)}, DType::i32, dev);  // expert, slot; sorted expert, slot
  int32_t* expert = ptr<int32_t>(keys);
  int32_t* slot = expert + A;
  int32_t* sorted_expert = expert + 2 * A;
  int32_t* sorted_slot = expert + 3 * A;
  Tensor start = empty({E + 1}, DType::i64, dev);
  if (A > 0) {
    launch("plan_keys_kernel", plan_keys_kernel, blocks_for(A), kThreads, 0, st, expert, slot, ptr<int64_t>(ids), A);
    size_t temp_bytes = 0;
    const int n = static_cast<int>(A), bits = expert_bits(E);
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, expert, sorted_expert, slot, sorted_slot, n, 0,
                                                  bits, st));
    Tensor temp = empty({static_cast<int64_t>(temp_bytes / 8 + 1)}, DType::i64, dev);
    count_cuda_library_call();
    MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, expert, sorted_expert, slot,
                                                  sorted_slot, n, 0, bits, st));
  }
  launch("plan_start_kernel", plan_start_kernel, blocks_for(E + 1), kThreads, 0, st, ptr<int64_t>(start),
         sorted_expert, A, E);
  launch("plan_offsets_kernel", plan_offsets_kernel, 1, 1, 0, st, ptr<int64_t>(counts), ptr<int64_t>(offsets),
         ptr<int64_t>(start), E, capacity);
  if (A == 0) return;
  memset_zero(row_token.raw_data(), A * 8, dev.index);
  launch("plan_scatter_kernel", plan_scatter_kernel, blocks_for(A), kThreads, 0, st, ptr<int64_t>(row_token),
         ptr<int64_t>(slot_row), sorted_expert, sorted_slot, ptr<int64_t>(start), ptr<int64_t>(offsets), k, A);
}

void moe_gather_forward(Tensor& rows, const Tensor& z, const Tensor& row_token) {
  const int64_t M = rows.size(0), W = rows.size(1);
  if (M * W == 0) return;
  dispatch_float_cuda(z.dtype(), "moe_gather", [&](auto tag) {
    using T = decltype(tag);
    launch("moe_gather_kernel", moe_gather_kernel<T>, blocks_for(M * W), kThreads, 0, stream_of(z), ptr<T>(rows),
           ptr<T>(z), ptr<int64_t>(row_token), M, W);
  });
}

void moe_gather_backward(Tensor& grad_z, const Tensor& grad_rows, const Tensor& slot_row) {
  const int64_t N = grad_z.size(0), W = grad_z.size(1), M = grad_rows.size(0);
  if (N * W == 0) return;
  const int64_t k = slot_row.numel() / N;
  dispatch_float_cuda(grad_z.dtype(), "moe_gather_backward", [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, 65535LL * 16));
    launch("moe_gather_grad_kernel", moe_gather_grad_kernel<T>, blocks, kGatherGradThreads, 0, stream_of(grad_z),
           ptr<T>(grad_z), ptr<T>(grad_rows), ptr<int64_t>(slot_row), N, W, k, M);
  });
}

}  // namespace moetrain::cuda
