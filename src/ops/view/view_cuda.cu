// CUDA kernels of the shape ops (CPU twins: view_cpu.cpp). Copies move
// elements of 1, 2, 4 or 8 bytes whatever the dtype; the index-add of
// index_select's backward gives each thread one column of one outer row and adds
// the rows in index order, like the CPU kernel: no atomics, so the result does
// not depend on scheduling (at the cost of parallelism when outer * inner is small).
#include "ops/view/view_kernels.h"

#include "backend/cuda/kernel_utils.cuh"

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

template <class T, class I>
__global__ void index_add_kernel(T* gx, const T* g, const I* idx, int64_t outer, int64_t n, int64_t mid,
                                 int64_t inner) {
  MT_GRID_LOOP(e, outer * inner) {
    int64_t c = e % inner, o = e / inner;
    for (int64_t i = 0; i < n; ++i) {
      int64_t dst = (o * mid + static_cast<int64_t>(idx[i])) * inner + c;
      store(gx, dst, load(gx, dst) + load(g, (o * n + i) * inner + c));
    }
  }
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

void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                           int64_t inner) {
  int64_t n = index.numel(), mid = grad_x.numel() / std::max<int64_t>(outer * inner, 1);
  if (outer * inner == 0 || n == 0) return;
  dispatch_float_cuda(grad_x.dtype(), "index_select_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(index.dtype(), "index_select", [&](auto itag) {
      using I = decltype(itag);
      launch("index_add_kernel", index_add_kernel<T, I>, blocks_for(outer * inner, 128), 128, 0, stream_of(grad_x),
             ptr<T>(grad_x), ptr<T>(grad_out), ptr<I>(index), outer, n, mid, inner);
    });
  });
}

}  // namespace moetrain::cuda
