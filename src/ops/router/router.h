// The MoE router's expert selection (docs/model.md#moe-router), no gradient: the
// CPU kernel in router_cpu.cpp, the CUDA one in router_cuda.cu (its body in
// router_simt.h, run on the host by the tests), both declared in router_kernels.h.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

namespace cuda {
class PendingCopy;
}

// Top-k selection: for each of the N rows of scores + bias [N, E], in double, the
// k first in the order NaN, then larger, then the lower index; group-limited when
// n_group > 1 (groups ranked in the same order by the sum of their two first biased
// scores, the first topk_group kept). Returns N·k expert ids, row-major (token,
// slot), each row in that order. CUDA scores are ranked on the GPU (the same
// picks) and only the ids come back.
std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group = 1,
                                    int64_t topk_group = 1);

// select_experts in two steps, for a caller with GPU work to queue meanwhile
// (docs/cuda.md, "Host synchronisation"): start_select_experts queues the selection
// and, for CUDA scores, the copy of the ids into pinned host memory, and returns;
// ids() waits for them (the first time). CPU scores are selected at once.
class SelectedExperts {
 public:
  SelectedExperts(std::vector<int64_t> ids, std::unique_ptr<cuda::PendingCopy> pending, int64_t count);
  SelectedExperts(SelectedExperts&&) noexcept;
  SelectedExperts& operator=(SelectedExperts&&) noexcept;
  ~SelectedExperts();
  // The N·k ids, as select_experts returns them.
  const std::vector<int64_t>& ids();

 private:
  std::vector<int64_t> ids_;
  std::unique_ptr<cuda::PendingCopy> pending_;
  int64_t count_ = 0;
};
SelectedExperts start_select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group = 1,
                                     int64_t topk_group = 1);

}  // namespace moetrain
