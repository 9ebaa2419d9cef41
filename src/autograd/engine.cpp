#include "autograd/engine.h"

#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "autograd/grad_sum.h"
#include "autograd/node.h"
#include "core/grad_mode.h"
#include "core/profile.h"
#include "core/rng.h"

namespace moetrain::autograd {

namespace {

// Gradient sums: the first gradient is kept as is (it may alias another
// tensor); later ones are added out of place, so nothing shared is overwritten.
void accumulate(Tensor& slot, const Tensor& g) {
  if (!slot.defined()) slot = g;
  else slot = grad_sum(slot, g);
}

// Leaves own their grad buffer (a copy the first time), so accumulation over
// several backward calls (micro-batches) can add in place.
// True when nothing but `g` refers to its memory: no other Tensor, no view, no
// closure (the node's closure is freed before its gradients are handed on), so a
// leaf may keep it as its gradient without a copy.
bool sole_owner(const Tensor& g) {
  const std::shared_ptr<TensorImpl>& impl = g.impl_ptr();
  return impl.use_count() == 1 && impl->storage.use_count() == 1 && impl->offset == 0 &&
         impl->storage->nbytes() == g.numel() * dtype_size(g.dtype()) && !impl->grad_fn && !impl->grad;
}

void accumulate_leaf(TensorImpl& leaf, const Tensor& g) {
  if (!leaf.grad) {
    leaf.grad = sole_owner(g) ? g.impl_ptr() : g.clone().impl_ptr();
  } else {
    grad_add_(Tensor(leaf.grad), g);
  }
}

void check_grad(const Node& node, size_t i, const Tensor& g) {
  const Edge& e = node.next[i];
  MT_ASSERT(g.shape() == e.shape && g.dtype() == e.dtype,
            "backward of {} returned a gradient {} for input {} of shape {} dtype {}", node.name, describe(g), i,
            e.shape, e.dtype);
}

struct Pending {
  Tensors grads;
  int dependencies = 0;
};

struct LaterFirst {
  bool operator()(const Node* a, const Node* b) const { return a->sequence < b->sequence; }
};

// The installed grad-ready hook, how deep in nested passes this thread is, and
// where nested passes record the leaves they added to (the outermost pass's list).
thread_local const GradReadyHook* t_hook = nullptr;
thread_local int t_depth = 0;
thread_local std::vector<std::shared_ptr<TensorImpl>>* t_nested_leaves = nullptr;
thread_local int t_recomputing = 0;  // checkpoint() blocks being run again, nested

struct RecomputeScope {
  RecomputeScope() { ++t_recomputing; }
  ~RecomputeScope() { --t_recomputing; }
};

struct DepthGuard {
  DepthGuard() { ++t_depth; }
  ~DepthGuard() { --t_depth; }
};

// Grad-ready bookkeeping of an outermost pass with a hook (engine.h).
class ReadyTracker {
 public:
  explicit ReadyTracker(const GradReadyHook& hook) : hook_(hook) { t_nested_leaves = &nested_; }
  ~ReadyTracker() { t_nested_leaves = nullptr; }
  ReadyTracker(const ReadyTracker&) = delete;
  ReadyTracker& operator=(const ReadyTracker&) = delete;

  // While walking the graph: one more edge into `leaf`.
  void count_edge(const std::shared_ptr<TensorImpl>& leaf) { ++uses_[leaf.get()]; }
  // A root that is itself a leaf got its gradient.
  void root_leaf(const std::shared_ptr<TensorImpl>& leaf) { roots_.push_back(leaf); }
  // An edge into `leaf` was processed (with or without a gradient).
  void edge_done(const std::shared_ptr<TensorImpl>& leaf) {
    if (--uses_[leaf.get()] == 0) fire(leaf);
  }
  // After a node ran: the leaves its nested passes (checkpoint) added to.
  void node_done() {
    std::vector<std::shared_ptr<TensorImpl>> leaves;
    leaves.swap(nested_);
    // A nested pass lists a leaf once per edge that delivered a gradient (a block's
    // input read twice inside it is listed twice): each is looked at once, in the
    // order of its first delivery (the same order on every rank).
    std::unordered_set<TensorImpl*> seen;
    for (const auto& leaf : leaves) {
      if (!seen.insert(leaf.get()).second) continue;
      MT_CHECK(!fired(leaf.get()),
               "backward: a recomputed block (checkpoint) added to the gradient of a leaf {} after the leaf was "
               "reported final to the grad-ready hook (its uses outside recomputed blocks had finished); a "
               "parameter used both inside a checkpointed block and elsewhere needs train.overlap_grad_sync: false",
               describe(Tensor(leaf)));
      auto it = uses_.find(leaf.get());
      if (it == uses_.end() || it->second == 0) fire(leaf);
    }
  }
  // At the end of the pass: what is left (roots that are leaves).
  void pass_done() {
    node_done();
    for (const auto& leaf : roots_)
      if (!uses_.contains(leaf.get())) fire(leaf);
  }

 private:
  // Keyed by address; a leaf freed during the pass (checkpoint's detached inputs)
  // may leave its address to a new one, hence the weak_ptr.
  bool fired(TensorImpl* leaf) const {
    auto it = fired_.find(leaf);
    return it != fired_.end() && !it->second.expired();
  }
  void fire(const std::shared_ptr<TensorImpl>& leaf) {
    if (fired(leaf.get())) return;
    fired_[leaf.get()] = leaf;
    hook_(Tensor(leaf));
  }

  const GradReadyHook& hook_;
  std::unordered_map<TensorImpl*, int> uses_;  // edges of the outer graph into each leaf, not yet processed
  std::unordered_map<TensorImpl*, std::weak_ptr<TensorImpl>> fired_;
  std::vector<std::shared_ptr<TensorImpl>> roots_;
  std::vector<std::shared_ptr<TensorImpl>> nested_;  // filled by nested passes
};

}  // namespace

GradReadyHookGuard::GradReadyHookGuard(GradReadyHook hook) : hook_(std::move(hook)) {
  MT_CHECK(t_hook == nullptr, "GradReadyHookGuard: a grad-ready hook is already installed on this thread");
  MT_CHECK(t_depth == 0, "GradReadyHookGuard: installed inside a backward pass");
  t_hook = &hook_;
}

GradReadyHookGuard::~GradReadyHookGuard() { t_hook = nullptr; }

void backward(const Tensors& roots, const Tensors& grads, bool retain_graph) {
  MT_CHECK(roots.size() == grads.size(), "backward: {} roots but {} gradients", roots.size(), grads.size());
  NoGradGuard no_grad;
  profile::BackwardScope profiled("autograd");  // the pass's time outside nodes
  // Grad-ready hooks: the outermost pass tracks leaves; nested ones report theirs to it.
  std::optional<ReadyTracker> ready_leaves;
  if (t_hook && t_depth == 0) ready_leaves.emplace(*t_hook);
  std::vector<std::shared_ptr<TensorImpl>>* nested = t_depth > 0 ? t_nested_leaves : nullptr;
  DepthGuard depth;

  // Seed gradients.
  std::unordered_map<Node*, Pending> pending;
  std::vector<Node*> stack;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    MT_CHECK(root.requires_grad(), "backward: {} does not require grad (no input of the ops that made it "
             "requires grad, or it was computed under NoGradGuard)", describe(root));
    Tensor g = grads[i];
    if (!g.defined()) {
      MT_CHECK(root.numel() == 1, "backward: {} is not a scalar; pass the upstream gradient", describe(root));
      g = ones(root.shape(), root.dtype(), root.device());
    }
    MT_CHECK(g.shape() == root.shape() && g.dtype() == root.dtype(),
             "backward: gradient {} does not match the tensor {}", describe(g), describe(root));
    Node* node = root.impl().grad_fn.get();
    if (!node) {
      accumulate_leaf(root.impl(), g);
      if (ready_leaves) ready_leaves->root_leaf(root.impl_ptr());
      if (nested) nested->push_back(root.impl_ptr());
      continue;
    }
    Pending& p = pending[node];
    if (p.grads.empty()) {
      p.grads.resize(node->output_shapes.size());
      stack.push_back(node);
    }
    accumulate(p.grads[root.impl().output_nr], g);
  }

  // Discover the graph and count, for every node, the edges that lead into it.
  std::vector<Node*> roots_nodes = stack;
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const Edge& e : node->next) {
      if (e.leaf && ready_leaves) ready_leaves->count_edge(e.leaf);
      if (!e.node) continue;
      auto [it, inserted] = pending.try_emplace(e.node.get());
      if (inserted) {
        it->second.grads.resize(e.node->output_shapes.size());
        stack.push_back(e.node.get());
      }
      it->second.dependencies += 1;
    }
  }

  std::priority_queue<Node*, std::vector<Node*>, LaterFirst> ready;
  for (Node* n : roots_nodes)
    if (pending[n].dependencies == 0) ready.push(n);

  while (!ready.empty()) {
    Node* node = ready.top();
    ready.pop();
    profile::BackwardScope timed(node->region);  // profiling on: this iteration's time goes to the node's region
    Pending& p = pending[node];
    bool any = false;
    for (const Tensor& g : p.grads) any = any || g.defined();

    Tensors input_grads;
    if (any) {
      MT_CHECK(node->backward != nullptr,
               "backward through {} a second time: its saved tensors were freed after the first backward; "
               "call backward(..., retain_graph=true) the first time", node->name);
      for (size_t i = 0; i < p.grads.size(); ++i)
        if (!p.grads[i].defined()) p.grads[i] = zeros(node->output_shapes[i], node->output_dtypes[i], node->device);
      input_grads = node->backward(p.grads);
      MT_ASSERT(input_grads.size() == node->next.size(), "backward of {} returned {} gradients for {} inputs",
                node->name, input_grads.size(), node->next.size());
      if (!retain_graph) node->backward = nullptr;  // frees the saved tensors
    }
    p.grads.clear();

    for (size_t i = 0; i < node->next.size(); ++i) {
      const Edge& e = node->next[i];
      const Tensor* g = i < input_grads.size() && input_grads[i].defined() ? &input_grads[i] : nullptr;
      if (g && e.active()) check_grad(*node, i, *g);
      if (e.node) {
        Pending& q = pending[e.node.get()];
        if (g) accumulate(q.grads[e.output_nr], *g);
        if (--q.dependencies == 0) ready.push(e.node.get());
      } else if (e.leaf) {
        if (g) accumulate_leaf(*e.leaf, *g);
        if (g && nested) nested->push_back(e.leaf);
        if (ready_leaves) ready_leaves->edge_done(e.leaf);
      }
    }
    if (ready_leaves) ready_leaves->node_done();
  }
  if (ready_leaves) ready_leaves->pass_done();
}

bool recomputing() { return t_recomputing > 0; }

}  // namespace moetrain::autograd

namespace moetrain {

void Tensor::backward(const Tensor& grad, bool retain_graph) const {
  autograd::backward({*this}, {grad}, retain_graph);
}

Tensors checkpoint(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs) {
  if (!autograd::grad_enabled()) return fn(inputs);
  Tensors detached;
  detached.reserve(inputs.size());
  for (const Tensor& t : inputs) detached.push_back(t.defined() ? t.detach() : t);
  Generator& gen = default_generator();
  uint64_t rng_offset = gen.offset();
  Tensors outputs;
  {
    NoGradGuard no_grad;
    outputs = fn(detached);
  }
  for (Tensor& o : outputs)
    if (o.defined()) o = o.detach();  // a fresh handle per output, even if fn returned an input
  auto recompute = [fn, inputs, rng_offset](const Tensors& grad_outputs) {
    Tensors again;
    for (const Tensor& t : inputs) {
      if (!t.defined()) {
        again.push_back(t);
        continue;
      }
      Tensor d = t.detach();
      if (t.requires_grad()) d.set_requires_grad(true);
      again.push_back(d);
    }
    Generator& g = default_generator();
    uint64_t resume_offset = g.offset();
    g.set_offset(rng_offset);
    Tensors outs;
    {
      EnableGradGuard grad;
      autograd::RecomputeScope again_scope;
      outs = fn(again);
    }
    g.set_offset(resume_offset);
    Tensors roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].requires_grad() || !grad_outputs[i].defined()) continue;  // an output no gradient reached
      roots.push_back(outs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    if (!roots.empty()) autograd::backward(roots, root_grads);
    Tensors grads;
    for (const Tensor& t : again) grads.push_back(t.defined() && t.requires_grad() ? t.grad() : Tensor());
    return grads;
  };
  // Recorded even when no input requires grad: the parameters fn captures may.
  autograd::make_node("checkpoint", outputs, inputs, std::move(recompute));
  return outputs;
}

}  // namespace moetrain
