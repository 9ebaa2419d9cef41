#include "core/error.h"

namespace moetrain::detail {

void throw_assert(const char* cond, const char* file, int line, const std::string& msg) {
  throw Error(fmt::format("internal error at {}:{}: {} ({}); please report this as a moetrain bug",
                          file, line, msg, cond));
}

}  // namespace moetrain::detail
