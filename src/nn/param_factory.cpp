#include "nn/param_factory.h"

#include <utility>

#include "ops/view/view.h"


namespace moetrain {

Tensor ParamFactory::make(const std::string& name, const Shape& shape, const Init& init, const std::string& group,
                          bool decay) {
  MT_CHECK(names_.insert(name).second, "model construction: parameter '{}' declared twice", name);
  specs_.push_back({name, shape, group, decay});
  if (!allocate_) return Tensor();
  if (skipping_) return skip(name, shape, init);
  if (supply_) {
    Tensor t = supplied(name, shape, false);
    params_.push_back({name, t, decay, group});
    return t;
  }
  Tensor t;
  try {
    // Init::drawn_rows: the drawn rows, then the zero ones.
    const bool part = init.drawn_rows >= 0 && shape.ndim() >= 1 && init.drawn_rows < shape[0];
    const Shape drawn = part ? shape.with(0, init.drawn_rows) : shape;
    switch (init.kind) {
      case Init::Kind::zeros: t = zeros(shape, dtype_); break;
      case Init::Kind::ones: t = ones(shape, dtype_); break;
      case Init::Kind::constant: t = full(shape, init.value, dtype_); break;
      case Init::Kind::normal: t = randn(drawn, dtype_, gen_, 0.0, init.std); break;
      case Init::Kind::trunc_normal: t = trunc_normal(drawn, dtype_, gen_, 0.0, init.std, init.a, init.b); break;
      case Init::Kind::custom: t = init.fn(shape, dtype_, gen_); break;
    }
    if (part && (init.kind == Init::Kind::normal || init.kind == Init::Kind::trunc_normal))
      t = concat({t, zeros(shape.with(0, shape[0] - init.drawn_rows), dtype_)}, 0);
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(fmt::format("parameter '{}': {}", name, e.what()));
  }
  MT_CHECK(t.shape() == shape && t.dtype() == dtype_, "model construction: init of '{}' gave {} {}, expected {} {}",
           name, t.shape(), t.dtype(), shape, dtype_);
  t.set_requires_grad(true);
  params_.push_back({name, t, decay, group});
  return t;
}

Tensor ParamFactory::make_rows(const std::string& name, const Shape& full_shape, int64_t lo, int64_t hi,
                               const Init& init, const std::string& group, bool decay) {
  MT_CHECK(full_shape.ndim() >= 1 && 0 <= lo && lo < hi && hi <= full_shape[0],
           "model construction: rows [{}, {}) of '{}' {}", lo, hi, name, full_shape);
  if (lo == 0 && hi == full_shape[0]) return make(name, full_shape, init, group, decay);
  if (skipping_ && allocate_) {
    MT_CHECK(names_.insert(name).second, "model construction: parameter '{}' declared twice", name);
    specs_.push_back({name, full_shape.with(0, hi - lo), group, decay});
    return skip(name, full_shape, init);
  }
  if (supply_) {  // the whole tensor supplied, these rows kept
    MT_CHECK(names_.insert(name).second, "model construction: parameter '{}' declared twice", name);
    specs_.push_back({name, full_shape.with(0, hi - lo), group, decay});
    Tensor t = slice(supplied(name, full_shape, false), 0, lo, hi);
    params_.push_back({name, t, decay, group});
    return t;
  }
  MT_CHECK(names_.insert(name).second, "model construction: parameter '{}' declared twice", name);
  Shape local = full_shape.with(0, hi - lo);
  specs_.push_back({name, local, group, decay});
  if (!allocate_) return Tensor();
  if ((init.kind == Init::Kind::normal || init.kind == Init::Kind::trunc_normal) && init.drawn_rows < 0) {
    // Element i of the full tensor draws Philox counter first + i: generate only
    // rows [lo, hi) from their own counters, the same values the full tensor has
    // there, without materialising the other ranks' rows.
    const uint64_t first = gen_.reserve(static_cast<uint64_t>(full_shape.numel()));
    Generator rows(gen_.seed());
    rows.set_offset(first + static_cast<uint64_t>(lo * (full_shape.numel() / full_shape[0])));
    Tensor t = init.kind == Init::Kind::normal ? randn(local, dtype_, rows, 0.0, init.std)
                                               : trunc_normal(local, dtype_, rows, 0.0, init.std, init.a, init.b);
    t.set_requires_grad(true);
    params_.push_back({name, t, decay, group});
    return t;
  }
  // Other inits: the full tensor through make() on a scratch factory that shares the generator.
  ParamFactory scratch(true, dtype_, 0);
  std::swap(scratch.gen_, gen_);
  Tensor full = scratch.make(name, full_shape, init, group, decay);
  std::swap(scratch.gen_, gen_);
  Tensor t = slice(full.detach(), 0, lo, hi).clone();  // own storage: the full tensor is freed
  t.set_requires_grad(true);
  params_.push_back({name, t, decay, group});
  return t;
}

Tensor ParamFactory::skip(const std::string& name, const Shape& full_shape, const Init& init) {
  switch (init.kind) {
    case Init::Kind::zeros:
    case Init::Kind::ones:
    case Init::Kind::constant: return Tensor();  // no random numbers drawn
    case Init::Kind::normal:
    case Init::Kind::trunc_normal: {  // one counter per element (core/rng.h)
      const bool part = init.drawn_rows >= 0 && full_shape.ndim() >= 1 && init.drawn_rows < full_shape[0];
      gen_.reserve(static_cast<uint64_t>(part ? full_shape.with(0, init.drawn_rows).numel() : full_shape.numel()));
      return Tensor();
    }
    case Init::Kind::custom: {
      Tensor t = init.fn(full_shape, dtype_, gen_);
      MT_CHECK(t.shape() == full_shape, "model construction: init of '{}' gave {}, expected {}", name, t.shape(),
               full_shape);
      return t;
    }
  }
  return Tensor();
}

Tensor ParamFactory::buffer(const std::string& name, const Shape& shape, DType dtype) {
  MT_CHECK(names_.insert(name).second, "model construction: buffer '{}' declared twice", name);
  if (!allocate_ || skipping_) return Tensor();
  Tensor t = supply_ ? supplied(name, shape, true) : zeros(shape, dtype);
  buffers_.push_back({name, t, false, "buffer"});
  return t;
}

Tensor ParamFactory::supplied(const std::string& name, const Shape& shape, bool buffer) const {
  Tensor t = supply_(name, shape, buffer);
  MT_CHECK(t.defined() && t.shape() == shape, "model construction: {} '{}' was supplied as {}, expected {}",
           buffer ? "buffer" : "parameter", name, t.defined() ? fmt::format("{}", t.shape()) : "nothing", shape);
  return t;
}

int64_t ParamFactory::total() const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_) n += s.shape.numel();
  return n;
}

}  // namespace moetrain
