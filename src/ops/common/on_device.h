// The kernel of an op on the device of its tensors: an op calls
//
//   MT_ON_DEVICE(x, rms_norm_forward, y, rstd, x, w, eps);
//
// for `if (x.is_cuda()) cuda::rms_norm_forward(y, ...); else cpu::rms_norm_forward(y, ...);`,
// the CPU and CUDA kernels being declared alike in the family's <op>_kernels.h
// (cuda:: ones fail clearly in a build without CUDA: backend/cuda/runtime.h).
// Its value is the kernel's (both return the same type). On the CPU the call goes
// through cpu::run_kernel (ops/common/bf16_widen.h): bf16 tensors are widened to f32
// for the kernels without a bf16 path of their own, and their outputs rounded back.
// The CPU call is counted as one kernel launch (core/launch_count.h: cpu_kernels), the
// op's CUDA kernel counting itself in cuda::launch.
#pragma once

#include "core/launch_count.h"
#include "ops/common/bf16_widen.h"

#define MT_ON_DEVICE(t, kernel, ...)                                                \
  ((t).is_cuda() ? ::moetrain::cuda::kernel(__VA_ARGS__)                            \
                 : (::moetrain::count_cpu_kernel_call(),                            \
                    ::moetrain::cpu::run_kernel(#kernel, &::moetrain::cpu::kernel, __VA_ARGS__)))
