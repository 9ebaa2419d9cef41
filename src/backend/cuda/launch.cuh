// cuda::launch: every kernel launch of the CUDA backend goes through here, so
// it is counted (core/launch_count.h) and its limits are checked in one place
// (launch_check.h: grid and block dimensions, threads per block for the device
// and for the compiled kernel, shared memory with the opt-in above 48 KiB set
// once per kernel and device) and a launch error is reported once, naming the
// kernel (MT_CUDA_CHECK_LAUNCH, cudaGetLastError).
//   launch("softmax_forward_kernel", softmax_forward_kernel<T>, blocks, kThreads, 0, stream, args...);
// reads like kernel<<<blocks, kThreads, 0, stream>>>(args...); the arguments convert
// to the kernel's parameter types as in a direct launch.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "backend/cuda/launch_check.h"
#include "core/launch_count.h"

namespace moetrain::cuda {

// The checks before a launch of `kernel` on this thread's device (launch_check.h:
// check_launch against the device's and the kernel's limits), and the opt-in of
// dynamic shared memory above 48 KiB, set once per kernel, device and larger size.
// The path a launch takes once its kernel has run before on this thread: the bound
// device (a thread_local: launch_check.h, current_device), its limits and the kernel's
// from a per-thread cache keyed by the kernel's address; no CUDA call, lock or map
// lookup (docs/cuda.md, "The launch path and the launch counter").
void prepare_launch(const char* name, const char* what, const void* kernel, LaunchDims grid, LaunchDims block,
                    int64_t shared_bytes);

// An attribute of this thread's device, asked of CUDA once per device and attribute.
int device_attribute(cudaDeviceAttr attribute);

// launch(...) with `what`: the advice that ends a limit's error ("use f32 or smaller heads").
// Each launch counts itself (core/launch_count.h: cuda_kernels).
template <class... KArgs>
void launch_advised(const char* name, const char* what, void (*kernel)(KArgs...), LaunchDims grid, LaunchDims block,
                    int64_t shared_bytes, cudaStream_t stream, std::type_identity_t<KArgs>... args) {
  prepare_launch(name, what, reinterpret_cast<const void*>(kernel), grid, block, shared_bytes);
  kernel<<<dim3(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y), static_cast<unsigned>(grid.z)),
           dim3(static_cast<unsigned>(block.x), static_cast<unsigned>(block.y), static_cast<unsigned>(block.z)),
           static_cast<size_t>(shared_bytes), stream>>>(args...);
  count_cuda_kernel_launch();
  g_last_kernel_launched.store(name, std::memory_order_relaxed);  // named by a later sticky error (runtime.cpp)
  MT_CUDA_CHECK_LAUNCH(name);
}

template <class... KArgs>
void launch(const char* name, void (*kernel)(KArgs...), LaunchDims grid, LaunchDims block, int64_t shared_bytes,
            cudaStream_t stream, std::type_identity_t<KArgs>... args) {
  launch_advised(name, nullptr, kernel, grid, block, shared_bytes, stream, args...);
}

}  // namespace moetrain::cuda
