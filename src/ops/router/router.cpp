#include "ops/router/router.h"

#include "backend/cuda/pending_copy.h"
#include "ops/common/on_device.h"
#include "ops/router/router_kernels.h"

namespace moetrain {

SelectedExperts::SelectedExperts(Tensor selected, std::unique_ptr<cuda::PendingCopy> pending)
    : selected_(std::move(selected)), pending_(std::move(pending)) {}
SelectedExperts::SelectedExperts(SelectedExperts&&) noexcept = default;
SelectedExperts& SelectedExperts::operator=(SelectedExperts&&) noexcept = default;
SelectedExperts::~SelectedExperts() = default;

const std::vector<int64_t>& SelectedExperts::ids() {
  if (!have_ids_) {
    const int64_t count = selected_.numel();
    if (pending_) {
      const auto* p = static_cast<const int64_t*>(pending_->wait());
      ids_.assign(p, p + count);
    } else {  // on the host already, or a GPU selection started without its copy
      const Tensor host = selected_.to(kCpu);
      ids_.assign(host.data<int64_t>(), host.data<int64_t>() + count);
    }
    pending_.reset();  // the pinned block goes back to the pool
    have_ids_ = true;
  }
  return ids_;
}

SelectedExperts start_select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                                     int64_t topk_group, bool ids_to_host) {
  MT_CHECK(scores.dim() == 2, "select_experts: scores must be [N, E], got {}", scores.shape());
  const int64_t N = scores.size(0), E = scores.size(1);
  MT_CHECK(bias.shape() == Shape{E}, "select_experts: bias {} must be [{}]", bias.shape(), E);
  MT_CHECK(k >= 1 && k <= E, "select_experts: top_k = {} must be in [1, {}]", k, E);
  MT_CHECK(n_group >= 1 && E % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
               k <= topk_group * (E / n_group),
           "select_experts: {} experts in {} groups, {} groups kept, top_k {}: groups must divide the experts and the "
           "kept groups hold at least top_k experts",
           E, n_group, topk_group, k);
  Tensor experts = empty({N, k}, DType::i64, scores.device());
  MT_ON_DEVICE(scores, select_experts, experts, scores, bias, k, n_group, topk_group);
  std::unique_ptr<cuda::PendingCopy> pending;
  if (ids_to_host && experts.is_cuda() && N > 0)  // N·k ids come back from the GPU while the host goes on
    pending = std::make_unique<cuda::PendingCopy>(experts.raw_data(), N * k * 8, scores.device().index);
  return SelectedExperts(std::move(experts), std::move(pending));
}

std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                                    int64_t topk_group) {
  return start_select_experts(scores, bias, k, n_group, topk_group).ids();
}

}  // namespace moetrain
