// Fill and dtype conversion on a device (what tensor.cpp and convert.cpp need
// for CUDA tensors). Conversions follow the CPU's: to bf16 rounds to nearest
// even through f32; floats to integers truncate (static_cast).
#include <algorithm>

#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

namespace {

template <class T> __device__ __forceinline__ double as_double(T v) { return static_cast<double>(v); }
template <> __device__ __forceinline__ double as_double<bf16_t>(bf16_t v) { return __bfloat162float(v); }
template <class T> __device__ __forceinline__ T from_double_d(double v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ bf16_t from_double_d<bf16_t>(double v) {
  return __float2bfloat16_rn(static_cast<float>(v));
}

template <class T> __global__ void fill_kernel(T* p, T v, int64_t n) { MT_GRID_LOOP(i, n) p[i] = v; }

// Up to kPointerBatch pointers per launch, by value in the kernel's arguments (1 KiB).
constexpr int kPointerBatch = 128;
struct PointerBatch {
  const void* values[kPointerBatch];
  int count;
};
__global__ void write_pointers_kernel(const void** dst, PointerBatch batch) {
  if (static_cast<int>(threadIdx.x) < batch.count) dst[threadIdx.x] = batch.values[threadIdx.x];
}

template <class In, class Out> __global__ void convert_kernel(Out* dst, const In* src, int64_t n) {
  MT_GRID_LOOP(i, n) dst[i] = from_double_d<Out>(as_double(src[i]));
}

// Every dtype, with bf16 as the device type.
template <class F> void dispatch_all_cuda(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16_t{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u16: return f(uint16_t{});
  }
  MT_THROW("unknown dtype {}", static_cast<int>(t));
}

}  // namespace

void fill(void* dst, DType dtype, int64_t n, double value, int device) {
  if (n == 0) return;
  if (value == 0.0) return memset_zero(dst, n * dtype_size(dtype), device);
  dispatch_all_cuda(dtype, [&](auto tag) {
    using T = decltype(tag);
    T v;
    if constexpr (std::is_same_v<T, bf16_t>) v = __float2bfloat16_rn(static_cast<float>(value));
    else v = static_cast<T>(value);
    launch("fill_kernel", fill_kernel<T>, blocks_for(n), kThreads, 0, stream(device), static_cast<T*>(dst), v, n);
  });
}

void convert(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, int device) {
  if (n == 0) return;
  dispatch_all_cuda(src_type, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_all_cuda(dst_type, [&](auto out_tag) {
      using Out = decltype(out_tag);
      launch("convert_kernel", convert_kernel<In, Out>, blocks_for(n), kThreads, 0, stream(device),
             static_cast<Out*>(dst), static_cast<const In*>(src), n);
    });
  });
}

void write_pointers(void* const* dst, const void* const* values, int64_t count, int device) {
  cudaStream_t s = stream(device);
  for (int64_t first = 0; first < count; first += kPointerBatch) {
    PointerBatch batch{};
    batch.count = static_cast<int>(std::min<int64_t>(kPointerBatch, count - first));
    for (int i = 0; i < batch.count; ++i) batch.values[i] = values[first + i];
    launch("write_pointers_kernel", write_pointers_kernel, 1, kPointerBatch, 0, s,
           const_cast<const void**>(dst) + first, batch);
  }
}

}  // namespace moetrain::cuda
