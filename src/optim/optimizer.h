// The optimizer seam (docs/training.md#optimizers): what the trainer, the
// checkpoint, ZeRO-1 (train/distributed.h) and the ledger see of an optimizer.
//
//   Optimizer        the interface: a step at a learning rate, the finite-update
//                    check, zero grads, named state slots per parameter, the part
//                    of each parameter this rank owns (train.zero 1) and the f32
//                    master copies of mixed precision.
//   RuleOptimizer    what every update rule shares: the parameter list, the owned
//                    ranges, the masters (one implementation for every rule), the
//                    step count. AdamW (optim/adamw.h) and Muon (optim/muon.h).
//   ChainedOptimizer each parameter group its own rule (train.optimizer muon:
//                    Muon on the hidden matrices, AdamW on the rest), seen as one
//                    optimizer over the whole list.
//
// A checkpoint stores, for each slot name the optimizer lists, the slot's tensor
// of every parameter that has one (docs/checkpoints.md); nothing outside optim/
// knows which rule made them.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"

namespace moetrain {

// Elements [begin, end) of a parameter, flattened in its row-major order: the
// part of it that this rank's optimizer updates under train.zero 1 (the
// distributed optimizer, docs/parallelism.md). Empty (begin == end): none.
struct ElementRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;

  // The parameters, in the order every per-parameter index below refers to.
  virtual const ParameterList& parameters() const = 0;
  // One update with learning rate lr from each parameter's grad() (parameters
  // without a gradient are skipped, their state untouched).
  virtual void step(double lr) = 0;
  // Whether the next step(lr) would keep every value finite, without taking it;
  // the first parameter (in order) with a value that would not be, else nullopt.
  // The trainer all-reduces the verdict and skips the step on every rank.
  virtual std::optional<NonFiniteTensor> non_finite_update(double lr) const = 0;
  virtual void zero_grad() = 0;
  virtual int64_t steps() const = 0;
  virtual void set_steps(int64_t steps) = 0;

  // The state slots this optimizer keeps, e.g. {"exp_avg", "exp_avg_sq"} or
  // {"momentum"}; a checkpoint group each.
  virtual std::vector<std::string> slot_names() const = 0;
  // Slot `name` of parameter i: its owned elements (flat when sharded, else the
  // parameter's shape); undefined when parameter i has no such slot (another
  // rule's parameter) or this rank owns none of it.
  virtual Tensor slot(const std::string& name, size_t i) const = 0;
  // Whether parameter i's rule keeps slot `name` (on this rank or another).
  virtual bool has_slot(const std::string& name, size_t i) const = 0;
  // train.zero 1: whether ranges were given, and the elements of parameter i owned.
  virtual bool sharded() const = 0;
  virtual ElementRange owned(size_t i) const = 0;
  // The owned elements of t (parameter i or its gradient) as a flat view; t itself
  // when not sharded.
  Tensor owned_part(size_t i, const Tensor& t) const;
  // Bytes of the slots and master copies this optimizer holds.
  int64_t state_bytes() const;

  // Mixed precision: each f32 parameter that `select` picks becomes bf16 in place
  // (every handle sees it; its gradient is dropped) and its f32 values (its owned
  // elements) become its master copy. Its slots must be f32. Call once the
  // parameters and slots are on their device and a resume has loaded them.
  virtual void convert_to_bf16(const std::function<bool(const NamedParameter&)>& select) = 0;
  // The f32 master of parameter i (its owned elements; the slot layout above), or
  // undefined when the parameter is its own master.
  virtual Tensor master(size_t i) const = 0;
  // What a checkpoint saves as parameter i: its master copy, else the parameter.
  Tensor master_or_parameter(size_t i) const;
  // After new master values were written (a checkpoint load, QK-Clip): each bf16
  // parameter becomes its master rounded to nearest even (its owned elements).
  virtual void round_parameters_from_master() = 0;
};

// The shared part of one update rule over a list of parameters.
class RuleOptimizer : public Optimizer {
 public:
  const ParameterList& parameters() const override { return params_; }
  void zero_grad() override;
  int64_t steps() const override { return step_; }
  void set_steps(int64_t steps) override { step_ = steps; }
  bool sharded() const override { return !shard_.empty(); }
  ElementRange owned(size_t i) const override;
  bool has_slot(const std::string& name, size_t i) const override;
  void convert_to_bf16(const std::function<bool(const NamedParameter&)>& select) override;
  Tensor master(size_t i) const override { return master_[i]; }
  void round_parameters_from_master() override;
  // Every parameter's master (undefined where none), in parameter order.
  const std::vector<Tensor>& master_weights() const { return master_; }

 protected:
  // `shard`: one range per parameter (train.zero 1), or empty (every element).
  // A parameter that is bf16 already gets its f32 master from its own values.
  RuleOptimizer(const char* rule, const ParameterList& params, std::vector<ElementRange> shard);
  // How the rule holds state of parameter i: its owned part of t (owned_part by
  // default: flat when sharded); undefined when it owns none.
  virtual Tensor state_view(size_t i, const Tensor& t) const;
  void make_masters();  // master_ from the bf16 parameters (the constructor's last step in each rule)

  const char* rule_;  // "adamw", "muon": for messages
  ParameterList params_;
  std::vector<ElementRange> shard_;  // empty: every element of every parameter
  std::vector<Tensor> master_;
  int64_t step_ = 0;
};

// Each parameter belongs to exactly one part; the parts' rules step together and
// share one step count. Slot names are the union of the parts' (a parameter has
// the slots of its own rule only).
class ChainedOptimizer : public Optimizer {
 public:
  struct Part {
    std::unique_ptr<Optimizer> rule;
    std::vector<size_t> members;  // indices into `params`, in order; rule->parameters()[k] is params[members[k]]
  };
  ChainedOptimizer(const ParameterList& params, std::vector<Part> parts);

  const ParameterList& parameters() const override { return params_; }
  void step(double lr) override;
  std::optional<NonFiniteTensor> non_finite_update(double lr) const override;
  void zero_grad() override;
  int64_t steps() const override { return parts_.front().rule->steps(); }
  void set_steps(int64_t steps) override;
  std::vector<std::string> slot_names() const override;
  Tensor slot(const std::string& name, size_t i) const override;
  bool has_slot(const std::string& name, size_t i) const override;
  bool sharded() const override;
  ElementRange owned(size_t i) const override;
  void convert_to_bf16(const std::function<bool(const NamedParameter&)>& select) override;
  Tensor master(size_t i) const override;
  void round_parameters_from_master() override;
  // The rule (and its index there) of parameter i.
  const Optimizer& rule_of(size_t i) const { return *parts_[where_[i].first].rule; }

 private:
  ParameterList params_;
  std::vector<Part> parts_;
  std::vector<std::pair<size_t, size_t>> where_;  // parameter -> (part, index in the part)
};

}  // namespace moetrain
