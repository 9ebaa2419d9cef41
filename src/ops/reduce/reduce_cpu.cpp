#include <cmath>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/reduce/reduce_kernels.h"

namespace moetrain::cpu {

void sum_dim(Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner) {
  dispatch_float(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* po = out.data<T>();
    if (inner == 1) {
      parallel_for(outer, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
        for (int64_t o = lo; o < hi; ++o) {
          double acc = 0;
          const T* row = px + o * n;
          for (int64_t i = 0; i < n; ++i) acc += row[i];
          po[o] = static_cast<T>(acc);
        }
      });
      return;
    }
    // Columns: each (outer, column range) is owned by one thread.
    int64_t col_chunks = std::max<int64_t>(1, std::min<int64_t>(num_threads(), inner / 64));
    parallel_for(outer * col_chunks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<double> acc;
      for (int64_t w = lo; w < hi; ++w) {
        int64_t o = w / col_chunks, c = w % col_chunks;
        int64_t c0 = inner * c / col_chunks, c1 = inner * (c + 1) / col_chunks;
        acc.assign(static_cast<size_t>(c1 - c0), 0.0);
        for (int64_t i = 0; i < n; ++i) {
          const T* row = px + (o * n + i) * inner;
          for (int64_t j = c0; j < c1; ++j) acc[static_cast<size_t>(j - c0)] += row[j];
        }
        for (int64_t j = c0; j < c1; ++j) po[o * inner + j] = static_cast<T>(acc[static_cast<size_t>(j - c0)]);
      }
    });
  });
}

void sum_all(Tensor& out, const Tensor& x) {
  dispatch_float(x.dtype(), "sum", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    constexpr int64_t kBlock = 4096;  // fixed blocks: the result does not depend on the thread count
    int64_t n = x.numel(), blocks = (n + kBlock - 1) / kBlock;
    std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
    parallel_for(blocks, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        double acc = 0;
        for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) acc += px[i];
        partial[static_cast<size_t>(b)] = acc;
      }
    });
    double total = 0;
    for (double p : partial) total += p;
    out.data<T>()[0] = static_cast<T>(total);
  });
}

void max_dim(Tensor& values, Tensor& indices, const Tensor& x, int64_t outer, int64_t n, int64_t inner) {
  dispatch_float(x.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* pv = values.data<T>();
    int64_t* pi = indices.data<int64_t>();
    parallel_for(outer * inner, 1024, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        int64_t o = w / inner, j = w % inner;
        const T* base = px + o * n * inner + j;
        T best = base[0];
        int64_t arg = 0;
        for (int64_t i = 1; i < n; ++i) {
          T v = base[i * inner];
          if (v > best || (v != v && best == best)) {  // NaN wins, as in PyTorch
            best = v;
            arg = i;
          }
        }
        pv[w] = best;
        pi[w] = arg;
      }
    });
  });
}

void max_dim_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices, int64_t outer, int64_t n,
                      int64_t inner) {
  dispatch_float(grad.dtype(), "max_backward", [&](auto tag) {
    using T = decltype(tag);
    T* gx = grad_x.data<T>();
    const T* g = grad.data<T>();
    const int64_t* pi = indices.data<int64_t>();
    parallel_for(outer * inner, 4096, [&](int64_t lo, int64_t hi) {
      for (int64_t w = lo; w < hi; ++w) {
        int64_t o = w / inner, j = w % inner;
        gx[(o * n + pi[w]) * inner + j] = g[w];
      }
    });
  });
}

int64_t count_non_finite(const Tensor& x) {
  auto count = [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    constexpr int64_t kBlock = 1 << 16;
    const int64_t n = x.numel(), blocks = (n + kBlock - 1) / kBlock;
    std::vector<int64_t> partial(static_cast<size_t>(blocks), 0);
    parallel_for(blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) {
        int64_t bad = 0;
        for (int64_t i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) bad += !std::isfinite(to_double(px[i]));
        partial[static_cast<size_t>(b)] = bad;
      }
    });
    int64_t total = 0;
    for (int64_t p : partial) total += p;
    return total;
  };
  if (x.dtype() == DType::bf16) return count(bf16{});
  return dispatch_float(x.dtype(), "count_non_finite", count);
}

}  // namespace moetrain::cpu
