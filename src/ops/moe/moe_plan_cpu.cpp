// The expert plan and the token gather on the CPU: the bodies of moe_plan_simt.h
// after std::stable_sort (the GPU sorts with CUB, also stable on the expert id).
#include <algorithm>
#include <numeric>
#include <vector>

#include "core/dispatch.h"
#include "core/parallel.h"
#include "ops/moe/moe_kernels.h"
#include "ops/moe/moe_plan_simt.h"

namespace moetrain::cpu {

void plan_expert_rows(Tensor& counts, Tensor& offsets, Tensor& row_token, Tensor& slot_row, const Tensor& ids,
                      int64_t k, int64_t capacity) {
  const int64_t A = ids.numel(), E = counts.numel() - 1;
  const int64_t* id = ids.data<int64_t>();
  std::vector<int32_t> slot(static_cast<size_t>(A)), expert(static_cast<size_t>(A));
  std::iota(slot.begin(), slot.end(), 0);
  std::stable_sort(slot.begin(), slot.end(), [id](int32_t a, int32_t b) { return id[a] < id[b]; });
  for (int64_t i = 0; i < A; ++i) expert[static_cast<size_t>(i)] = static_cast<int32_t>(id[slot[static_cast<size_t>(i)]]);
  std::vector<int64_t> start(static_cast<size_t>(E) + 1);
  for (int64_t e = 0; e <= E; ++e) start[static_cast<size_t>(e)] = simt::expert_plan_start(expert.data(), A, e);
  simt::expert_plan_offsets(start.data(), E, capacity, counts.data<int64_t>(), offsets.data<int64_t>());
  int64_t* token = row_token.data<int64_t>();
  std::fill(token, token + A, 0);
  for (int64_t i = 0; i < A; ++i)
    simt::expert_plan_scatter(i, expert.data(), slot.data(), start.data(), offsets.data<int64_t>(), k, A, token,
                              slot_row.data<int64_t>());
}

void moe_gather_forward(Tensor& rows, const Tensor& z, const Tensor& row_token) {
  const int64_t M = rows.size(0), W = rows.size(1);
  const int64_t* token = row_token.data<int64_t>();
  dispatch_float(z.dtype(), "moe_gather", [&](auto tag) {
    using T = decltype(tag);
    const T* src = z.data<T>();
    T* dst = rows.data<T>();
    parallel_for(M, std::max<int64_t>(1, 4096 / std::max<int64_t>(W, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) std::copy(src + token[i] * W, src + (token[i] + 1) * W, dst + i * W);
    });
  });
}

void moe_gather_backward(Tensor& grad_z, const Tensor& grad_rows, const Tensor& slot_row) {
  const int64_t N = grad_z.size(0), W = grad_z.size(1), M = grad_rows.size(0);
  const int64_t k = N > 0 ? slot_row.numel() / N : 0;
  const int64_t* sr = slot_row.data<int64_t>();
  dispatch_float(grad_z.dtype(), "moe_gather_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* g = grad_rows.data<T>();
    T* dz = grad_z.data<T>();
    parallel_for(N, std::max<int64_t>(1, 1024 / std::max<int64_t>(W, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t n = lo; n < hi; ++n)
        for (int64_t c = 0; c < W; ++c) dz[n * W + c] = simt::moe_gather_grad<T, T>(g, sr, n, c, W, k, M);
    });
  });
}

}  // namespace moetrain::cpu
