// CUDA runtime calls (compiled only when the CUDA backend is on): per-device
// state (stream, caching allocator) created on first use.
#include "backend/cuda/runtime.h"

#include <array>
#include <cstring>
#include <iterator>
#include <memory>
#include <mutex>
#include <vector>

#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "backend/cuda/graph.h"
#include "backend/cuda/launch_check.h"
#include "backend/cuda/pending_copy.h"
#include "backend/cuda/staging_ring.h"
#include "core/error.h"
#include "core/graph_capture.h"
#include "core/launch_count.h"
#include "core/profile.h"

namespace moetrain::cuda {

bool built_with_cuda() { return true; }

int device_count() {
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no driver" error
      return 0;
    }
    return count;
  }();
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

namespace {

struct DeviceState;

// The device this thread is bound to (-1: none yet) and its state once made: set by
// set_device, read by every stream() and allocation (state() below), so the launch
// path never asks CUDA which device is current nor sets it again.
thread_local int t_device = -1;
thread_local DeviceState* t_state = nullptr;

}  // namespace

void set_device(int device) {
  if (device == t_device) [[likely]] return;
  int n = device_count();
  MT_CHECK(device >= 0 && device < n, "cuda:{} requested but {} CUDA device(s) are visible{}", device, n,
           n == 0 ? " (no driver or no GPU; check nvidia-smi and CUDA_VISIBLE_DEVICES)" : "");
  MT_CUDA_CHECK(cudaSetDevice(device));
  t_device = device;
  t_state = nullptr;  // found again by state() on first use
}

int current_device() {
  if (t_device >= 0) [[likely]] return t_device;
  int device = 0;
  MT_CUDA_CHECK(cudaGetDevice(&device));
  set_device(device);
  return device;
}

int select_device(int local_rank) {
  int n = device_count();
  MT_CHECK(n > 0, "no CUDA device is visible to this process (local rank {}); check nvidia-smi and "
                  "CUDA_VISIBLE_DEVICES, or train on the CPU", local_rank);
  int device = local_rank % n;
  set_device(device);
  return device;
}

namespace {

// A CUDA error where memory was expected: by its name, not as "out of memory"
// (launch_check.h: device_fault_message). Not cleared: a sticky error cannot be.
[[noreturn]] void throw_device_fault(cudaError_t err, const std::string& during) {
  throw Error(device_fault_message(cudaGetErrorName(err), cudaGetErrorString(err), static_cast<int>(err), during,
                                   g_last_kernel_launched.load(std::memory_order_relaxed)));
}

class CudaMemory final : public RawMemory {
 public:
  explicit CudaMemory(int device) : device_(device) {}
  void* allocate(int64_t nbytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, static_cast<size_t>(nbytes));
    if (err != cudaSuccess) {
      // Out of memory is not sticky: cleared, and the caching allocator frees its cache,
      // retries and reports the memory. Any other error (a sticky one from an earlier
      // kernel: cudaErrorIllegalAddress, ...) is reported as what it is, not as OOM.
      const cudaError_t last = cudaPeekAtLastError();
      if (err == cudaErrorMemoryAllocation && (last == cudaSuccess || last == cudaErrorMemoryAllocation)) {
        cudaGetLastError();
        return nullptr;
      }
      throw_device_fault(err != cudaErrorMemoryAllocation ? err : last,
                         fmt::format("allocating {} bytes on cuda:{}", nbytes, device_));
    }
    return p;
  }
  void release(void* ptr) override { cudaFree(ptr); }
  void memory_info(int64_t* free_bytes, int64_t* total_bytes) override {
    size_t f = 0, t = 0;
    const cudaError_t err = cudaMemGetInfo(&f, &t);
    if (err != cudaSuccess && err != cudaErrorMemoryAllocation)
      throw_device_fault(err, fmt::format("asking cuda:{} for its free memory", device_));
    if (err != cudaSuccess) cudaGetLastError();
    *free_bytes = static_cast<int64_t>(f);
    *total_bytes = static_cast<int64_t>(t);
  }

 private:
  int device_;
};

// Host-to-device copies go through a pinned ring (staging_ring.h; docs/cuda.md,
// "Host synchronisation"): copies up to kStagedCopyMax bytes return without waiting
// for the GPU; larger ones (weights, checkpoints: not the training step) and every
// copy after a failed pinned allocation wait for the stream, as plain copies do.
constexpr int64_t kStagingBytes = int64_t{32} << 20;
constexpr int64_t kStagedCopyMax = int64_t{8} << 20;
// PendingCopy's pinned blocks: powers of two from 64 KiB, kept for reuse.
constexpr int64_t kPinnedMin = int64_t{64} << 10;

struct Staging {
  std::mutex mutex;  // every member below
  unsigned char* base = nullptr;
  bool unavailable = false;  // the pinned ring could not be allocated: copies wait
  StagingRing<cudaEvent_t> ring{kStagingBytes};
  std::vector<cudaEvent_t> free_events;
  std::vector<std::pair<void*, int64_t>> free_pinned;  // (block, capacity)

  cudaEvent_t event() {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
};

struct DeviceState {
  explicit DeviceState(int device)
      : memory(device), allocator(memory, fmt::format("cuda:{} ({})", device, device_name(device))) {
    MT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  // Never destroyed (see state()): the CUDA context may be gone at exit.
  cudaStream_t stream = nullptr;
  CudaMemory memory;
  CachingAllocator allocator;
  std::mutex mutex;  // allocator calls
  Staging staging;
};

// Whether an event has passed, without waiting. cudaEventQuery's "not ready" is
// cleared, so the next launch check does not report it.
bool event_passed(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  MT_CUDA_CHECK(r);
  return true;
}

std::array<std::once_flag, kMaxDevices> g_once;
std::array<DeviceState*, kMaxDevices> g_state{};

// The state of `device`, made current for this thread. The bound device's is a
// compare and a load (t_state); another device binds the thread to it first.
DeviceState& bind_state(int device) {
  MT_CHECK(device >= 0 && device < kMaxDevices, "cuda:{}: at most {} devices per process", device, kMaxDevices);
  set_device(device);
  std::call_once(g_once[static_cast<size_t>(device)],
                 [device] { g_state[static_cast<size_t>(device)] = new DeviceState(device); });
  t_state = g_state[static_cast<size_t>(device)];
  return *t_state;
}

DeviceState& state(int device) {
  if (device == t_device && t_state) [[likely]] return *t_state;
  return bind_state(device);
}

}  // namespace

CUstream_st* stream(int device) { return state(device).stream; }

void synchronize(int device) {
  graph::refuse_if_capturing("a wait for the GPU");
  MT_CUDA_CHECK(cudaStreamSynchronize(state(device).stream));
}

void* device_malloc(int64_t nbytes, int device) {
  DeviceState& s = state(device);
  std::lock_guard lock(s.mutex);
  return s.allocator.allocate(nbytes, profile::current_region());
}

void device_free(void* ptr, int device) {
  // Runs in Storage's destructor: never throws. Before the first allocation
  // there is nothing to free.
  DeviceState* s = device >= 0 && device < kMaxDevices ? g_state[static_cast<size_t>(device)] : nullptr;
  if (!s) return;
  std::lock_guard lock(s->mutex);
  s->allocator.release(ptr);
}

MemoryStats memory_stats(int device) {
  DeviceState& s = state(device);
  std::lock_guard lock(s.mutex);
  return s.allocator.stats();
}

void empty_cache(int device) {
  graph::refuse_if_capturing("emptying the CUDA memory cache");
  DeviceState& s = state(device);
  std::lock_guard lock(s.mutex);
  MT_CUDA_CHECK(cudaStreamSynchronize(s.stream));  // cached blocks may still be in use by queued work
  s.allocator.empty_cache();
}

void copy_host_to_device(void* dst, const void* src, int64_t nbytes, int device) {
  if (nbytes <= 0) return;
  graph::refuse_if_capturing("a copy from the host to the GPU");
  DeviceState& ds = state(device);
  cudaStream_t st = ds.stream;
  Staging& s = ds.staging;
  if (nbytes <= kStagedCopyMax) {
    std::lock_guard lock(s.mutex);
    if (!s.base && !s.unavailable) {
      void* p = nullptr;
      if (cudaHostAlloc(&p, static_cast<size_t>(kStagingBytes), cudaHostAllocDefault) == cudaSuccess) {
        s.base = static_cast<unsigned char*>(p);
      } else {
        cudaGetLastError();  // not sticky: copies go on without the ring
        s.unavailable = true;
      }
    }
    if (s.base) {
      s.ring.reap([&](cudaEvent_t e) {
        if (!event_passed(e)) return false;
        s.free_events.push_back(e);
        return true;
      });
      const int64_t at = s.ring.acquire(nbytes, [&](cudaEvent_t e) {
        MT_CUDA_CHECK(cudaEventSynchronize(e));
        s.free_events.push_back(e);
      });
      std::memcpy(s.base + at, src, static_cast<size_t>(nbytes));
      MT_CUDA_CHECK(cudaMemcpyAsync(dst, s.base + at, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, st));
      cudaEvent_t done = s.event();
      MT_CUDA_CHECK(cudaEventRecord(done, st));
      s.ring.push(at, nbytes, done);
      return;
    }
  }
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice, st));
  // The source is pageable host memory the caller may free or change next.
  MT_CUDA_CHECK(cudaStreamSynchronize(st));
}

PendingCopy::PendingCopy(const void* src, int64_t nbytes, int device) : device_(device) {
  MT_CHECK(nbytes > 0, "PendingCopy: {} bytes", nbytes);
  graph::refuse_if_capturing("a copy from the GPU to the host");
  DeviceState& ds = state(device);
  Staging& s = ds.staging;
  {
    std::lock_guard lock(s.mutex);
    // The smallest block that fits; among equal ones the last returned (still warm).
    auto best = s.free_pinned.end();
    for (auto it = s.free_pinned.rbegin(); it != s.free_pinned.rend(); ++it)
      if (it->second >= nbytes && (best == s.free_pinned.end() || it->second < best->second)) best = std::prev(it.base());
    if (best != s.free_pinned.end()) {
      host_ = best->first;
      capacity_ = best->second;
      s.free_pinned.erase(best);
    }
    event_ = s.event();
  }
  try {
    if (!host_) {
      capacity_ = kPinnedMin;
      while (capacity_ < nbytes) capacity_ *= 2;
      MT_CUDA_CHECK(cudaHostAlloc(&host_, static_cast<size_t>(capacity_), cudaHostAllocDefault));
    }
    MT_CUDA_CHECK(cudaMemcpyAsync(host_, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost, ds.stream));
    MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), ds.stream));
  } catch (...) {
    // A copy that was queued may still write the block: wait for the stream first.
    cudaStreamSynchronize(ds.stream);
    std::lock_guard lock(s.mutex);
    s.free_events.push_back(static_cast<cudaEvent_t>(event_));
    if (host_) s.free_pinned.emplace_back(host_, capacity_);
    throw;
  }
}

PendingCopy::PendingCopy(PendingCopy&& other) noexcept
    : host_(other.host_), event_(other.event_), capacity_(other.capacity_), device_(other.device_),
      arrived_(other.arrived_) {
  other.host_ = nullptr;
  other.event_ = nullptr;
}

const void* PendingCopy::wait() {
  if (!arrived_) {
    MT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
    arrived_ = true;
  }
  return host_;
}

PendingCopy::~PendingCopy() {
  if (!host_ && !event_) return;
  // Never throws: an abandoned copy is waited for before its block is reused.
  if (!arrived_ && event_) cudaEventSynchronize(static_cast<cudaEvent_t>(event_));
  Staging& s = g_state[static_cast<size_t>(device_)]->staging;
  std::lock_guard lock(s.mutex);
  if (event_) s.free_events.push_back(static_cast<cudaEvent_t>(event_));
  if (host_) s.free_pinned.emplace_back(host_, capacity_);
}

void copy_device_to_host(void* dst, const void* src, int64_t nbytes, int device) {
  graph::refuse_if_capturing("a copy from the GPU to the host");
  cudaStream_t st = state(device).stream;
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost, st));
  MT_CUDA_CHECK(cudaStreamSynchronize(st));
}

void copy_device_to_device(void* dst, const void* src, int64_t nbytes, int device) {
  MT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToDevice,
                                state(device).stream));
}

void memset_zero(void* dst, int64_t nbytes, int device) {
  MT_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<size_t>(nbytes), state(device).stream));
}

Graph::Graph(int device, const std::function<void()>& body) : device_(device) {
  DeviceState& s = state(device);
  // The pool is current until the capture ends and is returned unless the graph is
  // made, whatever throws on the way.
  struct Pool {
    DeviceState& s;
    int id;
    bool current = true, kept = false;
    void end() {
      std::lock_guard lock(s.mutex);
      if (current) s.allocator.end_pool();
      current = false;
    }
    ~Pool() {
      end();
      std::lock_guard lock(s.mutex);
      if (!kept) s.allocator.release_pool(id);
    }
  };
  Pool pool{s, [&] {
              std::lock_guard lock(s.mutex);
              return s.allocator.begin_pool();
            }()};
  pool_ = pool.id;
  std::string refused;
  std::exception_ptr failed;  // anything else the body threw: rethrown once the capture is ended
  cudaGraph_t g = nullptr;
  {
    graph::CaptureScope scope;
    // Relaxed: the allocator may call cudaMalloc for the pool while capturing.
    const cudaError_t begun = cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeRelaxed);
    if (begun == cudaSuccess) {
      try {
        body();
      } catch (const graph::CaptureRefused& e) {
        refused = e.what();
      } catch (const OutOfMemoryError& e) {
        refused = std::string("out of memory while capturing: ") + e.what();
      } catch (...) {
        failed = std::current_exception();
      }
      const cudaError_t ended = cudaStreamEndCapture(s.stream, &g);
      if (ended != cudaSuccess) {
        // CUDA refused a call the body made (the error it threw says which) or the
        // capture as a whole: not capturable, not a bug of ours.
        std::string why;
        if (failed) {
          try {
            std::rethrow_exception(failed);
          } catch (const std::exception& e) {
            why = e.what();
          } catch (...) {
          }
          failed = nullptr;
        }
        if (refused.empty())
          refused = fmt::format("CUDA ended the capture: {} ({}){}{}", cudaGetErrorName(ended),
                                cudaGetErrorString(ended), why.empty() ? "" : "; ", why);
      }
    } else {
      refused = fmt::format("CUDA refused to begin a capture: {}", cudaGetErrorName(begun));
    }
    hooks_ = scope.take();
  }
  pool.end();
  if (failed || !refused.empty()) {
    cudaGetLastError();  // capture errors are not sticky: cleared, the stream runs eagerly again
    if (g) cudaGraphDestroy(g);
    if (failed) std::rethrow_exception(failed);  // a bug or a device fault: as it is
    throw graph::CaptureRefused(refused);
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, g, 0);
  if (made != cudaSuccess) {
    cudaGetLastError();
    cudaGraphDestroy(g);
    throw graph::CaptureRefused(fmt::format("CUDA could not instantiate the captured graph: {}", cudaGetErrorName(made)));
  }
  graph_ = g;
  exec_ = exec;
  pool.kept = true;
  size_t n = 0;
  nodes_ = cudaGraphGetNodes(g, nullptr, &n) == cudaSuccess ? static_cast<int64_t>(n) : -1;
}

Graph::~Graph() {
  // Never throws. A replay still queued is ordered before any later user of the
  // pool's blocks (one stream), so no wait.
  if (exec_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
  if (graph_) cudaGraphDestroy(static_cast<cudaGraph_t>(graph_));
  DeviceState* s = g_state[static_cast<size_t>(device_)];
  std::lock_guard lock(s->mutex);
  s->allocator.release_pool(pool_);
}

void Graph::replay() {
  DeviceState& s = state(device_);
  for (const std::function<void()>& f : hooks_.before) f();
  MT_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), s.stream));
  count_cuda_kernel_launch();  // one launch of the whole graph (launch_count.h)
  g_last_kernel_launched.store("a CUDA graph's replay (train.cuda_graph)", std::memory_order_relaxed);
  for (const std::function<void()>& f : hooks_.after) f();
}

int64_t Graph::pool_bytes() const {
  DeviceState& s = state(device_);
  std::lock_guard lock(s.mutex);
  return s.allocator.pool_bytes(pool_);
}

EventTimer::EventTimer(int device) : device_(device) {
  set_device(device);
  cudaEvent_t a = nullptr, b = nullptr;
  MT_CUDA_CHECK(cudaEventCreate(&a));
  MT_CUDA_CHECK(cudaEventCreate(&b));
  start_ = a;
  stop_ = b;
}

EventTimer::~EventTimer() {
  cudaEventDestroy(static_cast<cudaEvent_t>(start_));
  cudaEventDestroy(static_cast<cudaEvent_t>(stop_));
}

void EventTimer::start() {
  graph::refuse_if_capturing("a timer on the GPU");
  MT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_), stream(device_)));
}

double EventTimer::stop_ms() {
  auto stop = static_cast<cudaEvent_t>(stop_);
  MT_CUDA_CHECK(cudaEventRecord(stop, stream(device_)));
  MT_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  MT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_), stop));
  return ms;
}

namespace {

class EventClock final : public profile::DeviceClock {
 public:
  explicit EventClock(int device) : device_(device) {}

  int64_t mark() override {
    int64_t id;
    if (free_.empty()) {
      cudaEvent_t e = nullptr;
      MT_CUDA_CHECK(cudaEventCreate(&e));
      id = static_cast<int64_t>(events_.size());
      events_.push_back(e);
    } else {
      id = free_.back();
      free_.pop_back();
    }
    MT_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(id)], stream(device_)));
    return id;
  }

  std::vector<double> intervals(const std::vector<int64_t>& marks) override {
    std::vector<double> out;
    if (marks.empty()) return out;
    MT_CUDA_CHECK(cudaEventSynchronize(events_[static_cast<size_t>(marks.back())]));
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      float ms = 0;
      MT_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[static_cast<size_t>(marks[i])],
                                         events_[static_cast<size_t>(marks[i + 1])]));
      out.push_back(ms * 1e-3);
      free_.push_back(marks[i]);
    }
    return out;
  }

  void release(int64_t mark) override { free_.push_back(mark); }

 private:
  int device_;
  std::vector<cudaEvent_t> events_;
  std::vector<int64_t> free_;
};

}  // namespace

profile::DeviceClock* event_clock(int device) {
  set_device(device);
  // Never deleted, like the device state: no event is destroyed after the driver unloads.
  static std::array<EventClock*, kMaxDevices> clocks{};
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  EventClock*& c = clocks[static_cast<size_t>(device)];
  if (!c) c = new EventClock(device);
  return c;
}

void no_cuda(const char* what) { MT_THROW("{}: not available", what); }

}  // namespace moetrain::cuda
