#include "optim/optimizer.h"

#include <algorithm>

#include "core/grad_mode.h"

namespace moetrain {

Tensor Optimizer::owned_part(size_t i, const Tensor& t) const {
  if (!sharded()) return t;
  const ElementRange r = owned(i);
  return alias(t, Shape{r.size()}, r.begin);
}

Tensor Optimizer::master_or_parameter(size_t i) const {
  const Tensor m = master(i);
  return m.defined() ? m : parameters()[i].tensor;
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  const std::vector<std::string> names = slot_names();
  for (size_t i = 0; i < parameters().size(); ++i) {
    for (const std::string& name : names)
      if (const Tensor t = slot(name, i); t.defined()) bytes += t.nbytes();
    if (const Tensor m = master(i); m.defined()) bytes += m.nbytes();
  }
  return bytes;
}

// ---------------------------------------------------------------- RuleOptimizer

RuleOptimizer::RuleOptimizer(const char* rule, const ParameterList& params, std::vector<ElementRange> shard)
    : rule_(rule), params_(params), shard_(std::move(shard)) {
  MT_CHECK(shard_.empty() || shard_.size() == params_.size(), "{}: {} shard ranges for {} parameters", rule_,
           shard_.size(), params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const ElementRange r = owned(i);
    MT_CHECK(r.begin >= 0 && r.begin <= r.end && r.end <= params_[i].tensor.numel(),
             "{}: shard range [{}, {}) of {} is outside its {} elements", rule_, r.begin, r.end, params_[i].name,
             params_[i].tensor.numel());
  }
  master_.resize(params_.size());
}

void RuleOptimizer::make_masters() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].tensor.dtype() == DType::bf16)
      if (const Tensor own = state_view(i, params_[i].tensor.detach()); own.defined()) master_[i] = own.to(DType::f32);
}

ElementRange RuleOptimizer::owned(size_t i) const {
  return shard_.empty() ? ElementRange{0, params_[i].tensor.numel()} : shard_[i];
}

bool RuleOptimizer::has_slot(const std::string& name, size_t) const {
  const std::vector<std::string> names = slot_names();
  return std::find(names.begin(), names.end(), name) != names.end();
}

Tensor RuleOptimizer::state_view(size_t i, const Tensor& t) const { return owned_part(i, t); }

void RuleOptimizer::zero_grad() {
  for (const NamedParameter& p : params_) p.tensor.zero_grad();
}

void RuleOptimizer::convert_to_bf16(const std::function<bool(const NamedParameter&)>& select) {
  NoGradGuard no_grad;
  const std::vector<std::string> names = slot_names();
  for (size_t i = 0; i < params_.size(); ++i) {
    const NamedParameter& p = params_[i];
    if (master_[i].defined() || !select(p)) continue;
    MT_CHECK(p.tensor.dtype() == DType::f32, "{}: mixed precision needs f32 parameters; {} is {}", rule_, p.name,
             describe(p.tensor));
    for (const std::string& name : names)
      if (const Tensor s = slot(name, i); s.defined())
        MT_CHECK(s.dtype() == DType::f32, "{}: mixed precision needs f32 optimizer state; {} of {} is {}", rule_,
                 name, p.name, describe(s));
    // A rank that owns none of the parameter keeps no master of it (its values come
    // from the owners' all-gather).
    if (const Tensor own = state_view(i, p.tensor.detach()); own.defined()) master_[i] = own.clone();
    convert_dtype_(p.tensor, DType::bf16);
  }
}

void RuleOptimizer::round_parameters_from_master() {
  NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i)
    if (master_[i].defined()) copy_(state_view(i, params_[i].tensor.detach()), master_[i].to(DType::bf16));
}

// ---------------------------------------------------------------- ChainedOptimizer

ChainedOptimizer::ChainedOptimizer(const ParameterList& params, std::vector<Part> parts)
    : params_(params), parts_(std::move(parts)) {
  MT_CHECK(!parts_.empty(), "optimizer: a chain of no rules");
  where_.assign(params_.size(), {parts_.size(), 0});
  for (size_t k = 0; k < parts_.size(); ++k) {
    const Part& part = parts_[k];
    MT_CHECK(part.rule && part.rule->parameters().size() == part.members.size(),
             "optimizer: part {} lists {} members for a rule of {} parameters", k, part.members.size(),
             part.rule ? part.rule->parameters().size() : 0);
    for (size_t j = 0; j < part.members.size(); ++j) {
      const size_t i = part.members[j];
      MT_CHECK(i < params_.size() && where_[i].first == parts_.size(), "optimizer: parameter index {} is out of "
               "range or in two parts", i);
      MT_CHECK(part.rule->parameters()[j].name == params_[i].name, "optimizer: part {} has {} where {} was expected",
               k, part.rule->parameters()[j].name, params_[i].name);
      where_[i] = {k, j};
    }
  }
  for (size_t i = 0; i < params_.size(); ++i)
    MT_CHECK(where_[i].first < parts_.size(), "optimizer: parameter {} is in no part", params_[i].name);
}

void ChainedOptimizer::step(double lr) {
  for (Part& p : parts_) p.rule->step(lr);
}

std::optional<NonFiniteTensor> ChainedOptimizer::non_finite_update(double lr) const {
  // The first parameter in the whole list's order.
  std::optional<std::pair<size_t, NonFiniteTensor>> first;
  for (const Part& p : parts_) {
    const std::optional<NonFiniteTensor> bad = p.rule->non_finite_update(lr);
    if (!bad) continue;
    size_t index = params_.size();
    for (size_t j = 0; j < p.members.size(); ++j)
      if (p.rule->parameters()[j].name == bad->name) index = p.members[j];
    if (!first || index < first->first) first = {{index, *bad}};
  }
  if (!first) return std::nullopt;
  return first->second;
}

void ChainedOptimizer::zero_grad() {
  for (Part& p : parts_) p.rule->zero_grad();
}

void ChainedOptimizer::set_steps(int64_t steps) {
  for (Part& p : parts_) p.rule->set_steps(steps);
}

std::vector<std::string> ChainedOptimizer::slot_names() const {
  std::vector<std::string> names;
  for (const Part& p : parts_)
    for (const std::string& n : p.rule->slot_names())
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
  return names;
}

Tensor ChainedOptimizer::slot(const std::string& name, size_t i) const {
  const auto [k, j] = where_[i];
  return parts_[k].rule->has_slot(name, j) ? parts_[k].rule->slot(name, j) : Tensor();
}

bool ChainedOptimizer::has_slot(const std::string& name, size_t i) const {
  return parts_[where_[i].first].rule->has_slot(name, where_[i].second);
}

bool ChainedOptimizer::sharded() const {
  return std::any_of(parts_.begin(), parts_.end(), [](const Part& p) { return p.rule->sharded(); });
}

ElementRange ChainedOptimizer::owned(size_t i) const { return parts_[where_[i].first].rule->owned(where_[i].second); }

void ChainedOptimizer::convert_to_bf16(const std::function<bool(const NamedParameter&)>& select) {
  for (Part& p : parts_) p.rule->convert_to_bf16(select);
}

Tensor ChainedOptimizer::master(size_t i) const { return parts_[where_[i].first].rule->master(where_[i].second); }

void ChainedOptimizer::round_parameters_from_master() {
  for (Part& p : parts_) p.rule->round_parameters_from_master();
}

}  // namespace moetrain
