// NcclGroup on NCCL (comm/nccl.h): the only file that includes nccl.h.
// Compiled when MOETRAIN_WITH_CUDA (else nccl_disabled.cpp).
//
// Bootstrap: on the first collective, rank 0 of the group calls ncclGetUniqueId
// and broadcasts the id through the group's host Communicator as i32[33] (32
// words of id, then rank 0's NCCL status, so a failure there is reported on
// every rank instead of leaving the peers waiting); then every rank calls
// ncclCommInitRank on the tensor's device. No MPI here: the host communicator
// does the exchange.
//
// Every call is queued on cuda::stream(device) after cuda::set_device(device).
// Data types: sums use NCCL's type of the dtype; byte moves (all_gather,
// broadcast, all_to_all_v) count ncclUint8, so any dtype and any row size work
// (NCCL counts are size_t). Zero-byte operations are skipped on every rank
// alike (their sizes agree across ranks by contract).
#include "comm/nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/runtime.h"
#include "comm/communicator.h"
#include "comm/watchdog.h"

namespace moetrain::comm {

namespace {

// Set by an exit handler registered at the first NCCL communicator: the
// handler runs before the destructors of static communicators made earlier
// (the world), which then leave their NCCL communicators to the process exit
// instead of calling into NCCL and CUDA while those are being torn down.
bool g_exiting = false;
void mark_exiting() { g_exiting = true; }

ncclDataType_t nccl_sum_type(DType d) {
  switch (d) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    default: break;
  }
  MT_THROW("NCCL sum of dtype {}: not a summable dtype (checked before; a bug)", d);
}

size_t nccl_count(int64_t n) { return static_cast<size_t>(n); }

// The communication stream of each device (start_all_reduce_sum), made on first
// use and never destroyed (like the compute streams).
cudaStream_t comm_stream(int device) {
  static std::mutex mutex;
  static cudaStream_t streams[cuda::kMaxDevices] = {};
  std::lock_guard<std::mutex> lock(mutex);
  if (streams[device] == nullptr) MT_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  return streams[device];
}

// An event without timing, destroyed with its owner.
class Event {
 public:
  Event() { MT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() {
    if (event_ && !g_exiting) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// start_all_reduce_sum on a GPU: `done` is recorded on the communication
// stream after the sum.
class NcclPendingSum final : public PendingCollective {
 public:
  NcclPendingSum(Tensor t, int device) : t_(std::move(t)), device_(device) {}
  ~NcclPendingSum() override {
    if (waited_ || g_exiting) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "moetrain: an NCCL all_reduce_sum never waited for failed: %s\n", e.what());
    }
  }
  NcclPendingSum(const NcclPendingSum&) = delete;
  NcclPendingSum& operator=(const NcclPendingSum&) = delete;

  void wait() override {
    if (waited_) return;
    waited_ = true;
    cuda::set_device(device_);
    MT_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(device_), done_.get(), 0));
  }
  bool test() override {
    const cudaError_t status = cudaEventQuery(done_.get());
    if (status == cudaErrorNotReady) return false;
    MT_CUDA_CHECK(status);
    return true;
  }
  const Event& done() const { return done_; }

 private:
  Tensor t_;  // the buffer stays allocated until the compute stream waits for the sum
  int device_;
  Event done_;
  bool waited_ = false;
};

}  // namespace

// A failed NCCL call throws moetrain::Error: "NCCL call ncclAllReduce(...) failed
// on rank 1 of 4 (host node3, cuda:1): unhandled system error: <last error>".
// For members of NcclGroup and NcclGroup::Impl: both have fail_nccl(), which
// adds the rank, host and device.
#define MT_NCCL_CHECK(call)               \
  do {                                    \
    ncclResult_t res_ = (call);           \
    if (res_ != ncclSuccess) [[unlikely]] \
      fail_nccl(res_, #call);             \
  } while (0)

struct NcclGroup::Impl {
  Communicator& host;
  int device;
  ncclComm_t comm = nullptr;

  // Collective over the host group: every rank must call it.
  Impl(Communicator& host_comm, int cuda_device) : host(host_comm), device(cuda_device) {
    static std::once_flag once;
    std::call_once(once, [] { std::atexit(mark_exiting); });
    cuda::set_device(device);

    static_assert(sizeof(ncclUniqueId) == 32 * sizeof(int32_t), "ncclUniqueId is 128 bytes");
    ncclUniqueId id{};
    Tensor id_words = zeros(Shape{33}, DType::i32);  // [32 words of id, rank 0's ncclResult_t]
    int32_t* w = id_words.data<int32_t>();
    if (host.rank() == 0) {
      ncclResult_t res = ncclGetUniqueId(&id);
      std::memcpy(w, &id, sizeof id);
      w[32] = static_cast<int32_t>(res);
    }
    host.broadcast(id_words, 0);
    w = id_words.data<int32_t>();
    if (w[32] != ncclSuccess)
      fail_nccl(w[32], host.rank() == 0 ? "ncclGetUniqueId" : "ncclGetUniqueId (on rank 0)");
    std::memcpy(&id, w, sizeof id);
    WatchdogWait wait("ncclCommInitRank");
    MT_NCCL_CHECK(ncclCommInitRank(&comm, host.size(), id, host.rank()));
  }

  ~Impl() {
    // Errors here have no one to go to; at exit the process frees everything.
    if (comm == nullptr || g_exiting) return;
    cudaSetDevice(device);
    ncclCommDestroy(comm);
  }
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;

  [[noreturn]] void fail_nccl(int res, const char* call) const {
    const char* last = ncclGetLastError(comm);
    throw Error(fmt::format("NCCL call {} failed on rank {} of {} (host {}, cuda:{}): {}{}{}", call, host.rank(),
                            host.size(), host.host(), device, ncclGetErrorString(static_cast<ncclResult_t>(res)),
                            last && *last ? ": " : "", last ? last : ""));
  }

  cudaStream_t stream() const { return cuda::stream(device); }
};

namespace {

// ncclGroupStart ... ncclGroupEnd; the destructor closes a group left open by
// an exception, so this thread's later NCCL calls are not swallowed by it.
class GroupCall {
 public:
  explicit GroupCall(const NcclGroup::Impl& g) : g_(g) {
    ncclResult_t res = ncclGroupStart();
    if (res != ncclSuccess) g_.fail_nccl(res, "ncclGroupStart()");
    open_ = true;
  }
  void end() {
    open_ = false;
    ncclResult_t res = ncclGroupEnd();
    if (res != ncclSuccess) g_.fail_nccl(res, "ncclGroupEnd()");
  }
  ~GroupCall() {
    if (open_) ncclGroupEnd();
  }
  GroupCall(const GroupCall&) = delete;
  GroupCall& operator=(const GroupCall&) = delete;

 private:
  const NcclGroup::Impl& g_;
  bool open_ = false;
};

}  // namespace

NcclGroup::NcclGroup(Communicator& host) : host_(host) {}
NcclGroup::~NcclGroup() = default;

int NcclGroup::device() const { return impl_ ? impl_->device : -1; }

void NcclGroup::fail_nccl(int res, const char* call) const { impl_->fail_nccl(res, call); }

NcclGroup::Impl& NcclGroup::impl_for(const char* op, const Tensor& t) {
  detail::check_defined(op, t);
  MT_CHECK(t.is_cuda(), "{}: {} is not on a GPU; NCCL moves CUDA tensors (a bug: the caller routes by device)", op,
           describe(t));
  if (!impl_) {
    impl_ = std::make_unique<Impl>(host_, t.device().index);
  } else {
    MT_CHECK(t.device().index == impl_->device,
             "{}: {} is on cuda:{} but this group's NCCL communicator is on cuda:{} (rank {} of {}, host {}); one "
             "process uses one GPU per group: move the tensor with .to(Device{{DeviceKind::cuda, {}}})",
             op, describe(t), t.device().index, impl_->device, host_.rank(), host_.size(), host_.host(),
             impl_->device);
  }
  cuda::set_device(impl_->device);
  return *impl_;
}

std::unique_ptr<PendingCollective> NcclGroup::start_all_reduce_sum(Tensor& t) {
  detail::check_sum_dtype("start_all_reduce_sum", t);
  Impl& g = impl_for("start_all_reduce_sum", t);
  auto pending = std::make_unique<NcclPendingSum>(t, g.device);
  if (t.numel() == 0) return pending;  // skipped on every rank alike
  const cudaStream_t comm = comm_stream(g.device);
  Event inputs_ready;
  MT_CUDA_CHECK(cudaEventRecord(inputs_ready.get(), g.stream()));
  MT_CUDA_CHECK(cudaStreamWaitEvent(comm, inputs_ready.get(), 0));
  MT_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), nccl_count(t.numel()), nccl_sum_type(t.dtype()), ncclSum,
                              g.comm, comm));
  MT_CUDA_CHECK(cudaEventRecord(pending->done().get(), comm));
  return pending;
}

void NcclGroup::all_reduce_sum(Tensor& t) {
  detail::check_sum_dtype("all_reduce_sum", t);
  Impl& g = impl_for("all_reduce_sum", t);
  if (t.numel() == 0) return;
  MT_NCCL_CHECK(ncclAllReduce(t.raw_data(), t.raw_data(), nccl_count(t.numel()), nccl_sum_type(t.dtype()), ncclSum,
                              g.comm, g.stream()));
}

Tensor NcclGroup::reduce_scatter_sum(const Tensor& t) {
  const int64_t n = detail::check_reduce_scatter(t, host_.size());
  Impl& g = impl_for("reduce_scatter_sum", t);
  Tensor out = empty(t.shape().with(0, n), t.dtype(), t.device());
  if (out.numel() == 0) return out;
  MT_NCCL_CHECK(ncclReduceScatter(t.raw_data(), out.raw_data(), nccl_count(out.numel()), nccl_sum_type(t.dtype()),
                                  ncclSum, g.comm, g.stream()));
  return out;
}

Tensor NcclGroup::reduce_scatter_sum_v(const Tensor& t, const std::vector<int64_t>& counts) {
  Impl& g = impl_for("reduce_scatter_sum_v", t);
  const int me = host_.rank();
  Tensor out = empty(Shape{counts[static_cast<size_t>(me)]}, t.dtype(), t.device());
  const size_t esize = static_cast<size_t>(dtype_size(t.dtype()));
  MT_NCCL_CHECK(ncclGroupStart());
  int64_t at = 0;
  for (int r = 0; r < host_.size(); ++r) {
    const int64_t n = counts[static_cast<size_t>(r)];
    if (n > 0)
      MT_NCCL_CHECK(ncclReduce(static_cast<const char*>(t.raw_data()) + static_cast<size_t>(at) * esize,
                               r == me ? out.raw_data() : nullptr, nccl_count(n), nccl_sum_type(t.dtype()), ncclSum,
                               r, g.comm, g.stream()));
    at += n;
  }
  MT_NCCL_CHECK(ncclGroupEnd());
  return out;
}

Tensor NcclGroup::all_gather_v(const Tensor& t, const std::vector<int64_t>& counts) {
  Impl& g = impl_for("all_gather_v", t);
  const int me = host_.rank();
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  Tensor out = empty(Shape{total}, t.dtype(), t.device());
  const size_t esize = static_cast<size_t>(dtype_size(t.dtype()));
  MT_NCCL_CHECK(ncclGroupStart());
  int64_t at = 0;
  for (int r = 0; r < host_.size(); ++r) {
    const int64_t n = counts[static_cast<size_t>(r)];
    if (n > 0)
      MT_NCCL_CHECK(ncclBroadcast(r == me ? t.raw_data() : nullptr,
                                  static_cast<char*>(out.raw_data()) + static_cast<size_t>(at) * esize,
                                  nccl_count(n * static_cast<int64_t>(esize)), ncclUint8, r, g.comm, g.stream()));
    at += n;
  }
  MT_NCCL_CHECK(ncclGroupEnd());
  return out;
}

Tensor NcclGroup::all_gather(const Tensor& t) {
  detail::check_defined("all_gather", t);
  MT_CHECK(t.dim() >= 1, "all_gather: {} has no row dim (dim 0)", describe(t));
  Impl& g = impl_for("all_gather", t);
  const int64_t rows = t.size(0), row_bytes = t.shape().numel(1, t.dim()) * dtype_size(t.dtype());
  // Shapes must agree (NCCL would read or write past the buffers): one small
  // exchange on the host, as the MPI communicator does.
  Tensor mine = from_vector({static_cast<double>(rows), static_cast<double>(row_bytes),
                             static_cast<double>(static_cast<int>(t.dtype()))},
                            Shape{1, 3}, DType::i64);
  Tensor all = host_.all_gather(mine);  // [size, 3]
  const int64_t* a = all.data<int64_t>();
  for (int r = 0; r < host_.size(); ++r) {
    const int64_t* o = a + 3 * r;
    MT_CHECK(o[0] == a[0] && o[1] == a[1] && o[2] == a[2],
             "all_gather: ranks pass different shapes: rank 0 has {} rows of {} bytes ({}), rank {} has {} rows of "
             "{} bytes ({}); every rank must pass the same shape (rank {} of {} passes {})",
             a[0], a[1], static_cast<DType>(a[2]), r, o[0], o[1], static_cast<DType>(o[2]), host_.rank(),
             host_.size(), describe(t));
  }
  Tensor out = empty(t.shape().with(0, rows * host_.size()), t.dtype(), t.device());
  if (t.nbytes() == 0) return out;
  MT_NCCL_CHECK(ncclAllGather(t.raw_data(), out.raw_data(), nccl_count(t.nbytes()), ncclUint8, g.comm, g.stream()));
  return out;
}

void NcclGroup::broadcast(Tensor& t, int root) {
  detail::check_defined("broadcast", t);
  MT_CHECK(root >= 0 && root < host_.size(), "broadcast: root {} is not a rank of this group of {} (rank {}, host {})",
           root, host_.size(), host_.rank(), host_.host());
  Impl& g = impl_for("broadcast", t);
  if (t.nbytes() == 0) return;
  MT_NCCL_CHECK(ncclBroadcast(t.raw_data(), t.raw_data(), nccl_count(t.nbytes()), ncclUint8, root, g.comm, g.stream()));
}

Tensor NcclGroup::all_to_all_v(const Tensor& send, const std::vector<int64_t>& send_rows,
                               const std::vector<int64_t>& recv_rows) {
  const int64_t row_elems = detail::check_all_to_all_v(send, send_rows, recv_rows, host_.size());
  Impl& g = impl_for("all_to_all_v", send);
  int64_t num_recv = 0;
  for (int64_t k : recv_rows) num_recv += k;
  Tensor out = empty(send.shape().with(0, num_recv), send.dtype(), send.device());
  const int64_t row_bytes = row_elems * dtype_size(send.dtype());
  const char* src = static_cast<const char*>(send.raw_data());
  char* dst = static_cast<char*>(out.raw_data());
  // One group of point-to-point calls: NCCL runs them together (no ordering
  // among peers, so no deadlock), self included. A pair with no bytes is
  // skipped by both sides: recv_rows[r] equals what rank r sends here.
  GroupCall group(g);
  int64_t send_at = 0, recv_at = 0;
  for (int peer = 0; peer < host_.size(); ++peer) {
    const int64_t send_bytes = send_rows[nccl_count(peer)] * row_bytes,
                  recv_bytes = recv_rows[nccl_count(peer)] * row_bytes;
    if (send_bytes > 0)
      MT_NCCL_CHECK(ncclSend(src + send_at, nccl_count(send_bytes), ncclUint8, peer, g.comm, g.stream()));
    if (recv_bytes > 0)
      MT_NCCL_CHECK(ncclRecv(dst + recv_at, nccl_count(recv_bytes), ncclUint8, peer, g.comm, g.stream()));
    send_at += send_bytes;
    recv_at += recv_bytes;
  }
  group.end();
  return out;
}

void NcclGroup::send_recv(std::vector<P2POp>& ops) {
  detail::check_send_recv(ops, host_.size());
  if (ops.empty()) return;
  Impl& g = impl_for("send_recv", ops.front().tensor);
  for (const P2POp& op : ops)
    MT_CHECK(op.tensor.device() == ops.front().tensor.device(), "send_recv: {} is on another device than {}",
             describe(op.tensor), describe(ops.front().tensor));
  // One group: NCCL progresses all of them together (no ordering among them, so
  // a send and a receive with the same or different peers cannot deadlock).
  // Sizes are not exchanged: the pipeline passes matching shapes on both sides.
  GroupCall group(g);
  for (P2POp& op : ops) {
    if (op.tensor.nbytes() == 0) continue;
    if (op.kind == P2POp::Kind::send)
      MT_NCCL_CHECK(ncclSend(op.tensor.raw_data(), nccl_count(op.tensor.nbytes()), ncclUint8, op.peer, g.comm,
                             g.stream()));
    else
      MT_NCCL_CHECK(ncclRecv(op.tensor.raw_data(), nccl_count(op.tensor.nbytes()), ncclUint8, op.peer, g.comm,
                             g.stream()));
  }
  group.end();
}

}  // namespace moetrain::comm
