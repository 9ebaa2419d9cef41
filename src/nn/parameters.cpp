#include "nn/parameters.h"

#include <string_view>

namespace moetrain {

int64_t count_parameters(const ParameterList& params) {
  int64_t n = 0;
  for (const NamedParameter& p : params) n += p.tensor.numel();
  return n;
}

bool stays_f32_in_mixed_precision(const NamedParameter& p) {
  auto ends_with = [&](std::string_view suffix) {
    return p.name.size() >= suffix.size() && p.name.compare(p.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return p.group == "router" || ends_with(".A_log") || ends_with(".dt_bias") || ends_with("_conv1d.weight") ||
         ends_with(".o_norm.weight");
}

}  // namespace moetrain
