#pragma once

#include <vector>

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

void permute_copy(Tensor& out, const Tensor& x, const std::vector<int64_t>& dims);
// Copies x viewed as [outer, x_mid, inner] into out [outer, out_mid, inner] at
// middle offset `at` (concat, slice backward) or the reverse (slice).
void copy_into_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at);
void copy_from_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at);
// out[o, i, :] = x[o, index[i], :]   and   grad_x[o, index[i], :] += grad_out[o, i, :]
// (backward: index on the host, for both twins)
void index_select_forward(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer, int64_t inner);
void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                           int64_t inner);

}  // namespace cpu

// The CUDA twins (view_cuda.cu). index_select_backward takes the index on the
// host, as the CPU kernel does (the ops keep the host copy they checked): it
// buckets the positions by destination row there, uploads that plan once, and
// sums each named row's upstream rows in index order in f32 (f64 for f64),
// adding once per element (ops/view/view_simt.h): deterministic, no atomics.
// Given an index on the device (the embedding's device ids, unchecked) it makes
// the plan there (a stable radix sort, fixed shapes, no wait for the GPU): the
// same sums, the same bits; an index outside the rows adds nothing.
// index_select_forward_or_nan is the gather from such an unchecked device
// index: an index outside [0, mid) gives a NaN row and reads nothing.
namespace cuda {
MT_CUDA_KERNEL(void permute_copy(Tensor& out, const Tensor& x, const std::vector<int64_t>& dims));
MT_CUDA_KERNEL(void copy_into_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at));
MT_CUDA_KERNEL(void copy_from_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at));
MT_CUDA_KERNEL(void index_select_forward(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer,
                                         int64_t inner));
MT_CUDA_KERNEL(void index_select_forward_or_nan(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer,
                                                int64_t inner));
MT_CUDA_KERNEL(void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index,
                                          int64_t outer, int64_t inner));
}  // namespace cuda

}  // namespace moetrain
