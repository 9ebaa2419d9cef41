// CPU kernels of the shape ops. Copies work on raw bytes (any dtype); the
// index-add of index_select's backward gives each thread its own rows or
// columns, so it is race-free and independent of the thread count.
#include <cstring>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/view/view_kernels.h"

namespace moetrain::cpu {

void permute_copy(Tensor& out, const Tensor& x, const std::vector<int64_t>& dims) {
  int nd = x.dim();
  int64_t es = dtype_size(x.dtype());
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  if (x.numel() == 0) return;
  if (nd == 0) {
    std::memcpy(dst, src, static_cast<size_t>(x.nbytes()));
    return;
  }
  std::vector<int64_t> in_strides(static_cast<size_t>(nd));
  int64_t s = 1;
  for (int d = nd - 1; d >= 0; --d) {
    in_strides[static_cast<size_t>(d)] = s;
    s *= x.size(d);
  }
  // Source stride of each output dim.
  std::vector<int64_t> st(static_cast<size_t>(nd));
  for (int i = 0; i < nd; ++i) st[static_cast<size_t>(i)] = in_strides[static_cast<size_t>(dims[static_cast<size_t>(i)])];
  const Shape& os = out.shape();
  int64_t inner = os[nd - 1], rows = out.numel() / inner, inner_stride = st[static_cast<size_t>(nd - 1)];
  parallel_for(rows, std::max<int64_t>(1, 4096 / inner), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t rem = r, off = 0;
      for (int d = nd - 2; d >= 0; --d) {
        off += (rem % os[d]) * st[static_cast<size_t>(d)];
        rem /= os[d];
      }
      char* o = dst + r * inner * es;
      if (inner_stride == 1) {
        std::memcpy(o, src + off * es, static_cast<size_t>(inner * es));
      } else {
        for (int64_t j = 0; j < inner; ++j)
          std::memcpy(o + j * es, src + (off + j * inner_stride) * es, static_cast<size_t>(es));
      }
    }
  });
}

namespace {
// Row o: out[o, at : at + mid_x, :] <-> x[o, :, :] with byte copies.
void copy_mid(char* big, char* small, int64_t outer, int64_t big_row, int64_t small_row, int64_t at_bytes,
              bool into_big) {
  parallel_for(outer, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(small_row, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t o = lo; o < hi; ++o) {
      char* b = big + o * big_row + at_bytes;
      char* s = small + o * small_row;
      if (into_big) std::memcpy(b, s, static_cast<size_t>(small_row));
      else std::memcpy(s, b, static_cast<size_t>(small_row));
    }
  });
}
}  // namespace

void copy_into_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at) {
  if (outer == 0 || x.numel() == 0) return;
  int64_t es = dtype_size(x.dtype());
  int64_t big_row = out.numel() / outer * es, small_row = x.numel() / outer * es;
  copy_mid(static_cast<char*>(out.raw_data()), static_cast<char*>(x.raw_data()), outer, big_row, small_row,
           at * inner * es, true);
}

void copy_from_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at) {
  if (outer == 0 || out.numel() == 0) return;
  int64_t es = dtype_size(x.dtype());
  int64_t big_row = x.numel() / outer * es, small_row = out.numel() / outer * es;
  copy_mid(static_cast<char*>(x.raw_data()), static_cast<char*>(out.raw_data()), outer, big_row, small_row,
           at * inner * es, false);
}

void index_select_forward(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer, int64_t inner) {
  int64_t es = dtype_size(x.dtype());
  int64_t n = index.numel(), mid = x.numel() / std::max<int64_t>(outer * inner, 1);
  const char* src = static_cast<const char*>(x.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  dispatch_index(index.dtype(), "index_select", [&](auto tag) {
    using I = decltype(tag);
    const I* idx = index.data<I>();
    parallel_for(outer * n, std::max<int64_t>(1, 4096 / std::max<int64_t>(inner, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        int64_t o = r / n, i = r % n;
        std::memcpy(dst + r * inner * es, src + (o * mid + idx[i]) * inner * es, static_cast<size_t>(inner * es));
      }
    });
  });
}

namespace {
// index_select's backward on bf16 (ops/common/bf16_rows.h): each row of grad_x is
// widened into a per-thread f32 buffer, the rows of grad_out that index names for it
// are added in index order (as the f32 kernel adds them), and the sum is rounded once:
// the bits of cpu::run_kernel's whole-tensor widening. Rows named by no index stay as
// they are (widening and rounding a bf16 value gives it back). The destination rows
// run in parallel: each is written by one thread, whatever the thread count.
template <class I>
void index_select_backward_bf16(Tensor& grad_x, const Tensor& grad_out, const I* idx, int64_t n, int64_t outer,
                                int64_t inner) {
  MT_CHECK(grad_out.dtype() == DType::bf16, "index_select_backward: bf16 grad_x {} with grad_out {}",
           describe(grad_x), describe(grad_out));
  const int64_t mid = grad_x.numel() / std::max<int64_t>(outer * inner, 1);
  // The index inverted: for row m of x, its entries i (ascending) are named[first[m], first[m + 1]).
  std::vector<int64_t> first(static_cast<size_t>(mid + 1), 0), named(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++first[static_cast<size_t>(idx[i]) + 1];
  for (int64_t m = 0; m < mid; ++m) first[static_cast<size_t>(m + 1)] += first[static_cast<size_t>(m)];
  std::vector<int64_t> next(first.begin(), first.end() - 1);
  for (int64_t i = 0; i < n; ++i) named[static_cast<size_t>(next[static_cast<size_t>(idx[i])]++)] = i;
  bf16* gx = grad_x.data<bf16>();
  const bf16* g = grad_out.data<bf16>();
  parallel_for(outer * mid, std::max<int64_t>(1, 4096 / std::max<int64_t>(inner, 1)), [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(static_cast<size_t>(inner)), src(static_cast<size_t>(inner));
    for (int64_t q = lo; q < hi; ++q) {
      const int64_t o = q / mid, m = q % mid;
      const int64_t b = first[static_cast<size_t>(m)], e = first[static_cast<size_t>(m + 1)];
      if (b == e) continue;
      bf16* dst = gx + (o * mid + m) * inner;
      widen_bf16_row(acc.data(), dst, inner);
      for (int64_t t = b; t < e; ++t) {
        widen_bf16_row(src.data(), g + (o * n + named[static_cast<size_t>(t)]) * inner, inner);
        for (int64_t c = 0; c < inner; ++c) acc[static_cast<size_t>(c)] += src[static_cast<size_t>(c)];
      }
      round_bf16_row(dst, acc.data(), inner);
    }
  });
}
}  // namespace

void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                           int64_t inner) {
  int64_t n = index.numel(), mid = grad_x.numel() / std::max<int64_t>(outer * inner, 1);
  if (grad_x.dtype() == DType::bf16) {
    dispatch_index(index.dtype(), "index_select", [&](auto itag) {
      using I = decltype(itag);
      index_select_backward_bf16<I>(grad_x, grad_out, index.data<I>(), n, outer, inner);
    });
    return;
  }
  dispatch_float(grad_x.dtype(), "index_select_backward", [&](auto tag) {
    using T = decltype(tag);
    T* gx = grad_x.data<T>();
    const T* g = grad_out.data<T>();
    dispatch_index(index.dtype(), "index_select", [&](auto itag) {
      using I = decltype(itag);
      const I* idx = index.data<I>();
      auto rows = [&](int64_t o, int64_t c0, int64_t c1) {
        for (int64_t i = 0; i < n; ++i) {
          T* dst = gx + (o * mid + idx[i]) * inner;
          const T* src = g + (o * n + i) * inner;
          for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
        }
      };
      if (outer >= num_threads()) {
        parallel_for(outer, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t o = lo; o < hi; ++o) rows(o, 0, inner);
        });
      } else {
        for (int64_t o = 0; o < outer; ++o)
          parallel_for(inner, 64, [&](int64_t c0, int64_t c1) { rows(o, c0, c1); });
      }
    });
  });
}

}  // namespace moetrain::cpu
