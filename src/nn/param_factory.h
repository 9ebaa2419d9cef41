// Parameter construction shared by the model and the ledger. Layers declare
// every parameter through a ParamFactory: with allocation on, it creates the
// tensor, initialises it from the factory's seeded generator and registers it;
// with allocation off (shapes only) it records the name, shape and group and
// returns an undefined tensor, so `moetrain ledger` counts the full 2.8T K3
// config from the same construction code in a second.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "core/rng.h"
#include "core/tensor.h"
#include "nn/parameters.h"

namespace moetrain {

struct Init {
  enum class Kind { zeros, ones, constant, normal, trunc_normal, custom };
  Kind kind = Kind::zeros;
  double value = 0;          // constant
  double std = 0;            // normal / trunc_normal
  double a = -2, b = 2;      // trunc_normal bounds in units of std
  // normal / trunc_normal: >= 0 draws rows [0, drawn_rows) only, as a tensor of that
  // many rows would be drawn (the generator advances by their elements, so later
  // parameters keep their values), and zeroes the rows after them: a padded
  // vocabulary's table (docs/model.md#padded-vocabulary). -1: every row drawn.
  int64_t drawn_rows = -1;
  std::function<Tensor(const Shape&, DType, Generator&)> fn;  // custom

  static Init zeros() { return Init(); }
  static Init ones() { return with(Kind::ones); }
  static Init constant(double v) {
    Init i = with(Kind::constant);
    i.value = v;
    return i;
  }
  static Init normal(double std) {
    Init i = with(Kind::normal);
    i.std = std;
    return i;
  }
  static Init trunc_normal(double std, double a = -2, double b = 2) {
    Init i = with(Kind::trunc_normal);
    i.std = std;
    i.a = a;
    i.b = b;
    return i;
  }
  // `base` (normal or trunc_normal) on the first `rows` rows, zeros after (drawn_rows).
  static Init first_rows(Init base, int64_t rows) {
    base.drawn_rows = rows;
    return base;
  }
  static Init custom(std::function<Tensor(const Shape&, DType, Generator&)> f) {
    Init i = with(Kind::custom);
    i.fn = std::move(f);
    return i;
  }

 private:
  static Init with(Kind k) {
    Init i;
    i.kind = k;
    return i;
  }
};

struct ParamSpec {
  std::string name;
  Shape shape;
  std::string group;  // ledger component: "embedding", "kda", "mla", "mlp", "attn_res", "norm", "lm_head", ...
  bool decay = true;
};

class ParamFactory {
 public:
  // allocate = false: shapes only; make() returns undefined tensors.
  ParamFactory(bool allocate, DType dtype, uint64_t seed) : allocate_(allocate), dtype_(dtype), gen_(seed) {}

  // Binding instead of allocating: make(), make_rows() and buffer() return
  // supply(name, shape, is_buffer), tensors that exist already (a layer's weights read
  // from a file and kept as inputs of the graph: `moetrain op`, nn/hybrid_hf.h), checked
  // for their shape and registered as allocated ones are; no init runs.
  using Supplier = std::function<Tensor(const std::string& name, const Shape& shape, bool buffer)>;
  ParamFactory(Supplier supply, DType dtype) : allocate_(true), dtype_(dtype), gen_(0), supply_(std::move(supply)) {}

  // Declares one parameter (a leaf requiring grad when allocated).
  Tensor make(const std::string& name, const Shape& shape, const Init& init, const std::string& group,
              bool decay);

  // Declares rows [lo, hi) of a parameter of `full_shape` (a shard along dim 0,
  // e.g. this rank's experts): the full tensor is initialised (so every shard
  // equals the same rows of an unsharded model with the same seed) and the rows
  // kept; the spec records the shard's shape.
  Tensor make_rows(const std::string& name, const Shape& full_shape, int64_t lo, int64_t hi, const Init& init,
                   const std::string& group, bool decay);
  // Declares a persistent buffer: state saved with the weights but not trained
  // (no grad, no optimizer), zeros of `dtype`; not counted as a parameter.
  Tensor buffer(const std::string& name, const Shape& shape, DType dtype);
  bool allocating() const { return allocate_; }
  // Pipeline stages (nn/pipeline_stages.h): while skipping, declarations belong to
  // another stage. They are recorded in specs() and advance the generator exactly
  // as an allocation would (so the stage's own parameters get the values a whole
  // model of the same seed has), but nothing is registered or kept: make() and
  // make_rows() return an undefined tensor, except for a custom init, whose
  // (small) tensor is computed and returned unregistered (a later init may read
  // it); buffer() returns an undefined tensor.
  void set_skipping(bool skipping) { skipping_ = skipping; }
  bool skipping() const { return skipping_; }
  DType dtype() const { return dtype_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  ParameterList& params() { return params_; }
  const ParameterList& params() const { return params_; }
  ParameterList& buffers() { return buffers_; }
  const ParameterList& buffers() const { return buffers_; }
  int64_t total() const;

 private:
  Tensor supplied(const std::string& name, const Shape& shape, bool buffer) const;
  // make()/make_rows() while skipping: the generator advanced, nothing kept.
  Tensor skip(const std::string& name, const Shape& full_shape, const Init& init);

  bool allocate_;
  DType dtype_;
  Generator gen_;
  Supplier supply_;  // binding mode when set
  bool skipping_ = false;
  std::vector<ParamSpec> specs_;
  std::unordered_set<std::string> names_;
  ParameterList params_;
  ParameterList buffers_;
};

}  // namespace moetrain
