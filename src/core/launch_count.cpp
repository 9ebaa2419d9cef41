// format_launches_per_step (core/launch_count.h).
#include "core/launch_count.h"

#include <fmt/format.h>

namespace moetrain {

namespace {

std::string launches_per_step_text(int64_t total, int64_t steps) {
  const double mean = static_cast<double>(total) / static_cast<double>(steps);
  return total % steps == 0 ? fmt::format("{}", total / steps) : fmt::format("{:.1f}", mean);
}

}  // namespace

std::string format_launches_per_step(const LaunchCounts& counts, int64_t steps, bool on_gpu) {
  if (steps <= 0) return "no step counted";
  if (on_gpu)
    return fmt::format("{} ({} kernels + {} cuBLAS/cuBLASLt calls)",
                       launches_per_step_text(counts.cuda_total(), steps),
                       launches_per_step_text(counts.cuda_kernels, steps),
                       launches_per_step_text(counts.cuda_library, steps));
  return fmt::format("{} CPU kernel calls (the op kernels picked through MT_ON_DEVICE, as a GPU step launches them; "
                     "docs/cuda.md, \"The launch path and the launch counter\")",
                     launches_per_step_text(counts.cpu_kernels, steps));
}

}  // namespace moetrain
