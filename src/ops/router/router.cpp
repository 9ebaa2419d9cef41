#include "ops/router/router.h"

#include "ops/common/on_device.h"
#include "ops/router/router_kernels.h"

namespace moetrain {

std::vector<int64_t> select_experts(const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                                    int64_t topk_group) {
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
  const Tensor host = experts.is_cuda() ? experts.to(kCpu) : experts;  // N·k ids come back from the GPU
  return std::vector<int64_t>(host.data<int64_t>(), host.data<int64_t>() + N * k);
}

}  // namespace moetrain
