#include "nn/parameters.h"

#include <string_view>

#include <fmt/format.h>

#include "ops/reduce/reduce.h"

namespace moetrain {

int64_t count_parameters(const ParameterList& params) {
  int64_t n = 0;
  for (const NamedParameter& p : params) n += p.tensor.numel();
  return n;
}

std::optional<NonFiniteTensor> find_non_finite(const ParameterList& params) {
  for (const NamedParameter& p : params)
    if (p.tensor.defined())
      if (const int64_t bad = count_non_finite(p.tensor); bad > 0) return NonFiniteTensor{p.name, p.tensor.shape(), bad};
  return std::nullopt;
}

std::string describe(const NonFiniteTensor& t) {
  return fmt::format("{} {}: {} of {} values are NaN or infinite", t.name, t.shape, t.count, t.shape.numel());
}

bool stays_f32_in_mixed_precision(const NamedParameter& p) {
  auto ends_with = [&](std::string_view suffix) {
    return p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return p.group == "router" || ends_with(".A_log") || ends_with(".dt_bias") || ends_with("_conv1d.weight") ||
         ends_with(".o_norm.weight");
}

bool is_hidden_matrix(std::string_view name, std::string_view group, int64_t dim) {
  return (dim == 2 || dim == 3) && group != "embedding" && group != "lm_head" && group != "router" &&
         !name.ends_with("_conv1d.weight");
}

bool is_hidden_matrix(const NamedParameter& p) { return is_hidden_matrix(p.name, p.group, p.tensor.dim()); }

}  // namespace moetrain
