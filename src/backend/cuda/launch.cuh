// cuda::launch: every kernel launch of the CUDA backend goes through here, so
// its limits are checked in one place (launch_check.h: grid and block dimensions,
// threads per block for the device and for the compiled kernel, shared memory
// with the opt-in above 48 KiB set once per kernel and device) and a launch error
// is reported once, naming the kernel (MT_CUDA_CHECK_LAUNCH, cudaGetLastError).
//   launch("softmax_forward_kernel", softmax_forward_kernel<T>, blocks, kThreads, 0, stream, args...);
// reads like kernel<<<blocks, kThreads, 0, stream>>>(args...); the arguments convert
// to the kernel's parameter types as in a direct launch.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "backend/cuda/check.h"
#include "backend/cuda/launch_check.h"

namespace moetrain::cuda {

// The current device's limits, queried once per device.
const DeviceLaunchLimits& device_launch_limits();
// The compiled kernel's limits on the current device, queried once per kernel and device.
KernelLaunchLimits kernel_launch_limits(const void* kernel);
// Sets cudaFuncAttributeMaxDynamicSharedMemorySize of `kernel` on the current
// device to at least `bytes`; the attribute call happens once per kernel, device and larger size.
void opt_in_shared_memory(const void* kernel, int64_t bytes);

// launch(...) with `what`: the advice that ends a limit's error ("use f32 or smaller heads").
template <class... KArgs>
void launch_advised(const char* name, const char* what, void (*kernel)(KArgs...), LaunchDims grid, LaunchDims block,
                    int64_t shared_bytes, cudaStream_t stream, std::type_identity_t<KArgs>... args) {
  const void* k = reinterpret_cast<const void*>(kernel);
  if (check_launch(name, grid, block, shared_bytes, device_launch_limits(), kernel_launch_limits(k), what ? what : ""))
    opt_in_shared_memory(k, shared_bytes);
  kernel<<<dim3(static_cast<unsigned>(grid.x), static_cast<unsigned>(grid.y), static_cast<unsigned>(grid.z)),
           dim3(static_cast<unsigned>(block.x), static_cast<unsigned>(block.y), static_cast<unsigned>(block.z)),
           static_cast<size_t>(shared_bytes), stream>>>(args...);
  g_last_kernel_launched.store(name, std::memory_order_relaxed);  // named by a later sticky error (runtime.cpp)
  MT_CUDA_CHECK_LAUNCH(name);
}

template <class... KArgs>
void launch(const char* name, void (*kernel)(KArgs...), LaunchDims grid, LaunchDims block, int64_t shared_bytes,
            cudaStream_t stream, std::type_identity_t<KArgs>... args) {
  launch_advised(name, nullptr, kernel, grid, block, shared_bytes, stream, args...);
}

}  // namespace moetrain::cuda
