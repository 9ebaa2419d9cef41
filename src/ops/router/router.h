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
  // `selected` [N, k] i64 where the scores are; `pending` its copy on the way to the host (CUDA).
  SelectedExperts(Tensor selected, std::unique_ptr<cuda::PendingCopy> pending);
  SelectedExperts(SelectedExperts&&) noexcept;
  SelectedExperts& operator=(SelectedExperts&&) noexcept;
  ~SelectedExperts();
  // The ids [N, k] (i64) on the scores' device, usable at once (gather_last).
  const Tensor& tensor() const { return selected_; }
  // The N·k ids on the host, as select_experts returns them (waits the first time).
  const std::vector<int64_t>& ids();

 private:
  Tensor selected_;
  std::vector<int64_t> ids_;
  std::unique_ptr<cuda::PendingCopy> pending_;
  bool have_ids_ = false;
};
// ids_to_host false: no copy is started (a caller that plans on the device;
// ids() then copies and waits).
SelectedExperts start_select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group = 1,
                                     int64_t topk_group = 1, bool ids_to_host = true);

}  // namespace moetrain
