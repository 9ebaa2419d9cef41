#include "ops/attnres/attnres.h"

#include "autograd/node.h"
#include "ops/attnres/attnres_kernels.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"

namespace moetrain {

namespace {

std::vector<const Tensor*> check_args(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps) {
  MT_CHECK(!sources.empty(), "attn_res: needs at least one source");
  const Tensor& first = sources.front();
  check_float("attn_res", "sources[0]", first);
  check_rank("attn_res", "sources[0]", first, -1);
  std::vector<const Tensor*> ptrs;
  for (size_t m = 0; m < sources.size(); ++m) {
    MT_CHECK(sources[m].defined() && sources[m].shape() == first.shape() && sources[m].dtype() == first.dtype(),
             "attn_res: source {} is {} {} but source 0 is {} {}; all sources must have one shape and dtype", m,
             sources[m].defined() ? sources[m].shape() : Shape{}, sources[m].defined() ? sources[m].dtype() : DType::f32,
             first.shape(), first.dtype());
    check_same_kind("attn_res", first, sources[m]);
    ptrs.push_back(&sources[m]);
  }
  int64_t D = first.size(-1);
  MT_CHECK(proj.defined() && proj.shape() == Shape{D}, "attn_res: proj (pseudo-query) is {} but must be [{}] for sources {}",
           proj.defined() ? proj.shape() : Shape{}, D, first.shape());
  MT_CHECK(norm.defined() && norm.shape() == Shape{D}, "attn_res: norm (key-norm weight) is {} but must be [{}] for sources {}",
           norm.defined() ? norm.shape() : Shape{}, D, first.shape());
  check_same_kind("attn_res", first, proj);
  check_same_kind("attn_res", first, norm);
  MT_CHECK(eps > 0, "attn_res: eps must be > 0, got {}", eps);
  return ptrs;
}

}  // namespace

Tensor attn_res(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps) {
  std::vector<const Tensor*> ptrs = check_args(sources, proj, norm, eps);
  const Tensor& first = sources.front();
  auto M = static_cast<int64_t>(sources.size());
  Shape stats = first.shape().drop_last();
  std::vector<int64_t> sd = stats.vec();
  sd.push_back(M);
  Tensor h = empty_like(first);
  Tensor alpha = empty(Shape(sd), stats_dtype(first), first.device());
  Tensor rstd = empty(Shape(sd), stats_dtype(first), first.device());
  MT_ON_DEVICE(first, attn_res_forward, h, alpha, rstd, ptrs, proj, norm, eps);
  Tensors inputs = sources;
  inputs.push_back(proj);
  inputs.push_back(norm);
  return record("attn_res", h, inputs, [sources, proj, norm, alpha, rstd](const Tensor& grad_h) {
    std::vector<Tensor> grad_sources(sources.size());
    std::vector<const Tensor*> ptrs;
    for (size_t m = 0; m < sources.size(); ++m) {
      ptrs.push_back(&sources[m]);
      if (sources[m].requires_grad()) grad_sources[m] = empty_like(sources[m]);
    }
    Tensor grad_proj, grad_norm;
    if (proj.requires_grad()) grad_proj = empty_like(proj);
    if (norm.requires_grad()) grad_norm = empty_like(norm);
    Tensor* gp = grad_proj.defined() ? &grad_proj : nullptr;
    Tensor* gn = grad_norm.defined() ? &grad_norm : nullptr;
    MT_ON_DEVICE(grad_h, attn_res_backward, grad_sources, gp, gn, grad_h, ptrs, proj, norm, alpha, rstd);
    Grads grads(grad_sources.begin(), grad_sources.end());
    grads.push_back(grad_proj);
    grads.push_back(grad_norm);
    return grads;
  });
}

Tensor attn_res_weights(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps) {
  std::vector<const Tensor*> ptrs = check_args(sources, proj, norm, eps);
  const Tensor& first = sources.front();
  Shape stats = first.shape().drop_last();
  std::vector<int64_t> sd = stats.vec();
  sd.push_back(static_cast<int64_t>(sources.size()));
  Tensor h = empty_like(first);
  Tensor alpha = empty(Shape(sd), stats_dtype(first), first.device());
  Tensor rstd = empty(Shape(sd), stats_dtype(first), first.device());
  MT_ON_DEVICE(first, attn_res_forward, h, alpha, rstd, ptrs, proj, norm, eps);
  return alpha;
}

}  // namespace moetrain
