// The expert plan and the token gather on the CPU: the bodies of moe_plan_simt.h
// after std::stable_sort (the GPU sorts with CUB, also stable on the expert id).
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/dispatch.h"
#include "core/parallel.h"
#include "ops/common/simt_types.h"
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

// A copy of rows: any dtype, bf16 included (bf16_widen.h lists it as native).
void moe_gather_forward(Tensor& rows, const Tensor& z, const Tensor& row_token) {
  const int64_t M = rows.size(0), row_bytes = rows.size(1) * dtype_size(z.dtype());
  const int64_t* token = row_token.data<int64_t>();
  const char* src = static_cast<const char*>(z.raw_data());
  char* dst = static_cast<char*>(rows.raw_data());
  parallel_for(M, std::max<int64_t>(1, 16384 / std::max<int64_t>(row_bytes, 1)), [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) std::memcpy(dst + i * row_bytes, src + token[i] * row_bytes, row_bytes);
  });
}

namespace {

// Token by token: its rows in the body's order (moe_gather_rows), summed a row at a
// time from 0 in Acc, each element the body's sum in the same order, stored once.
template <class T, class Acc>
void gather_grad_tokens(T* dz, const T* g, const int64_t* slot_row, int64_t N, int64_t W, int64_t k, int64_t M) {
  parallel_for(N, std::max<int64_t>(1, 1024 / std::max<int64_t>(W, 1)), [&](int64_t lo, int64_t hi) {
    int64_t rows[64];
    std::vector<Acc> acc(static_cast<size_t>(W));
    for (int64_t n = lo; n < hi; ++n) {
      const int64_t m = simt::moe_gather_rows(slot_row, n, k, M, rows);
      std::fill(acc.begin(), acc.end(), Acc(0));
      for (int64_t j = 0; j < m; ++j) {
        const T* src = g + rows[j] * W;
        for (int64_t c = 0; c < W; ++c) acc[c] += simt::acc_load(src[c]);
      }
      for (int64_t c = 0; c < W; ++c) simt::acc_store(dz[n * W + c], acc[c]);
    }
  });
}

}  // namespace

void moe_gather_backward(Tensor& grad_z, const Tensor& grad_rows, const Tensor& slot_row) {
  const int64_t N = grad_z.size(0), W = grad_z.size(1), M = grad_rows.size(0);
  const int64_t k = N > 0 ? slot_row.numel() / N : 0;
  const int64_t* sr = slot_row.data<int64_t>();
  if (grad_z.dtype() == DType::bf16)  // f32 sums, one rounding: the widened kernel's bits
    return gather_grad_tokens<bf16, float>(grad_z.data<bf16>(), grad_rows.data<bf16>(), sr, N, W, k, M);
  dispatch_float(grad_z.dtype(), "moe_gather_backward", [&](auto tag) {
    using T = decltype(tag);
    gather_grad_tokens<T, T>(grad_z.data<T>(), grad_rows.data<T>(), sr, N, W, k, M);
  });
}

}  // namespace moetrain::cpu
