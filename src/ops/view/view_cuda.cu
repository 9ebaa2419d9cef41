// CUDA kernels of the shape ops (CPU twins: view_cpu.cpp). Copies move
// elements of 1, 2, 4 or 8 bytes whatever the dtype; the index-add of
// index_select's backward runs the body of ops/view/view_simt.h: the host
// buckets the indices by destination row, one thread per (named row, column)
// sums that row's upstream rows in index order in f32 (f64 for f64) and adds
// the sum once: no atomics, no per-token rounding, the result does not depend
// on scheduling. Indices on the device (the embedding's device ids) are
// bucketed there instead: CUB's stable radix sort and an uncompacted plan of n
// entries (view_simt.h), nothing read back to the host.
#include "ops/view/view_kernels.h"

#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/kernel_utils.cuh"
#include "ops/view/view_simt.h"

namespace moetrain::cuda {

namespace {

struct Permutation {
  int nd = 0;
  int64_t out_dims[Shape::kMaxDims] = {};
  int64_t src_strides[Shape::kMaxDims] = {};  // source stride of each output dim
};

template <class E> __global__ void permute_kernel(E* out, const E* x, int64_t n, Permutation p) {
  MT_GRID_LOOP(i, n) {
    int64_t rem = i, off = 0;
    for (int d = p.nd - 1; d >= 0; --d) {
      off += (rem % p.out_dims[d]) * p.src_strides[d];
      rem /= p.out_dims[d];
    }
    out[i] = x[off];
  }
}

// An unsigned type of each element size (copies do not interpret the bits).
template <class F> void with_element(int64_t size, F&& f) {
  switch (size) {
    case 1: return f(uint8_t{});
    case 2: return f(uint16_t{});
    case 4: return f(uint32_t{});
    case 8: return f(uint64_t{});
  }
  MT_THROW("unsupported element size {}", size);
}

template <class E, class I>
__global__ void index_select_kernel(E* out, const E* x, const I* idx, int64_t outer, int64_t n, int64_t mid,
                                    int64_t inner) {
  MT_GRID_LOOP(e, outer * n * inner) {
    int64_t c = e % inner, r = e / inner;
    int64_t o = r / n, i = r % n;
    out[e] = x[(o * mid + static_cast<int64_t>(idx[i])) * inner + c];
  }
}

// The embedding's gather from unchecked device ids: an id outside [0, mid) reads
// nothing and gives a NaN row (softmax.cpp's policy for device targets).
template <class T, class I>
__global__ void index_select_or_nan_kernel(T* out, const T* x, const I* idx, int64_t outer, int64_t n, int64_t mid,
                                           int64_t inner) {
  MT_GRID_LOOP(e, outer * n * inner) {
    const int64_t c = e % inner, r = e / inner;
    const int64_t o = r / n, i = static_cast<int64_t>(idx[r % n]);
    store(out, e, i >= 0 && i < mid ? load(x, (o * mid + i) * inner + c) : acc_t<T>(NAN));
  }
}

// The sort's input: keys the indices (index_add_sort_key), values the positions.
template <class I>
__global__ void index_add_keys_kernel(int64_t* keys, int64_t* positions, const I* idx, int64_t n, int64_t mid) {
  MT_GRID_LOOP(i, n) {
    keys[i] = simt::index_add_sort_key(static_cast<int64_t>(idx[i]), mid);
    positions[i] = i;
  }
}

__global__ void index_add_run_plan_kernel(int64_t* rows, int64_t* offsets, const int64_t* sorted_keys, int64_t n,
                                          int64_t mid) {
  MT_GRID_LOOP(k, n) simt::index_add_run_plan_element(sorted_keys, n, mid, k, rows, offsets);
}

// The bits of keys 0 .. mid (mid: out of range).
int index_key_bits(int64_t mid) {
  int bits = 1;
  while (bits < 63 && (int64_t{1} << bits) <= mid) ++bits;
  return bits;
}

constexpr int kIndexAddThreads = 128;

template <class T>
__global__ void index_add_kernel(simt::IndexAddArgs<T> a) {
  const int64_t total = a.elements(), step = static_cast<int64_t>(gridDim.x) * kIndexAddThreads;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kIndexAddThreads; first < total; first += step)
    simt::index_add_block(simt::DeviceBlock{kIndexAddThreads}, a, first);
}

}  // namespace

void permute_copy(Tensor& out, const Tensor& x, const std::vector<int64_t>& dims) {
  int64_t n = x.numel();
  if (n == 0) return;
  int nd = x.dim();
  if (nd == 0) {
    copy_device_to_device(out.raw_data(), x.raw_data(), x.nbytes(), x.device().index);
    return;
  }
  int64_t in_strides[Shape::kMaxDims];
  int64_t s = 1;
  for (int d = nd - 1; d >= 0; --d) {
    in_strides[d] = s;
    s *= x.size(d);
  }
  Permutation p;
  p.nd = nd;
  for (int i = 0; i < nd; ++i) {
    p.out_dims[i] = out.size(i);
    p.src_strides[i] = in_strides[dims[static_cast<size_t>(i)]];
  }
  with_element(dtype_size(x.dtype()), [&](auto tag) {
    using E = decltype(tag);
    launch("permute_kernel", permute_kernel<E>, blocks_for(n), kThreads, 0, stream_of(x), ptr<E>(out), ptr<E>(x), n, p);
  });
}

// Row o of the big tensor holds the small one's row at byte offset `at`: a 2D copy.
void copy_into_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at) {
  if (outer == 0 || x.numel() == 0) return;
  int64_t es = dtype_size(x.dtype());
  int64_t big_row = out.numel() / outer * es, small_row = x.numel() / outer * es;
  MT_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(out.raw_data()) + at * inner * es, static_cast<size_t>(big_row),
                                  x.raw_data(), static_cast<size_t>(small_row), static_cast<size_t>(small_row),
                                  static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream_of(x)));
}

void copy_from_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at) {
  if (outer == 0 || out.numel() == 0) return;
  int64_t es = dtype_size(x.dtype());
  int64_t big_row = x.numel() / outer * es, small_row = out.numel() / outer * es;
  MT_CUDA_CHECK(cudaMemcpy2DAsync(out.raw_data(), static_cast<size_t>(small_row),
                                  static_cast<const char*>(x.raw_data()) + at * inner * es,
                                  static_cast<size_t>(big_row), static_cast<size_t>(small_row),
                                  static_cast<size_t>(outer), cudaMemcpyDeviceToDevice, stream_of(x)));
}

void index_select_forward(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer, int64_t inner) {
  int64_t n = index.numel(), mid = x.numel() / std::max<int64_t>(outer * inner, 1);
  int64_t total = outer * n * inner;
  if (total == 0) return;
  with_element(dtype_size(x.dtype()), [&](auto etag) {
    using E = decltype(etag);
    dispatch_index(index.dtype(), "index_select", [&](auto itag) {
      using I = decltype(itag);
      launch("index_select_kernel", index_select_kernel<E, I>, blocks_for(total), kThreads, 0, stream_of(x),
             ptr<E>(out), ptr<E>(x), ptr<I>(index), outer, n, mid, inner);
    });
  });
}

void index_select_forward_or_nan(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer, int64_t inner) {
  const int64_t n = index.numel(), mid = x.numel() / std::max<int64_t>(outer * inner, 1);
  const int64_t total = outer * n * inner;
  if (total == 0) return;
  dispatch_float_cuda(x.dtype(), "index_select_forward_or_nan", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(index.dtype(), "index_select_forward_or_nan", [&](auto itag) {
      using I = decltype(itag);
      launch("index_select_or_nan_kernel", index_select_or_nan_kernel<T, I>, blocks_for(total), kThreads, 0,
             stream_of(x), ptr<T>(out), ptr<T>(x), ptr<I>(index), outer, n, mid, inner);
    });
  });
}

namespace {

// grad_x[o, rows[u], c] += the rows' positions summed (view_simt.h index_add_element)
// for the U entries of a plan, wherever it was made.
void launch_index_add(Tensor& grad_x, const Tensor& grad_out, const int64_t* rows, const int64_t* offsets,
                      const int64_t* positions, int64_t outer, int64_t n, int64_t mid, int64_t inner, int64_t U) {
  dispatch_float_cuda(grad_x.dtype(), "index_select_backward", [&](auto tag) {
    using T = decltype(tag);
    const simt::IndexAddArgs<T> a{ptr<T>(grad_x), ptr<T>(grad_out), rows, offsets, positions, outer, n, mid, inner, U};
    launch("index_add_kernel", index_add_kernel<T>, blocks_for(a.elements(), kIndexAddThreads), kIndexAddThreads, 0,
           stream_of(grad_x), a);
  });
}

// The plan from device indices (view_simt.h): sort, uncompacted plan, index-add
// with U = n. Every size is known from n; nothing is read back.
void index_select_backward_device_plan(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                                       int64_t inner, int64_t n, int64_t mid) {
  MT_ASSERT(n <= int64_t{INT32_MAX}, "index_select_backward: {} device indices exceed CUB's item count", n);
  const Device dev = grad_x.device();
  cudaStream_t st = stream_of(grad_x);
  // keys, positions; sorted keys, sorted positions; rows; offsets (n + 1)
  Tensor work = empty({6 * n + 1}, DType::i64, dev);
  int64_t* keys = ptr<int64_t>(work);
  int64_t* positions = keys + n;
  int64_t* sorted_keys = keys + 2 * n;
  int64_t* sorted_positions = keys + 3 * n;
  int64_t* rows = keys + 4 * n;
  int64_t* offsets = keys + 5 * n;
  dispatch_index(index.dtype(), "index_select_backward", [&](auto itag) {
    using I = decltype(itag);
    launch("index_add_keys_kernel", index_add_keys_kernel<I>, blocks_for(n), kThreads, 0, st, keys, positions,
           ptr<I>(index), n, mid);
  });
  size_t temp_bytes = 0;
  const int items = static_cast<int>(n), bits = index_key_bits(mid);
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys, sorted_keys, positions, sorted_positions,
                                                items, 0, bits, st));
  Tensor temp = empty({static_cast<int64_t>(temp_bytes / 8 + 1)}, DType::i64, dev);
  count_cuda_library_call();
  MT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.raw_data(), temp_bytes, keys, sorted_keys, positions,
                                                sorted_positions, items, 0, bits, st));
  launch("index_add_run_plan_kernel", index_add_run_plan_kernel, blocks_for(n), kThreads, 0, st, rows, offsets,
         sorted_keys, n, mid);
  launch_index_add(grad_x, grad_out, rows, offsets, sorted_positions, outer, n, mid, inner, n);
}

}  // namespace

void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                           int64_t inner) {
  int64_t n = index.numel(), mid = grad_x.numel() / std::max<int64_t>(outer * inner, 1);
  if (outer * inner == 0 || n == 0) return;
  if (index.is_cuda()) return index_select_backward_device_plan(grad_x, grad_out, index, outer, inner, n, mid);
  simt::IndexAddPlan plan = dispatch_index(index.dtype(), "index_select", [&](auto itag) {
    using I = decltype(itag);
    return simt::index_add_plan(index.data<I>(), n, mid);
  });
  // One upload of the plan (rows, offsets, positions).
  const Tensor packed =
      from_span<int64_t>(plan.packed, {static_cast<int64_t>(plan.packed.size())}).to(grad_x.device());
  const int64_t* dev = ptr<int64_t>(packed);
  launch_index_add(grad_x, grad_out, dev, dev + plan.U, dev + 2 * plan.U + 1, outer, n, mid, inner, plan.U);
}

}  // namespace moetrain::cuda
