// The router's selection on the CPU (ops/router/router.h): rows in parallel, each
// ranked with the order of simt::ranks_first (the CUDA body's, so both pick alike).
#include <algorithm>
#include <numeric>
#include <vector>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/router/router_kernels.h"
#include "ops/router/router_simt.h"

namespace moetrain::cpu {

void select_experts(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                    int64_t topk_group) {
  const int64_t N = scores.size(0), E = scores.size(1);
  // f32/f64 scores are read in place (widened per element), others (bf16) widened first.
  const bool native = scores.dtype() == DType::f32 || scores.dtype() == DType::f64;
  const Tensor sc = native ? scores : scores.to(DType::f64), b64 = bias.to(DType::f64);
  const double* b = b64.data<double>();
  const int64_t G = E / n_group;
  int64_t* out = experts.data<int64_t>();
  // Rows are independent: chunks of rows in parallel, each with its own buffers.
  dispatch_float(sc.dtype(), "select_experts", [&](auto tag) {
    using S = decltype(tag);
    const S* s = sc.data<S>();
    parallel_for(N, 64, [&](int64_t lo, int64_t hi) {
      std::vector<double> c(static_cast<size_t>(E));
      std::vector<int64_t> idx(static_cast<size_t>(E)), groups(static_cast<size_t>(n_group)), kept;
      std::vector<double> group_score(static_cast<size_t>(n_group));
      // a before b: larger value, then lower index; NaN ranks first (never silently skipped).
      auto before = [&](int64_t i, int64_t j) { return simt::ranks_first(c[i], i, c[j], j); };
      for (int64_t n = lo; n < hi; ++n) {
        for (int64_t e = 0; e < E; ++e) c[e] = static_cast<double>(s[n * E + e]) + b[e];
        std::iota(idx.begin(), idx.end(), 0);
        if (n_group > 1) {
          for (int64_t g = 0; g < n_group; ++g) {  // sum of the two first biased scores of the group
            auto first = idx.begin() + g * G, last = first + G;
            const int64_t top = std::min<int64_t>(2, G);
            std::partial_sort(first, first + top, last, before);
            group_score[g] = 0;
            for (int64_t i = 0; i < top; ++i) group_score[g] += c[first[i]];
          }
          std::iota(groups.begin(), groups.end(), 0);
          std::partial_sort(groups.begin(), groups.begin() + topk_group, groups.end(), [&](int64_t x, int64_t y) {
            return simt::ranks_first(group_score[x], x, group_score[y], y);
          });
          kept.clear();
          for (int64_t i = 0; i < topk_group; ++i)
            for (int64_t e = groups[i] * G; e < (groups[i] + 1) * G; ++e) kept.push_back(e);
          std::partial_sort(kept.begin(), kept.begin() + k, kept.end(), before);
          std::copy(kept.begin(), kept.begin() + k, out + n * k);
        } else {
          std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), before);
          std::copy(idx.begin(), idx.begin() + k, out + n * k);
        }
      }
    });
  });
}

}  // namespace moetrain::cpu
