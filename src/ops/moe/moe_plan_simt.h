// The MoE layer's expert plan and its token gather, written once for the host and
// the GPU (ops/common/simt.h's convention): moe_plan_cpu.cpp and moe_plan_cuda.cu
// run these bodies, so the CPU tests of tests/ops/moe/moe_plan_test.cpp check the
// code the GPU runs, except the sort (std::stable_sort on the host, CUB's stable
// radix sort on the GPU: the same order, since both are stable on the expert id).
//
// The plan (docs/model.md#moe, docs/cuda.md "Host synchronisation"): the N·k
// assignments a = n·k + s (token n, slot s) sorted by expert, stably, give
//   start[e]    the first sorted position whose expert is >= e (e = 0..E)
//   counts[e]   the rows expert e keeps: its assignments, at most `capacity` (0 =
//               no limit), the first ones in assignment order; counts[E] the dropped
//   offsets[e]  expert e's rows are [offsets[e], offsets[e + 1]); offsets[E] rows kept
//   row_token   the token of each kept row (rows from offsets[E] on: padding, token 0)
//   slot_row    each assignment's row, or N·k for a dropped one
// which is plan_experts' order (nn/moe.h) with every shape fixed at N·k rows, so
// nothing about it has to reach the host.
#pragma once

#include <cstdint>

#include "ops/common/simt_types.h"

namespace moetrain::simt {

// start[e] for sorted expert ids `sorted` [A]: a lower bound.
MT_HOST_DEVICE inline int64_t expert_plan_start(const int32_t* sorted, int64_t A, int64_t e) {
  int64_t lo = 0, hi = A;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < e) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// counts [E + 1] and offsets [E + 1] from start [E + 1]: one thread, in expert order.
MT_HOST_DEVICE inline void expert_plan_offsets(const int64_t* start, int64_t E, int64_t capacity, int64_t* counts,
                                               int64_t* offsets) {
  int64_t dropped = 0;
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = start[e + 1] - start[e];
    const int64_t kept = capacity > 0 && n > capacity ? capacity : n;
    counts[e] = kept;
    dropped += n - kept;
    offsets[e + 1] = offsets[e] + kept;
  }
  counts[E] = dropped;
}

// Sorted position i: its assignment's row (kept) or the dropped mark N·k = A.
// row_token's padding rows are zeroed before.
MT_HOST_DEVICE inline void expert_plan_scatter(int64_t i, const int32_t* sorted_expert, const int32_t* sorted_slot,
                                               const int64_t* start, const int64_t* offsets, int64_t k, int64_t A,
                                               int64_t* row_token, int64_t* slot_row) {
  const int64_t e = sorted_expert[i], a = sorted_slot[i], rank = i - start[e];
  if (rank < offsets[e + 1] - offsets[e]) {
    const int64_t row = offsets[e] + rank;
    row_token[row] = a / k;
    slot_row[a] = row;
  } else {
    slot_row[a] = A;
  }
}

// Token n's kept rows (slot_row < M) in increasing order, into rows[0..m); returns
// m. k <= 64. The gather's gradient for token n sums its rows' gradients in this
// order from 0 (index_select's backward adds them in this order: the same bits).
MT_HOST_DEVICE inline int64_t moe_gather_rows(const int64_t* slot_row, int64_t n, int64_t k, int64_t M,
                                              int64_t* rows) {
  int64_t m = 0;
  for (int64_t s = 0; s < k; ++s) {
    const int64_t r = slot_row[n * k + s];
    if (r >= M) continue;
    int64_t j = m++;
    for (; j > 0 && rows[j - 1] > r; --j) rows[j] = rows[j - 1];  // insertion: k is small
    rows[j] = r;
  }
  return m;
}

}  // namespace moetrain::simt
