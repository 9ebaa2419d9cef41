#include "nn/parameters.h"

namespace moetrain {

int64_t count_parameters(const ParameterList& params) {
  int64_t n = 0;
  for (const NamedParameter& p : params) n += p.tensor.numel();
  return n;
}

}  // namespace moetrain
