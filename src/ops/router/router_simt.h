// The body of the CUDA router selection kernel (router_cuda.cu): for each token
// the top-k experts of scores + bias, group-limited when n_group > 1, exactly as
// the CPU's select_experts (ops/router/router_cpu.cpp) picks them: the biased scores summed in
// double, the order NaN first, then larger, then the lower index; groups ranked
// by the sum of their two best biased scores (same order), the best topk_group
// kept. Written once for the GPU and the host (ops/common/simt.h), so
// tests/ops/router/router_simt_test.cpp runs this very body on the CPU against
// select_experts. One block per token row; the k picks are k rounds of "the
// first in the order after the previous pick" (a strided scan, then a tree over
// the block's threads), as the topk kernel does: O(k E / threads) per row with
// no sort.
#pragma once

#include <cstdint>

#include "ops/common/simt.h"

namespace moetrain::simt {

template <class T>
struct ExpertSelectArgs {
  const T* scores = nullptr;   // [N, E]
  const double* bias = nullptr;  // [E]
  int64_t* experts = nullptr;  // [N, k]: ids, each row in order
  int64_t N = 0, E = 0, k = 1, n_group = 1, topk_group = 1;
};

// Doubles of `sh` for a block of `threads` (a power of two): the biased scores,
// the group scores and kept flags, one candidate per thread (value and index),
// the previous pick (value and index).
inline int64_t expert_select_shared_elements(int64_t E, int64_t n_group, int threads) {
  return E + 2 * n_group + 2 * static_cast<int64_t>(threads) + 2;
}

// a ranks before b: NaN first, then the larger value, then the lower index; an
// index < 0 is "none" and ranks after everything.
MT_HOST_DEVICE inline bool ranks_first(double a, int64_t ia, double b, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  const bool na = a != a, nb = b != b;
  if (na != nb) return na;
  if (!na && a != b) return a > b;
  return ia < ib;
}

MT_SIMT_BODY
template <class Block, class T>
MT_HOST_DEVICE void expert_select_row(const Block& blk, const ExpertSelectArgs<T>& a, int64_t row, double* sh) {
  const int threads = blk.threads;
  const int64_t E = a.E, G = E / a.n_group;
  double *c = sh, *group_score = sh + E, *kept = group_score + a.n_group;
  double *best = kept + a.n_group, *best_idx = best + threads, *prev = best_idx + threads;
  blk.each([&](int tid) {
    for (int64_t e = tid; e < E; e += threads) c[e] = static_cast<double>(a.scores[row * E + e]) + a.bias[e];
  });
  if (a.n_group > 1) {
    // Group g's score: the sum of its two first (one when a group has one expert).
    blk.each([&](int tid) {
      for (int64_t g = tid; g < a.n_group; g += threads) {
        int64_t i1 = -1, i2 = -1;
        for (int64_t e = g * G; e < (g + 1) * G; ++e) {
          if (ranks_first(c[e], e, i1 < 0 ? 0.0 : c[i1], i1)) {
            i2 = i1;
            i1 = e;
          } else if (ranks_first(c[e], e, i2 < 0 ? 0.0 : c[i2], i2)) {
            i2 = e;
          }
        }
        group_score[g] = i2 < 0 ? c[i1] : c[i1] + c[i2];
      }
    });
    // The topk_group first groups (few: one thread).
    blk.each([&](int tid) {
      if (tid != 0) return;
      for (int64_t g = 0; g < a.n_group; ++g) kept[g] = 0;
      for (int64_t pick = 0; pick < a.topk_group; ++pick) {
        int64_t b = -1;
        for (int64_t g = 0; g < a.n_group; ++g)
          if (kept[g] == 0 && ranks_first(group_score[g], g, b < 0 ? 0.0 : group_score[b], b)) b = g;
        kept[b] = 1;
      }
    });
  }
  for (int64_t j = 0; j < a.k; ++j) {
    // Each thread's first candidate after the previous pick, among the kept groups' experts.
    blk.each([&](int tid) {
      const double pv = j == 0 ? 0.0 : prev[0];
      const int64_t pi = j == 0 ? -1 : static_cast<int64_t>(prev[1]);
      int64_t b = -1;
      for (int64_t e = tid; e < E; e += threads) {
        if (a.n_group > 1 && kept[e / G] == 0) continue;
        if (j > 0 && !ranks_first(pv, pi, c[e], e)) continue;
        if (ranks_first(c[e], e, b < 0 ? 0.0 : c[b], b)) b = e;
      }
      best[tid] = b < 0 ? 0.0 : c[b];
      best_idx[tid] = static_cast<double>(b);
    });
    // Tree over the threads: step s combines thread tid < s with tid + s.
    for (int s = threads / 2; s >= 1; s /= 2)
      blk.each([&](int tid) {
        if (tid >= s) return;
        const int64_t i = static_cast<int64_t>(best_idx[tid]), o = static_cast<int64_t>(best_idx[tid + s]);
        if (ranks_first(best[tid + s], o, best[tid], i)) {
          best[tid] = best[tid + s];
          best_idx[tid] = best_idx[tid + s];
        }
      });
    blk.each([&](int tid) {
      if (tid != 0) return;
      prev[0] = best[0];
      prev[1] = best_idx[0];
      a.experts[row * a.k + j] = static_cast<int64_t>(best_idx[0]);
    });
  }
}

}  // namespace moetrain::simt
