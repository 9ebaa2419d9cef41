// NcclGroup in a build without CUDA (comm/nccl.h): no tensor can be on a GPU
// there, so the communicators never route a collective here; if something did,
// it gets the same "built without CUDA" error as every other GPU entry point.
#include "comm/nccl.h"

#include "backend/cuda/runtime.h"
#include "comm/communicator.h"

namespace moetrain::comm {

struct NcclGroup::Impl {};

NcclGroup::NcclGroup(Communicator& host) : host_(host) {}
NcclGroup::~NcclGroup() = default;

int NcclGroup::device() const { return -1; }
NcclGroup::Impl& NcclGroup::impl_for(const char* op, const Tensor&) { cuda::no_cuda(op); }
void NcclGroup::fail_nccl(int, const char* call) const { cuda::no_cuda(call); }

void NcclGroup::all_reduce_sum(Tensor&) { cuda::no_cuda("NCCL all_reduce_sum"); }
std::unique_ptr<PendingCollective> NcclGroup::start_all_reduce_sum(Tensor&) {
  cuda::no_cuda("NCCL start_all_reduce_sum");
}
Tensor NcclGroup::all_gather(const Tensor&) { cuda::no_cuda("NCCL all_gather"); }
void NcclGroup::broadcast(Tensor&, int) { cuda::no_cuda("NCCL broadcast"); }
Tensor NcclGroup::all_to_all_v(const Tensor&, const std::vector<int64_t>&, const std::vector<int64_t>&) {
  cuda::no_cuda("NCCL all_to_all_v");
}
Tensor NcclGroup::reduce_scatter_sum(const Tensor&) { cuda::no_cuda("NCCL reduce_scatter_sum"); }
void NcclGroup::send_recv(std::vector<P2POp>&) { cuda::no_cuda("NCCL send_recv"); }
Tensor NcclGroup::reduce_scatter_sum_v(const Tensor&, const std::vector<int64_t>&) {
  cuda::no_cuda("NCCL reduce_scatter_sum_v");
}
Tensor NcclGroup::all_gather_v(const Tensor&, const std::vector<int64_t>&) { cuda::no_cuda("NCCL all_gather_v"); }

}  // namespace moetrain::comm
