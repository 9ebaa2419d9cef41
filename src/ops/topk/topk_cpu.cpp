#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/topk/topk_kernels.h"

namespace moetrain::cpu {

void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k) {
  dispatch_float(x.dtype(), "topk", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    T* pv = values.data<T>();
    int64_t* pi = indices.data<int64_t>();
    parallel_for(rows, std::max<int64_t>(1, 2048 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
      std::vector<int64_t> order(static_cast<size_t>(n));
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        std::iota(order.begin(), order.end(), 0);
        // Strict weak order: NaN first, then larger values, then lower index.
        auto before = [xr](int64_t a, int64_t b) {
          bool na = std::isnan(xr[a]), nb = std::isnan(xr[b]);
          if (na != nb) return na;
          if (!na && xr[a] != xr[b]) return xr[a] > xr[b];
          return a < b;
        };
        std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
        for (int64_t j = 0; j < k; ++j) {
          pv[r * k + j] = xr[order[static_cast<size_t>(j)]];
          pi[r * k + j] = order[static_cast<size_t>(j)];
        }
      }
    });
  });
}

void gather_last_forward(Tensor& out, const Tensor& x, const Tensor& index) {
  dispatch_float(x.dtype(), "gather_last", [&](auto tag) {
    using T = decltype(tag);
    const int64_t k = index.size(-1), n = x.size(-1), rows = index.numel() / std::max<int64_t>(k, 1);
    const T* px = x.data<T>();
    const int64_t* pi = index.data<int64_t>();
    T* po = out.data<T>();
    parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(k, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        for (int64_t j = 0; j < k; ++j) po[r * k + j] = px[r * n + pi[r * k + j]];
    });
  });
}

void scatter_last(Tensor& grad_x, const Tensor& grad, const Tensor& indices) {
  dispatch_float(grad.dtype(), "scatter_last", [&](auto tag) {
    using T = decltype(tag);
    int64_t k = grad.size(-1), n = grad_x.size(-1), rows = grad_x.numel() / std::max<int64_t>(n, 1);
    const T* g = grad.data<T>();
    const int64_t* pi = indices.data<int64_t>();
    T* gx = grad_x.data<T>();
    parallel_for(rows, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        std::fill(gx + r * n, gx + (r + 1) * n, T(0));
        for (int64_t j = 0; j < k; ++j) gx[r * n + pi[r * k + j]] += g[r * k + j];
      }
    });
  });
}

}  // namespace moetrain::cpu
