// Argument checks shared by the ops. Each names the op and the tensors involved.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// t is a floating tensor of a compute dtype: f32 or f64, or bf16 on CUDA.
void check_float(const char* op, const char* arg, const Tensor& t);
// a and b have the same dtype and device.
void check_same_kind(const char* op, const Tensor& a, const Tensor& b);
// t has rank `rank` (rank < 0: at least -rank).
void check_rank(const char* op, const char* arg, const Tensor& t, int rank);
// The dtype of statistics an op saves for backward (mean, rstd, lse, weights):
// t's dtype, but f32 for bf16 t (rounding them to bf16 would cost backward ~3
// significant digits).
DType stats_dtype(const Tensor& t);
// Ops whose CUDA kernels are not in this build refuse CUDA tensors clearly.
void check_cpu(const char* op, const Tensor& t);

}  // namespace moetrain
