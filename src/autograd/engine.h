// The backward engine: runs the recorded nodes reachable from `roots` in reverse
// topological order (ties broken by creation order, newest first, so the order is
// deterministic), sums gradients arriving at the same output, and accumulates
// into the grad() of leaves that require grad. Runs with grad mode off.
#pragma once

#include <functional>

#include "core/tensor.h"

namespace moetrain::autograd {

// grads[i] is the upstream gradient of roots[i]; an undefined grad means ones
// for a one-element root (the usual loss.backward()).
void backward(const Tensors& roots, const Tensors& grads, bool retain_graph = false);

// Grad-ready hooks, for reducing gradients while backward still runs (comm/
// grad_sync.h, GradReducer). While a GradReadyHookGuard lives, every outermost
// backward pass on this thread calls the hook once for each leaf it reaches,
// as soon as that leaf's gradient is final for the pass: after the last edge
// into the leaf delivered its gradient (the engine counts them when it walks
// the graph). The grad may still be undefined when every backward on the way
// returned none for it. Leaves reached only inside the nested passes of
// activation recomputation (checkpoint) are reported after the node that ran
// the nested pass, once no edge of the outer graph leads to them any more.
// A nested pass that adds to a leaf already reported is an error (a parameter
// used inside a recomputed block and also elsewhere, with the outer uses
// finished first); reported then, rather than silently reducing a partial sum.
using GradReadyHook = std::function<void(const Tensor& leaf)>;

class GradReadyHookGuard {
 public:
  explicit GradReadyHookGuard(GradReadyHook hook);  // one at a time per thread (checked)
  ~GradReadyHookGuard();
  GradReadyHookGuard(const GradReadyHookGuard&) = delete;
  GradReadyHookGuard& operator=(const GradReadyHookGuard&) = delete;

 private:
  GradReadyHook hook_;
};

}  // namespace moetrain::autograd

namespace moetrain {

// Activation recomputation: runs fn(inputs) without recording its internals and
// records a single node; in backward, fn is run again with recording on (with
// the default generator rewound, so random ops repeat) and backpropagated.
// Tensors needing gradients must be `inputs` or leaves that fn captures (the
// parameters); non-leaf tensors captured by fn are treated as constants.
Tensors checkpoint(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs);

namespace autograd {

// True while checkpoint() runs a block again in backward (on this thread). What a
// forward counts rather than computes (the MoE layers' routing statistics) is
// counted in the first run only: a recomputed block must not count twice.
bool recomputing();

}  // namespace autograd

}  // namespace moetrain
