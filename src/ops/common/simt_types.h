// Storage types of the shared GPU/host kernel bodies (ops/common/simt.h): f32,
// f64 and bf16 (moetrain::bf16 on the host, __nv_bfloat16 on the GPU), each
// with its arithmetic type (bf16 computes in f32) and the conversions: acc_load
// widens, acc_store rounds to nearest even (bf16) the same way on both sides.
#pragma once

#include "core/dtype.h"
#include "ops/common/simt.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

namespace moetrain::simt {

template <class T> struct AccOf { using type = T; };
template <> struct AccOf<moetrain::bf16> { using type = float; };
MT_HOST_DEVICE inline float acc_load(float v) { return v; }
MT_HOST_DEVICE inline double acc_load(double v) { return v; }
MT_HOST_DEVICE inline void acc_store(float& dst, float v) { dst = v; }
MT_HOST_DEVICE inline void acc_store(double& dst, double v) { dst = v; }
inline float acc_load(moetrain::bf16 v) { return v.to_float(); }
inline void acc_store(moetrain::bf16& dst, float v) { dst = moetrain::bf16::from_float(v); }
#if defined(__CUDACC__)
template <> struct AccOf<__nv_bfloat16> { using type = float; };
__device__ inline float acc_load(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline void acc_store(__nv_bfloat16& dst, float v) { dst = __float2bfloat16_rn(v); }
#endif
template <class T> using acc_of_t = typename AccOf<T>::type;

}  // namespace moetrain::simt
