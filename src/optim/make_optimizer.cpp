#include "optim/make_optimizer.h"

#include <algorithm>

namespace moetrain {

bool uses_muon(const OptimizerOptions& options, const NamedParameter& p) {
  return options.kind == "muon" && is_hidden_matrix(p);
}

double update_cost(const OptimizerOptions& options, const NamedParameter& p) {
  const double n = static_cast<double>(p.tensor.numel());
  if (!uses_muon(options, p)) return n;
  const int64_t dim = p.tensor.dim();
  const double a = static_cast<double>(p.tensor.size(dim - 2)), b = static_cast<double>(p.tensor.size(dim - 1));
  const double e = dim == 3 ? static_cast<double>(p.tensor.size(0)) : 1.0;
  const double lo = std::min(a, b), hi = std::max(a, b);
  return n + e * static_cast<double>(options.muon.ns_steps) * (4 * lo * lo * hi + 2 * lo * lo * lo) / 10;
}

std::unique_ptr<Optimizer> make_optimizer(const ParameterList& params, const OptimizerOptions& options,
                                          std::vector<ElementRange> shard) {
  MT_CHECK(options.kind == "adamw" || options.kind == "muon", "train.optimizer: '{}' is not adamw or muon",
           options.kind);
  MT_CHECK(shard.empty() || shard.size() == params.size(), "optimizer: {} shard ranges for {} parameters",
           shard.size(), params.size());
  if (options.kind == "adamw") return std::make_unique<AdamW>(params, options.adamw, std::move(shard));
  std::vector<ChainedOptimizer::Part> parts;
  for (const bool muon : {false, true}) {
    ParameterList members;
    std::vector<size_t> index;
    std::vector<ElementRange> ranges;
    for (size_t i = 0; i < params.size(); ++i) {
      if (uses_muon(options, params[i]) != muon) continue;
      members.push_back(params[i]);
      index.push_back(i);
      if (!shard.empty()) ranges.push_back(shard[i]);
    }
    if (members.empty()) continue;
    std::unique_ptr<Optimizer> rule;
    if (muon)
      rule = std::make_unique<Muon>(members, options.muon, std::move(ranges));
    else
      rule = std::make_unique<AdamW>(members, options.adamw, std::move(ranges));
    parts.push_back({std::move(rule), std::move(index)});
  }
  if (parts.empty()) return std::make_unique<AdamW>(params, options.adamw, std::move(shard));  // no parameters
  return std::make_unique<ChainedOptimizer>(params, std::move(parts));
}

}  // namespace moetrain
