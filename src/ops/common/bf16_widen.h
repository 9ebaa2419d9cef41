// bf16 on the CPU, for the kernels without a bf16 path of their own: the op's kernel
// runs in f32 on widened copies (docs/cuda.md "bf16 on the CPU").
//
//   cpu::run_kernel("scaled_norm_forward", &cpu::scaled_norm_forward, y, rstd, x, w, z, s, eps)
//
// (MT_ON_DEVICE, ops/common/on_device.h, makes that call) runs the kernel as it is when
// no tensor argument is bf16. Otherwise, by the kernel's parameter types:
//  - inputs (const Tensor&, const Tensor*, const std::vector<const Tensor*>&): a bf16
//    tensor is passed as an f32 copy (exact);
//  - outputs (Tensor&, Tensor*, std::vector<Tensor>&): a bf16 tensor is passed as an
//    f32 copy of its contents (kernels that accumulate read them), and after the
//    kernel the f32 result is rounded to nearest even into the bf16 tensor, once. An
//    output the kernel reassigns (a new tensor) is rounded into a new bf16 tensor
//    assigned to the caller's.
// f32 tensors (the statistics, lse, losses, router scores and KDA states the ops
// allocate in f32 for bf16 inputs, as on CUDA) pass unchanged. So a widened kernel
// computes exactly what its f32 twin computes on the bf16-representable inputs, and
// only its bf16 outputs are rounded.
//
// Kernels with their own bf16 CPU path are called as they are (cpu_bf16_native):
// oneDNN's bf16 matmul with f32 accumulation (the linalg family, the grouped expert
// GEMMs, causal attention's products), and kernels that widen and round a row or block
// at a time (ops/common/bf16_rows.h), with the same bits as widening: cross entropy,
// the binary ops, SiTU-GLU, AttnRes, RMSNorm / L2 norm (plain, gated, fused with the
// residual add), LayerNorm (plain and fused with the residual add), the MoE combine,
// index_select's backward, sigmoid_gate, sum_to and dropout.
#pragma once

#include <deque>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace moetrain::cpu {

// The kernels that take bf16 tensors themselves: the matrix products (oneDNN), the
// kernels that widen row by row (bf16_rows.h) and the view kernels that move bytes
// (any dtype).
constexpr bool cpu_bf16_native(std::string_view kernel) {
  constexpr std::string_view kNative[] = {
      "moe_gather_forward", "moe_gather_backward",  // moe_plan_cpu.cpp
      "causal_conv1d_forward", "causal_conv1d_backward",  // conv_cpu.cpp
      "broadcast_copy",                                    // elementwise_cpu.cpp (a copy)
      "sum_to",                                            // elementwise_cpu.cpp (sums in double)
      "dropout_apply",                                     // dropout_cpu.cpp
      "matmul_forward",          "linear_forward", "linear_backward", "gelu_input_backward", "grouped_linear_forward",
      "grouped_linear_backward", "permute_copy",   "copy_into_mid",   "copy_from_mid",       "index_select_forward",
      "cross_entropy_forward",   "cross_entropy_backward", "binary_forward",  "situ_glu_forward",    "situ_glu_backward",
      "causal_attention_forward", "causal_attention_backward", "attn_res_forward", "attn_res_backward",
      "scaled_norm_forward",     "scaled_norm_backward",   "add_scaled_norm_forward", "add_scaled_norm_backward",
      "layer_norm_forward",      "layer_norm_backward",    "add_layer_norm_forward",  "add_layer_norm_backward",
      "moe_combine_forward",     "moe_combine_backward",   "index_select_backward",   "sigmoid_gate_forward",
      "sigmoid_gate_backward"};
  for (std::string_view k : kNative)
    if (k == kernel) return true;
  return false;
}

// The widened kernels that write every element of every output without reading it
// (their contracts in <op>_kernels.h): their bf16 outputs are passed as uninitialised
// f32 tensors instead of widened copies. The others (KDA's state, add_inplace, the
// accumulating backward kernels, ...) get their outputs' contents. Kernels with a bf16
// path of their own (cpu_bf16_native) never widen and are not listed.
constexpr bool cpu_bf16_overwrites(std::string_view kernel) {
  constexpr std::string_view kOverwrite[] = {"softmax_forward", "softmax_backward",    "unary_forward",
                                             "unary_backward",  "affine_forward",      "pow_forward",
                                             "decay_gate_forward", "decay_gate_backward"};
  for (std::string_view k : kOverwrite)
    if (k == kernel) return true;
  return false;
}

// An f32 tensor of t's shape on the CPU holding t's values (bf16 widened exactly).
Tensor widen_bf16(const Tensor& t);
// dst (bf16) = src (f32) rounded to nearest even; same element count.
void round_into_bf16(Tensor& dst, const Tensor& src);

class Bf16Widening {
 public:
  // copy_outputs_in: whether bf16 outputs are passed with their contents (false for
  // the kernels of cpu_bf16_overwrites).
  explicit Bf16Widening(bool copy_outputs_in) : copy_outputs_in_(copy_outputs_in) {}
  Bf16Widening(const Bf16Widening&) = delete;
  Bf16Widening& operator=(const Bf16Widening&) = delete;

  template <class P, class A>
  decltype(auto) adapt(A&& a) {
    using Bare = std::remove_cvref_t<P>;
    if constexpr (std::is_same_v<P, const Tensor&>) {
      return static_cast<const Tensor&>(input(a));
    } else if constexpr (std::is_same_v<P, Tensor&>) {
      return static_cast<Tensor&>(output(a));
    } else if constexpr (std::is_same_v<Bare, const Tensor*>) {
      const Tensor* p = a;
      return p ? static_cast<const Tensor*>(&input(*p)) : p;
    } else if constexpr (std::is_same_v<Bare, Tensor*>) {
      Tensor* p = a;
      return p ? &output(*p) : p;
    } else if constexpr (std::is_same_v<P, const std::vector<const Tensor*>&>) {
      return static_cast<const std::vector<const Tensor*>&>(inputs(a));
    } else if constexpr (std::is_same_v<P, std::vector<Tensor>&>) {
      return static_cast<std::vector<Tensor>&>(outputs(a));
    } else {
      return std::forward<A>(a);
    }
  }
  // Rounds every widened output into its bf16 tensor (in the order they were passed).
  void write_back();

 private:
  const Tensor& input(const Tensor& t);
  Tensor& output(Tensor& t);
  const std::vector<const Tensor*>& inputs(const std::vector<const Tensor*>& v);
  std::vector<Tensor>& outputs(std::vector<Tensor>& v);

  struct Out {
    Tensor* caller;
    Tensor* copy;
    std::shared_ptr<TensorImpl> made;  // the copy as made (a reassigned copy differs)
  };
  std::deque<Tensor> copies_;
  std::deque<std::vector<const Tensor*>> input_lists_;
  struct OutList {
    std::vector<Tensor>* caller;
    std::vector<Tensor> copy;
  };
  std::deque<OutList> output_lists_;
  std::vector<Out> outs_;
  bool copy_outputs_in_ = true;
};

inline bool cpu_is_bf16(const Tensor& t) { return t.defined() && t.dtype() == DType::bf16; }

template <class A>
bool cpu_arg_has_bf16(const A& a) {
  using Bare = std::remove_cvref_t<A>;
  if constexpr (std::is_same_v<Bare, Tensor>)
    return cpu_is_bf16(a);
  else if constexpr (std::is_same_v<Bare, Tensor*> || std::is_same_v<Bare, const Tensor*>)
    return a && cpu_is_bf16(*a);
  else if constexpr (std::is_same_v<Bare, std::vector<Tensor>>) {
    for (const Tensor& t : a)
      if (cpu_is_bf16(t)) return true;
    return false;
  } else if constexpr (std::is_same_v<Bare, std::vector<const Tensor*>>) {
    for (const Tensor* t : a)
      if (t && cpu_is_bf16(*t)) return true;
    return false;
  } else {
    return false;
  }
}

// Runs the CPU kernel fn (named kernel) on args, through Bf16Widening when a tensor
// argument is bf16 and the kernel has no bf16 path of its own.
template <class R, class... P, class... A>
R run_kernel(std::string_view kernel, R (*fn)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "run_kernel: argument count differs from the kernel's");
  if (cpu_bf16_native(kernel) || !(cpu_arg_has_bf16(args) || ...)) return fn(std::forward<A>(args)...);
  Bf16Widening w(!cpu_bf16_overwrites(kernel));
  if constexpr (std::is_void_v<R>) {
    fn(w.template adapt<P>(std::forward<A>(args))...);
    w.write_back();
  } else {
    R r = fn(w.template adapt<P>(std::forward<A>(args))...);
    w.write_back();
    return r;
  }
}

}  // namespace moetrain::cpu
