// The body of the CUDA index_select backward (view_cuda.cu), written once for
// the GPU and the host (ops/common/simt.h), so tests/ops/view/index_add_simt_test.cpp
// runs it on the CPU against cpu::index_select_backward.
//
// The host buckets the indices by destination row (index_add_plan below, a CSR:
// the distinct rows named, ascending, each with the positions that name it, in
// order) and uploads it once; one thread per (outer, named row, column) sums
// that row's upstream rows in position order in the arithmetic type (f32 for
// bf16, f64 for f64) and adds the sum to grad_x once: one rounding per element
// whatever the number of tokens, every element written by one thread, so the
// result does not depend on scheduling and has no atomics. Rows no index names
// are not touched.
//
// With the indices on the device (the embedding's device ids) the plan is made
// there, in fixed shapes: the positions stably sorted by index (CUB's radix
// sort; std::stable_sort in the tests), then index_add_run_plan_element below
// writes an uncompacted plan of U = n entries, one per sorted position. An entry
// that starts a run of equal indices holds the run's row and its positions (the
// same ones, in the same order, as index_add_plan's), the others row -1, which
// index_add_element skips: the same sums, the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/common/simt.h"
#include "ops/common/simt_types.h"

namespace moetrain::simt {

// The CSR of an index: rows[u] the u-th distinct value, ascending; positions
// offsets[u] .. offsets[u + 1] - 1 of `positions` the i with index[i] == rows[u],
// ascending. Packed as one array for one upload: [rows (U) | offsets (U + 1) |
// positions (n)].
struct IndexAddPlan {
  int64_t U = 0, n = 0;
  std::vector<int64_t> packed;
  const int64_t* rows() const { return packed.data(); }
  const int64_t* offsets() const { return packed.data() + U; }
  const int64_t* positions() const { return packed.data() + 2 * U + 1; }
};

// Indices in [0, mid) (checked by the op). A counting sort over the rows when
// mid is not much larger than n (the embedding: mid = V), else a radix sort of
// the positions by index (index_select over a long flat tensor: no O(mid) array).
template <class I>
IndexAddPlan index_add_plan(const I* index, int64_t n, int64_t mid) {
  IndexAddPlan p;
  p.n = n;
  std::vector<int64_t> order(static_cast<size_t>(n));  // positions grouped by row, ascending within a row
  std::vector<int64_t> rows, offsets;
  if (mid <= 4 * n + 4096) {
    std::vector<int64_t> start(static_cast<size_t>(mid) + 1, 0);
    for (int64_t i = 0; i < n; ++i) ++start[static_cast<size_t>(index[i]) + 1];
    for (int64_t r = 0; r < mid; ++r) {
      if (start[static_cast<size_t>(r) + 1] > 0) {
        rows.push_back(r);
        offsets.push_back(start[static_cast<size_t>(r)]);
      }
      start[static_cast<size_t>(r) + 1] += start[static_cast<size_t>(r)];
    }
    for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(start[static_cast<size_t>(index[i])]++)] = i;
  } else {
    // An LSD radix sort of (index, position) pairs, 11 bits of the index a pass:
    // stable, so a row's positions stay ascending; O(n) a pass and no O(mid)
    // array. (A comparison sort took 5.7 ms on the router's gather, ops_bench's
    // BM_index_add_plan.)
    constexpr int kBits = 11;
    constexpr int64_t kBuckets = int64_t{1} << kBits;
    std::vector<int64_t> key(static_cast<size_t>(n)), key_tmp(static_cast<size_t>(n)), order_tmp(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      key[static_cast<size_t>(i)] = static_cast<int64_t>(index[i]);
      order[static_cast<size_t>(i)] = i;
    }
    std::vector<int64_t> count(static_cast<size_t>(kBuckets) + 1);
    for (int shift = 0; ((mid - 1) >> shift) > 0; shift += kBits) {
      std::fill(count.begin(), count.end(), 0);
      for (int64_t i = 0; i < n; ++i) ++count[static_cast<size_t>(((key[static_cast<size_t>(i)] >> shift) & (kBuckets - 1)) + 1)];
      for (int64_t b = 0; b < kBuckets; ++b) count[static_cast<size_t>(b) + 1] += count[static_cast<size_t>(b)];
      for (int64_t i = 0; i < n; ++i) {
        const size_t to = static_cast<size_t>(count[static_cast<size_t>((key[static_cast<size_t>(i)] >> shift) & (kBuckets - 1))]++);
        key_tmp[to] = key[static_cast<size_t>(i)];
        order_tmp[to] = order[static_cast<size_t>(i)];
      }
      key.swap(key_tmp);
      order.swap(order_tmp);
    }
    for (int64_t k = 0; k < n; ++k)
      if (k == 0 || key[static_cast<size_t>(k)] != key[static_cast<size_t>(k - 1)]) {
        rows.push_back(key[static_cast<size_t>(k)]);
        offsets.push_back(k);
      }
  }
  p.U = static_cast<int64_t>(rows.size());
  p.packed.reserve(static_cast<size_t>(2 * p.U + 1 + n));
  p.packed.insert(p.packed.end(), rows.begin(), rows.end());
  p.packed.insert(p.packed.end(), offsets.begin(), offsets.end());
  p.packed.push_back(n);
  p.packed.insert(p.packed.end(), order.begin(), order.end());
  return p;
}

// The sort key of an index: itself, or mid for one outside [0, mid) (unchecked
// device ids), so every key fits the sort's bits (those of mid) and such
// positions sort after every row's, in a run that names no row.
MT_HOST_DEVICE inline int64_t index_add_sort_key(int64_t index, int64_t mid) {
  return index >= 0 && index < mid ? index : mid;
}

// Entry k of the uncompacted plan from the stably sorted indices sorted_keys[0 .. n-1]
// (each position's index, ascending; one outside [0, mid) is named by no row):
// rows[k] = sorted_keys[k] where k starts a run of equal keys and the key is in
// range, else -1; offsets[k] = k where k starts a run, else the end of k's run
// (the first sorted position past it). So for a run starting at k, offsets[k]
// .. offsets[k + 1] - 1 are its sorted positions. Entry 0 also writes offsets[n] = n.
MT_HOST_DEVICE inline void index_add_run_plan_element(const int64_t* sorted_keys, int64_t n, int64_t mid, int64_t k,
                                                      int64_t* rows, int64_t* offsets) {
  const int64_t key = sorted_keys[k];
  const bool starts = k == 0 || key != sorted_keys[k - 1];
  rows[k] = starts && key >= 0 && key < mid ? key : -1;
  if (starts) {
    offsets[k] = k;
  } else {  // upper bound of key in sorted_keys[k + 1 .. n - 1]
    int64_t lo = k + 1, hi = n;
    while (lo < hi) {
      const int64_t m = lo + (hi - lo) / 2;
      if (sorted_keys[m] <= key) lo = m + 1;
      else hi = m;
    }
    offsets[k] = lo;
  }
  if (k == 0) offsets[n] = n;
}

// One call: grad_out viewed as [outer, n, inner], grad_x as [outer, mid, inner];
// the plan's arrays where the kernel runs. Made in one expression, in field order:
// IndexAddArgs<T>{grad_x, grad_out, rows, offsets, positions, outer, n, mid, inner, U}.
template <class T>
struct IndexAddArgs {
  T* grad_x = nullptr;
  const T* grad_out = nullptr;
  const int64_t *rows = nullptr, *offsets = nullptr, *positions = nullptr;
  int64_t outer = 0, n = 0, mid = 0, inner = 0, U = 0;
  MT_HOST_DEVICE int64_t elements() const { return outer * U * inner; }
};

// Element e of [outer, U, inner]: grad_x[o, rows[u], c] += Σ_k grad_out[o, positions[k], c]
// over k in offsets[u] .. offsets[u + 1] - 1, in that order, rounded once. An
// entry with rows[u] < 0 (the uncompacted plan's, above) adds nothing.
template <class T>
MT_HOST_DEVICE inline void index_add_element(const IndexAddArgs<T>& a, int64_t e) {
  using A = acc_of_t<T>;
  const int64_t c = e % a.inner, r = e / a.inner, u = r % a.U, o = r / a.U;
  if (a.rows[u] < 0) return;
  A acc = 0;
  for (int64_t k = a.offsets[u]; k < a.offsets[u + 1]; ++k)
    acc += acc_load(a.grad_out[(o * a.n + a.positions[k]) * a.inner + c]);
  T& dst = a.grad_x[(o * a.mid + a.rows[u]) * a.inner + c];
  acc_store(dst, acc_load(dst) + acc);
}

// One block's elements first .. first + threads - 1 (those below elements()):
// consecutive threads take consecutive columns (coalesced), and for narrow rows
// (inner 1: the router's index_select) consecutive named rows.
MT_SIMT_BODY
template <class Block, class T>
MT_HOST_DEVICE void index_add_block(const Block& blk, const IndexAddArgs<T>& a, int64_t first) {
  const int64_t total = a.elements();
  blk.each([&](int tid) {
    if (first + tid < total) index_add_element(a, first + tid);
  });
}

}  // namespace moetrain::simt
