#include "ops/common/bf16_widen.h"

#include "backend/cpu/parallel.h"
#include "core/error.h"

namespace moetrain::cpu {

Tensor widen_bf16(const Tensor& t) {
  MT_CHECK(t.is_cpu() && t.dtype() == DType::bf16, "widen_bf16: {} is not a CPU bf16 tensor", describe(t));
  Tensor out = empty(t.shape(), DType::f32, t.device());
  const bf16* src = t.data<bf16>();
  float* dst = out.data<float>();
  parallel_for(t.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = src[i].to_float();
  });
  return out;
}

void round_into_bf16(Tensor& dst, const Tensor& src) {
  MT_CHECK(dst.dtype() == DType::bf16 && src.dtype() == DType::f32 && dst.numel() == src.numel(),
           "round_into_bf16: {} from {}", describe(dst), describe(src));
  const float* s = src.data<float>();
  bf16* d = dst.data<bf16>();
  parallel_for(src.numel(), 1 << 15, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) d[i] = bf16::from_float(s[i]);
  });
}

const Tensor& Bf16Widening::input(const Tensor& t) {
  if (!cpu_is_bf16(t)) return t;
  return copies_.emplace_back(widen_bf16(t));
}

Tensor& Bf16Widening::output(Tensor& t) {
  if (!cpu_is_bf16(t)) return t;
  Tensor& copy = copies_.emplace_back(copy_outputs_in_ ? widen_bf16(t) : empty(t.shape(), DType::f32, t.device()));
  outs_.push_back(Out{&t, &copy, copy.impl_ptr()});
  return copy;
}

const std::vector<const Tensor*>& Bf16Widening::inputs(const std::vector<const Tensor*>& v) {
  std::vector<const Tensor*>& list = input_lists_.emplace_back();
  list.reserve(v.size());
  for (const Tensor* t : v) list.push_back(t ? &input(*t) : nullptr);
  return list;
}

std::vector<Tensor>& Bf16Widening::outputs(std::vector<Tensor>& v) {
  OutList& list = output_lists_.emplace_back();
  list.caller = &v;
  list.copy.reserve(v.size());
  for (const Tensor& t : v)
    list.copy.push_back(!cpu_is_bf16(t)    ? t
                        : copy_outputs_in_ ? widen_bf16(t)
                                           : empty(t.shape(), DType::f32, t.device()));
  return list.copy;
}

void Bf16Widening::write_back() {
  for (Out& o : outs_) {
    if (o.copy->impl_ptr() == o.made) {
      round_into_bf16(*o.caller, *o.copy);
    } else if (o.copy->defined()) {
      // The kernel assigned a new tensor: a new bf16 tensor for the caller.
      Tensor fresh = empty(o.copy->shape(), DType::bf16, o.copy->device());
      if (o.copy->dtype() == DType::f32)
        round_into_bf16(fresh, *o.copy);
      else
        fresh = *o.copy;
      *o.caller = fresh;
    } else {
      *o.caller = Tensor();
    }
  }
  for (OutList& l : output_lists_) {
    std::vector<Tensor>& caller = *l.caller;
    MT_CHECK(caller.size() == l.copy.size(), "Bf16Widening: a kernel resized its output list");
    for (size_t i = 0; i < caller.size(); ++i) {
      if (cpu_is_bf16(caller[i]) && l.copy[i].defined() && l.copy[i].dtype() == DType::f32) {
        round_into_bf16(caller[i], l.copy[i]);
      } else if (!caller[i].defined() && l.copy[i].defined()) {
        caller[i] = l.copy[i];
      }
    }
  }
}

}  // namespace moetrain::cpu
