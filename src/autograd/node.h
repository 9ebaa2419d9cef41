// The autograd tape. Every differentiable op calls record() right under its
// forward: record() creates a Node holding the op's name, one Edge per input and
// the backward closure, and stamps the outputs with it. The graph is the DAG of
// Nodes reachable from a tensor's grad_fn; leaves (parameters, inputs marked
// requires_grad) are reached through Edge::leaf and receive gradients in grad().
//
// Closure rules: capture inputs and saved intermediates by value; capture an
// OUTPUT only as out.detach() (an output holds its Node, so capturing it as is
// would form a cycle and leak). The engine drops the closure after it ran, which
// frees the saved tensors, unless backward is called with retain_graph.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "core/tensor.h"

namespace moetrain::autograd {

struct Node;

// Where the gradient for one input of a node goes.
struct Edge {
  std::shared_ptr<Node> node;        // a non-leaf input: its producing node ...
  int output_nr = 0;                 // ... and which of its outputs
  std::shared_ptr<TensorImpl> leaf;  // a leaf input that requires grad
  Shape shape;                       // the input's shape and dtype, to check the
  DType dtype = DType::f32;          // gradients a backward returns
  bool active() const { return node || leaf; }
};

// Backward: gradients of the outputs (never undefined: missing ones are zeros)
// -> one gradient per input (undefined where an input needs none).
using BackwardFn = std::function<Tensors(const Tensors& grad_outputs)>;

struct Node {
  const char* name = "";
  std::vector<Edge> next;             // one per input
  std::vector<Shape> output_shapes;   // to make zero gradients for unused outputs
  std::vector<DType> output_dtypes;
  Device device;
  BackwardFn backward;
  uint64_t sequence = 0;              // creation order; later nodes run first
  const char* region = "other";       // profile::Region the node was created in
};

// Records a multi-output op. Returns `outputs`, stamped with the new node when
// grad mode is on and some input requires grad; otherwise untouched.
Tensors record(const char* name, Tensors outputs, const Tensors& inputs, BackwardFn backward);

// Returns true when an op with these inputs would record a node.
bool needs_grad(const Tensors& inputs);

// Building blocks of record(), for ops that must record unconditionally
// (checkpoint): the edge to `t`, and a node stamped on `outputs`.
Edge make_edge(const Tensor& t);
std::shared_ptr<Node> make_node(const char* name, const Tensors& outputs, const Tensors& inputs,
                                BackwardFn backward);

}  // namespace moetrain::autograd

namespace moetrain {

using Grads = Tensors;

// Single-output form: backward receives the output's gradient.
Tensor record(const char* name, Tensor output, const Tensors& inputs,
              std::function<Grads(const Tensor& grad_output)> backward);

}  // namespace moetrain
