// CUDA device runtime: device selection, one stream per device, the caching
// allocator behind tensor storage, copies and timing events. Built from
// runtime.cpp with the CUDA toolkit when MOETRAIN_CUDA is on; without it
// (runtime_disabled.cpp) device_count() is 0 and every call that needs a GPU
// throws a moetrain::Error that says how to get a CUDA build.
//
// Ordering: every kernel, copy and collective on a device runs on that device's
// stream (stream(device)), so work is ordered without events, and a block freed
// by the allocator can be handed out again at once (later users of the block
// queue behind earlier ones on the same stream). Copies to the host wait for the
// stream; copies from the host return once the source may be reused.
// No CUDA header here: the rest of the library includes this file.
#pragma once

#include <cstdint>
#include <string>

#include "backend/cuda/caching_allocator.h"
#include "core/dtype.h"
#include "core/memory.h"  // device_malloc, device_free, the copies, fill

struct CUstream_st;  // cudaStream_t is CUstream_st*
namespace moetrain::profile {
class DeviceClock;
}

namespace moetrain::cuda {

inline constexpr int kMaxDevices = 64;  // per process (per-device state is kept in arrays of this size)

bool built_with_cuda();
int device_count();  // 0 when no driver or no GPU
std::string device_name(int device);

// The GPU of a process with this local rank (rank among the processes of its
// node): local_rank % device_count(); makes it current and returns it. Throws
// when no GPU is visible.
int select_device(int local_rank);
// Makes `device` current for this thread (checked against device_count()).
void set_device(int device);
// The device's stream (created on first use, non-blocking with respect to the
// legacy default stream).
CUstream_st* stream(int device);
// Waits for everything queued on the device's stream.
void synchronize(int device);

// Tensor storage goes through the device's CachingAllocator: device_malloc and
// device_free (core/memory.h, the interface core allocates through).
MemoryStats memory_stats(int device);
// Returns the device's cached (free) blocks to the driver.
void empty_cache(int device);

// copy_host_to_device, copy_device_to_host, copy_device_to_device and fill are
// declared in core/memory.h (core's copy_ and fill_ call them).
// dst[0..nbytes) = 0 on the device's stream.
void memset_zero(void* dst, int64_t nbytes, int device);
// n elements converted from src_type to dst_type, as the CPU converts (memory.cu).
void convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, int device);
// dst[0..count) = values[0..count) (device memory), queued on the device's
// stream without waiting: the values travel as kernel arguments, copied at the
// launch, so the host array may change as soon as this returns (memory.cu).
// For small arrays, e.g. the operand pointers of a grouped GEMM.
void write_pointers(void* const* dst, const void* const* values, int64_t count, int device);

// Time of work on a device's stream, measured with CUDA events:
//   EventTimer t(0); t.start(); ...queue kernels...; double ms = t.stop_ms();
class EventTimer {
 public:
  explicit EventTimer(int device);
  ~EventTimer();
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;
  void start();
  // Records the end, waits for it and returns the milliseconds since start().
  double stop_ms();

 private:
  int device_;
  void* start_ = nullptr;  // cudaEvent_t
  void* stop_ = nullptr;
};

// The profiler's device clock (core/profile.h) for `device`: CUDA events recorded on
// its stream, kept in a pool and reused. One per device, alive to the end of the
// process; install it with profile::set_device_clock while profiling is off.
profile::DeviceClock* event_clock(int device);

// Thrown by the CUDA kernel entry points of a build without CUDA (never reached
// in practice: no tensor can live on a GPU there).
[[noreturn]] void no_cuda(const char* what);

}  // namespace moetrain::cuda

// The CUDA twin of a kernel, declared beside its CPU kernel in an op family's
// *_kernels.h:  namespace cuda { MT_CUDA_KERNEL(void foo_forward(Tensor& y, const Tensor& x)); }
// With CUDA the declaration is plain and *_cuda.cu defines it; without CUDA it
// is an inline definition that throws, so ops call
//   if (x.is_cuda()) cuda::foo_forward(y, x); else cpu::foo_forward(y, x);
// in every build.
#if MOETRAIN_WITH_CUDA
#define MT_CUDA_KERNEL(...) __VA_ARGS__
#else
#define MT_CUDA_KERNEL(...) \
  inline __VA_ARGS__ { ::moetrain::cuda::no_cuda(#__VA_ARGS__); }
#endif
