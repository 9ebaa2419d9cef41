// CPU kernels of the softmax family: one row per task, max-subtracted
// exponentials accumulated in double.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/common/math.h"
#include "ops/softmax/softmax_kernels.h"

namespace moetrain::cpu {

namespace {
// log Σ e^x, max-subtracted; -inf for an all -inf row. Run in the cpu::vector_isa()
// copy (run_vector_isa: AVX-512, AVX2 + FMA or generic; the vocabulary rows are the
// bulk of a small model's non-GEMM time). The sums' order is fixed by kLanes, so
// the AVX-512 and AVX2 copies give the same bits.
template <class T>
inline double row_logsumexp(const T* x, int64_t n) {
  T m = max_of(x, n);
  if (std::isinf(m) && m < 0) return m;
  return static_cast<double>(m) + std::log(sum_exp(x, n, m));
}
// grad = scale · e^{x - lse} over a row (the target's entry is fixed by the caller).
template <class T>
inline void row_softmax_scaled(T* __restrict grad, const T* __restrict x, int64_t n, T scale, T lse) {
  for (int64_t j = 0; j < n; ++j) grad[j] = scale * exp_of(x[j] - lse);
}
}  // namespace

void softmax_forward(Tensor& y, const Tensor& x, bool log) {
  dispatch_float(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* xr = px + r * n;
        T* yr = py + r * n;
        // Relative to the row max m (exact in T): y = e^{x-m} / Σ, log y = (x - m) - log Σ.
        T m = max_of(xr, n);
        for (int64_t j = 0; j < n; ++j) yr[j] = exp_of(xr[j] - m);
        double s = sum_of(yr, n);
        if (log) {
          T log_s = static_cast<T>(std::log(s));
          for (int64_t j = 0; j < n; ++j) yr[j] = (xr[j] - m) - log_s;
        } else {
          T inv = static_cast<T>(1.0 / s);
          for (int64_t j = 0; j < n; ++j) yr[j] *= inv;
        }
      }
    });
  });
}

void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log) {
  dispatch_float(y.dtype(), "softmax_backward", [&](auto tag) {
    using T = decltype(tag);
    int64_t n = y.size(-1), rows = y.numel() / std::max<int64_t>(n, 1);
    const T* py = y.data<T>();
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(n, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const T* yr = py + r * n;
        const T* gr = gy + r * n;
        T* xr = gx + r * n;
        double dot = 0;
        if (log) {
          for (int64_t j = 0; j < n; ++j) dot += gr[j];
          for (int64_t j = 0; j < n; ++j) xr[j] = static_cast<T>(gr[j] - exp_of(yr[j]) * dot);
        } else {
          for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(gr[j]) * yr[j];
          for (int64_t j = 0; j < n; ++j) xr[j] = static_cast<T>(yr[j] * (gr[j] - dot));
        }
      }
    });
  });
}

void cross_entropy_forward(Tensor& lse, double& loss_sum, int64_t& count, const Tensor& logits,
                           const Tensor& targets, int64_t ignore_index, int64_t num_classes) {
  // bf16 logits: each row is widened into a per-thread f32 buffer and takes the f32
  // code below, so the results are those of the f32 kernel on the widened logits
  // (cpu::run_kernel's widening) without an f32 copy of the whole [N, V] tensor.
  const bool narrow = logits.dtype() == DType::bf16;
  dispatch_float(narrow ? DType::f32 : logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy", [&](auto itag) {
      using I = decltype(itag);
      int64_t v = logits.size(-1), rows = logits.numel() / std::max<int64_t>(v, 1);
      const T* px = narrow ? nullptr : logits.data<T>();
      const bf16* pb = narrow ? logits.data<bf16>() : nullptr;
      const I* pt = targets.data<I>();
      double* pl = lse.data<double>();
      std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
      parallel_for(rows, 1, [&](int64_t lo, int64_t hi) {
        std::vector<T> widened(narrow ? static_cast<size_t>(num_classes) : 0);
        for (int64_t r = lo; r < hi; ++r) {
          const T* xr = px ? px + r * v : widened.data();
          if constexpr (std::is_same_v<T, float>)
            if (narrow) widen_bf16_row(widened.data(), pb + r * v, num_classes);
          double l = run_vector_isa([](auto... a) { return row_logsumexp<T>(a...); }, xr, num_classes);
          pl[r] = l;
          if (pt[r] != ignore_index) row_loss[static_cast<size_t>(r)] = l - static_cast<double>(xr[pt[r]]);
        }
      });
      loss_sum = 0;
      count = 0;
      for (int64_t r = 0; r < rows; ++r) {  // fixed order: thread-count independent
        if (pt[r] == ignore_index) continue;
        loss_sum += row_loss[static_cast<size_t>(r)];
        count += 1;
      }
    });
  });
}

void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            double scale, int64_t ignore_index, int64_t num_classes) {
  // bf16 logits and gradient: per row, the f32 code below on the widened row into a
  // per-thread f32 buffer, rounded once into the bf16 row (as cross_entropy_forward).
  const bool narrow = logits.dtype() == DType::bf16;
  MT_CHECK(grad_logits.dtype() == logits.dtype(), "cross_entropy_backward: grad_logits is {} but logits {}",
           grad_logits.dtype(), logits.dtype());
  dispatch_float(narrow ? DType::f32 : logits.dtype(), "cross_entropy_backward", [&](auto tag) {
    using T = decltype(tag);
    dispatch_index(targets.dtype(), "cross_entropy", [&](auto itag) {
      using I = decltype(itag);
      int64_t v = logits.size(-1), rows = logits.numel() / std::max<int64_t>(v, 1);
      const T* px = narrow ? nullptr : logits.data<T>();
      const bf16* pb = narrow ? logits.data<bf16>() : nullptr;
      const I* pt = targets.data<I>();
      const double* pl = lse.data<double>();
      T* pg = narrow ? nullptr : grad_logits.data<T>();
      bf16* pgb = narrow ? grad_logits.data<bf16>() : nullptr;
      parallel_for(rows, 1, [&](int64_t lo, int64_t hi) {
        std::vector<T> widened(narrow ? static_cast<size_t>(num_classes) : 0);
        std::vector<T> grad_row(narrow ? static_cast<size_t>(v) : 0);
        for (int64_t r = lo; r < hi; ++r) {
          T* gr = pg ? pg + r * v : grad_row.data();
          if (pt[r] == ignore_index) {
            std::fill(gr, gr + v, T(0));
          } else {
            const T* xr = px ? px + r * v : widened.data();
            if constexpr (std::is_same_v<T, float>)
            if (narrow) widen_bf16_row(widened.data(), pb + r * v, num_classes);
            double l = pl[r];
            T sc = static_cast<T>(scale), lt = static_cast<T>(l);  // rounding lse to T costs <= 1 ulp of it
            run_vector_isa([](auto... a) { row_softmax_scaled<T>(a...); }, gr, xr, num_classes, sc, lt);
            std::fill(gr + num_classes, gr + v, T(0));  // padding columns: outside the softmax
            gr[pt[r]] = static_cast<T>(scale * (std::exp(static_cast<double>(xr[pt[r]]) - l) - 1.0));
          }
          if constexpr (std::is_same_v<T, float>)
            if (narrow) round_bf16_row(pgb + r * v, grad_row.data(), v);
        }
      });
    });
  });
}

}  // namespace moetrain::cpu
