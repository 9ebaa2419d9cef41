// CUDA kernels of the reductions (twins of reduce_cpu.cpp). x is viewed as
// [outer, n, inner]. Sums accumulate in f64 like the CPU kernels and add in an
// order fixed by the shape (no atomics), so results are deterministic. A
// reduction over the last dim (inner == 1) gives each row a block. Otherwise,
// with many outputs one thread owns an output element and walks n (coalesced
// over inner); with few outputs (a bias gradient: [rows, n] summed over rows)
// n is cut into chunks, blocks of 32 columns x 8 row lanes sum a chunk each into
// f64 partials, and a second kernel adds the chunks in order.
#include <algorithm>

#include "ops/common/cuda_helpers.cuh"
#include "ops/reduce/reduce_kernels.h"

namespace moetrain::cuda {

namespace {

constexpr unsigned kMaxRowBlocks = 1u << 20;
constexpr unsigned kSumAllBlocks = 1024;  // partial sums of sum_all (fixed: the order depends on n only)
constexpr int kColTile = 32, kRowLanes = 8;  // column-sum blocks
constexpr int64_t kFewOutputs = 1 << 16;     // below this many outputs, sum_dim chunks n
constexpr int64_t kChunkRows = 256;          // rows of n per chunk (at most kMaxChunks chunks)
constexpr int64_t kMaxChunks = 1024;
unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxRowBlocks)); }

template <class T> __global__ void sum_rows_kernel(T* out, const T* x, int64_t rows, int64_t n) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    double acc = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += static_cast<double>(load(x, r * n + i));
    acc = block_sum(acc);
    if (threadIdx.x == 0) store(out, r, static_cast<acc_t<T>>(acc));
  }
}

template <class T> __global__ void sum_strided_kernel(T* out, const T* x, int64_t outer, int64_t n, int64_t inner) {
  MT_GRID_LOOP(w, outer * inner) {
    int64_t o = w / inner, j = w % inner;
    const T* base = x + o * n * inner + j;
    double acc = 0;
    for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(load(base, i * inner));
    store(out, w, static_cast<acc_t<T>>(acc));
  }
}

// partial[(c outer + o) inner + j] = Σ_{i in chunk c} x[o, i, j]; grid (column
// tiles, outer, chunks), block (32, 8): thread (tx, ty) adds rows ty, ty + 8, ...
// of its chunk, then the 8 row lanes are added in order.
template <class T>
__global__ void sum_column_chunks_kernel(double* partial, const T* x, int64_t outer, int64_t n, int64_t inner,
                                         int64_t chunk_rows) {
  __shared__ double part[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColTile + tx, o = blockIdx.y, c = blockIdx.z;
  const int64_t i0 = c * chunk_rows, i1 = min(n, i0 + chunk_rows);
  double acc = 0;
  if (j < inner)
    for (int64_t i = i0 + ty; i < i1; i += kRowLanes) acc += static_cast<double>(load(x, (o * n + i) * inner + j));
  part[ty][tx] = acc;
  __syncthreads();
  if (ty == 0 && j < inner) {
    double s = 0;
    for (int r = 0; r < kRowLanes; ++r) s += part[r][tx];
    partial[(c * outer + o) * inner + j] = s;
  }
}

template <class T>
__global__ void sum_chunks_finish_kernel(T* out, const double* partial, int64_t outer, int64_t inner, int64_t chunks) {
  MT_GRID_LOOP(w, outer * inner) {
    double acc = 0;
    for (int64_t c = 0; c < chunks; ++c) acc += partial[c * outer * inner + w];
    store(out, w, static_cast<acc_t<T>>(acc));
  }
}

// partial[b] = Σ of the elements b, b + gridDim.x·blockDim.x ... taken by block b.
template <class T> __global__ void sum_partials_kernel(double* partial, const T* x, int64_t n) {
  double acc = 0;
  MT_GRID_LOOP(i, n) acc += static_cast<double>(load(x, i));
  acc = block_sum(acc);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <class T> __global__ void max_rows_kernel(T* values, int64_t* indices, const T* x, int64_t rows, int64_t n) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    Ranked<A> best{A(0), -1};
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      Ranked<A> c{load(x, r * n + i), i};
      if (ranks_before(c, best)) best = c;
    }
    best = block_first(best);
    if (threadIdx.x == 0) {
      values[r] = x[r * n + best.idx];  // the element itself (no round trip through A)
      indices[r] = best.idx;
    }
  }
}

// The CPU loop: the first NaN, else the first occurrence of the maximum.
template <class T>
__global__ void max_strided_kernel(T* values, int64_t* indices, const T* x, int64_t outer, int64_t n, int64_t inner) {
  using A = acc_t<T>;
  MT_GRID_LOOP(w, outer * inner) {
    int64_t o = w / inner, j = w % inner;
    const T* base = x + o * n * inner + j;
    A best = load(base, 0);
    int64_t arg = 0;
    for (int64_t i = 1; i < n; ++i) {
      A v = load(base, i * inner);
      if (v > best || (v != v && best == best)) {
        best = v;
        arg = i;
      }
    }
    values[w] = base[arg * inner];
    indices[w] = arg;
  }
}

template <class T>
__global__ void max_backward_kernel(T* gx, const T* g, const int64_t* indices, int64_t outer, int64_t n,
                                    int64_t inner) {
  MT_GRID_LOOP(w, outer * inner) {
    int64_t o = w / inner, j = w % inner;
    gx[(o * n + indices[w]) * inner + j] = g[w];
  }
}

}  // namespace

void sum_dim(Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner) {
  if (outer * inner == 0) return;
  dispatch_float_cuda(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    if (inner == 1) {
      launch("sum_rows_kernel", sum_rows_kernel<T>, row_blocks(outer), kThreads, 0, stream_of(x), ptr<T>(out),
             ptr<T>(x), outer, n);
    } else if (outer * inner < kFewOutputs && outer <= 65535 && n > kChunkRows) {
      int64_t chunk_rows = std::max(kChunkRows, (n + kMaxChunks - 1) / kMaxChunks);
      int64_t chunks = (n + chunk_rows - 1) / chunk_rows;
      Tensor partial = empty({chunks, outer, inner}, DType::f64, x.device());
      cudaStream_t s = stream_of(x);
      const LaunchDims grid((inner + kColTile - 1) / kColTile, outer, chunks);
      launch("sum_column_chunks_kernel", sum_column_chunks_kernel<T>, grid, dim3(kColTile, kRowLanes), 0, s,
             ptr<double>(partial), ptr<T>(x), outer, n, inner, chunk_rows);
      launch("sum_chunks_finish_kernel", sum_chunks_finish_kernel<T>, blocks_for(outer * inner), kThreads, 0, s,
             ptr<T>(out), ptr<double>(partial), outer, inner, chunks);
    } else {
      launch("sum_strided_kernel", sum_strided_kernel<T>, blocks_for(outer * inner), kThreads, 0, stream_of(x),
             ptr<T>(out), ptr<T>(x), outer, n, inner);
    }
  });
}

void sum_all(Tensor& out, const Tensor& x) {
  int64_t n = x.numel();
  unsigned parts = std::min<unsigned>(kSumAllBlocks, blocks_for(n));
  Tensor partial = empty({static_cast<int64_t>(parts)}, DType::f64, x.device());
  dispatch_float_cuda(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t s = stream_of(x);
    launch("sum_partials_kernel", sum_partials_kernel<T>, parts, kThreads, 0, s, ptr<double>(partial), ptr<T>(x), n);
    launch("store_sum_of_partials", store_sum_of_partials<T>, 1, 1024, 0, s, ptr<T>(out), ptr<double>(partial), parts);
  });
}

void max_dim(Tensor& values, Tensor& indices, const Tensor& x, int64_t outer, int64_t n, int64_t inner) {
  if (outer * inner == 0) return;
  dispatch_float_cuda(x.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    if (inner == 1) {
      launch("max_rows_kernel", max_rows_kernel<T>, row_blocks(outer), kThreads, 0, stream_of(x), ptr<T>(values),
             ptr<int64_t>(indices), ptr<T>(x), outer, n);
    } else {
      launch("max_strided_kernel", max_strided_kernel<T>, blocks_for(outer * inner), kThreads, 0, stream_of(x),
             ptr<T>(values), ptr<int64_t>(indices), ptr<T>(x), outer, n, inner);
    }
  });
}

void max_dim_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices, int64_t outer, int64_t n,
                      int64_t inner) {
  if (outer * inner == 0) return;
  dispatch_float_cuda(grad.dtype(), "max_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("max_backward_kernel", max_backward_kernel<T>, blocks_for(outer * inner), kThreads, 0, stream_of(grad),
           ptr<T>(grad_x), ptr<T>(grad), ptr<int64_t>(indices), outer, n, inner);
  });
}

}  // namespace moetrain::cuda
