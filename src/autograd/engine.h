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

}  // namespace moetrain::autograd

namespace moetrain {

// Activation recomputation: runs fn(inputs) without recording its internals and
// records a single node; in backward, fn is run again with recording on (with
// the default generator rewound, so random ops repeat) and backpropagated.
// Tensors needing gradients must be `inputs` or leaves that fn captures (the
// parameters); non-leaf tensors captured by fn are treated as constants.
Tensors checkpoint(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs);

}  // namespace moetrain
