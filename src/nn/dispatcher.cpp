#include "nn/dispatcher.h"

#include <spdlog/spdlog.h>

#include "comm/collectives.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"
#include "ops/view/view.h"

namespace moetrain {

Tensor LocalDispatcher::dispatch(const Tensor& rows, const std::vector<int64_t>& counts,
                                 const ExpertsFn& experts) const {
  return experts(rows, counts);
}

AllToAllDispatcher::AllToAllDispatcher(comm::Communicator& group, int64_t num_experts)
    : group_(group), num_experts_(num_experts) {
  MT_CHECK(num_experts % group.size() == 0, "moe dispatch: {} experts cannot be split over {} ranks", num_experts,
           group.size());
}

Tensor AllToAllDispatcher::dispatch(const Tensor& z, const std::vector<int64_t>& counts,
                                    const ExpertsFn& experts) const {
  comm::WatchdogLabel label("expert dispatch");  // and combine; their backward is labelled "backward"
  const int P = group_.size();
  const int64_t El = num_experts_ / P;
  // Rows for rank r are contiguous (experts sorted globally, rank r holds a range).
  std::vector<int64_t> send_rows(static_cast<size_t>(P), 0), per_peer(static_cast<size_t>(P), El);
  for (int r = 0; r < P; ++r)
    for (int64_t e = r * El; e < (r + 1) * El; ++e) send_rows[r] += counts[e];
  // recv_counts[s·El + e]: rows source s sends for local expert e.
  Tensor sent_counts = empty({P * El}, DType::i64);
  std::copy(counts.begin(), counts.end(), sent_counts.data<int64_t>());
  Tensor received = group_.all_to_all_v(sent_counts, per_peer, per_peer);
  const std::vector<int64_t> recv_counts(received.data<int64_t>(), received.data<int64_t>() + P * El);
  std::vector<int64_t> recv_rows(static_cast<size_t>(P), 0), local(static_cast<size_t>(El), 0);
  std::vector<int64_t> offset(static_cast<size_t>(P * El));
  int64_t row = 0;
  for (int s = 0; s < P; ++s)
    for (int64_t e = 0; e < El; ++e) {
      offset[s * El + e] = row;
      row += recv_counts[s * El + e];
      recv_rows[s] += recv_counts[s * El + e];
      local[e] += recv_counts[s * El + e];
    }
  if (!logged_sizes_) {
    logged_sizes_ = true;
    spdlog::debug("moe dispatch (ep rank {} of {}): sends {} rows [{}], receives {} [{}], {} per local expert [{}]",
                  group_.rank(), P, z.size(0), fmt::join(send_rows, ", "), row, fmt::join(recv_rows, ", "), El,
                  fmt::join(local, ", "));
  }
  Tensor recv = comm::all_to_all_v(group_, z, send_rows, recv_rows);  // [row, W], (source, expert) order
  // Group by local expert (source order within an expert), run, and restore the order.
  std::vector<int64_t> perm, inverse(static_cast<size_t>(row));
  perm.reserve(static_cast<size_t>(row));
  for (int64_t e = 0; e < El; ++e)
    for (int s = 0; s < P; ++s)
      for (int64_t i = 0; i < recv_counts[s * El + e]; ++i) {
        inverse[offset[s * El + e] + i] = static_cast<int64_t>(perm.size());
        perm.push_back(offset[s * El + e] + i);
      }
  Tensor out = experts(index_select(recv, 0, perm), local);
  return comm::all_to_all_v(group_, index_select(out, 0, inverse), recv_rows, send_rows);
}

}  // namespace moetrain
