#include "autograd/node.h"

#include <atomic>

#include "core/grad_mode.h"
#include "core/profile.h"

namespace moetrain::autograd {

namespace {
std::atomic<uint64_t> g_sequence{0};
}

bool needs_grad(const Tensors& inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

Edge make_edge(const Tensor& t) {
  Edge e;
  if (!t.defined()) return e;
  e.shape = t.shape();
  e.dtype = t.dtype();
  if (!t.requires_grad()) return e;
  if (t.impl().grad_fn) {
    e.node = t.impl().grad_fn;
    e.output_nr = t.impl().output_nr;
  } else {
    e.leaf = t.impl_ptr();
  }
  return e;
}

std::shared_ptr<Node> make_node(const char* name, const Tensors& outputs, const Tensors& inputs,
                                BackwardFn backward) {
  auto node = std::make_shared<Node>();
  node->name = name;
  node->next.reserve(inputs.size());
  for (const Tensor& t : inputs) node->next.push_back(make_edge(t));
  for (const Tensor& o : outputs) {
    node->output_shapes.push_back(o.shape());
    node->output_dtypes.push_back(o.dtype());
  }
  node->device = outputs.empty() ? kCpu : outputs[0].device();
  node->backward = std::move(backward);
  node->sequence = g_sequence.fetch_add(1, std::memory_order_relaxed);
  node->region = profile::current_region();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!is_floating(outputs[i].dtype())) continue;  // indices and counts carry no gradient
    TensorImpl& impl = outputs[i].impl();
    MT_ASSERT(impl.grad_fn == nullptr, "op {} output {} was already recorded by {}", name, i, impl.grad_fn->name);
    impl.grad_fn = node;
    impl.output_nr = static_cast<int>(i);
    impl.requires_grad = true;
  }
  return node;
}

Tensors record(const char* name, Tensors outputs, const Tensors& inputs, BackwardFn backward) {
  if (!needs_grad(inputs)) return outputs;
  make_node(name, outputs, inputs, std::move(backward));
  return outputs;
}

}  // namespace moetrain::autograd

namespace moetrain {

Tensor record(const char* name, Tensor output, const Tensors& inputs,
              std::function<Grads(const Tensor& grad_output)> backward) {
  if (!autograd::needs_grad(inputs)) return output;
  autograd::make_node(name, {output}, inputs,
                      [fn = std::move(backward)](const Tensors& g) { return fn(g[0]); });
  return output;
}

}  // namespace moetrain
