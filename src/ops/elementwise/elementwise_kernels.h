// Kernels of the elementwise family (declared here, defined in
// elementwise_cpu.cpp). Arguments are checked by the ops in elementwise.cpp.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

enum class BinaryOp { add, sub, mul, div, max };  // max: NaN if either is NaN
enum class UnaryOp { neg, exp, log, sqrt, square, tanh, sigmoid, relu, silu, softplus, gelu_tanh };

namespace cpu {
// out = a (op) b with broadcasting; out has the broadcast shape.
void binary_forward(BinaryOp op, Tensor& out, const Tensor& a, const Tensor& b);
void unary_forward(UnaryOp op, Tensor& y, const Tensor& x);
// grad_x = grad_y * f'(x) (y = f(x) is passed for ops whose derivative uses it).
void unary_backward(UnaryOp op, Tensor& grad_x, const Tensor& grad_y, const Tensor& x, const Tensor& y);
// y = x * scale + shift, or y = x^p.
void affine_forward(Tensor& y, const Tensor& x, double scale, double shift);
void pow_forward(Tensor& y, const Tensor& x, double p);
void sum_to(Tensor& out, const Tensor& t);
void broadcast_copy(Tensor& out, const Tensor& x);
void add_inplace(Tensor& dst, const Tensor& src, double alpha);
// sigmoid_gate (sigmoid_gate.h): y = x σ(z), x, z, y of one shape (overwrites y).
void sigmoid_gate_forward(Tensor& y, const Tensor& x, const Tensor& z);
// grad_x = grad_y σ(z), grad_z = grad_y x σ(z) (1 - σ(z)); either may be null (overwrites).
void sigmoid_gate_backward(Tensor* grad_x, Tensor* grad_z, const Tensor& grad_y, const Tensor& x, const Tensor& z);
}  // namespace cpu

// The CUDA twins (elementwise_cuda.cu): same contracts; f32, f64 and bf16.
namespace cuda {
MT_CUDA_KERNEL(void binary_forward(BinaryOp op, Tensor& out, const Tensor& a, const Tensor& b));
MT_CUDA_KERNEL(void unary_forward(UnaryOp op, Tensor& y, const Tensor& x));
MT_CUDA_KERNEL(void unary_backward(UnaryOp op, Tensor& grad_x, const Tensor& grad_y, const Tensor& x,
                                   const Tensor& y));
MT_CUDA_KERNEL(void affine_forward(Tensor& y, const Tensor& x, double scale, double shift));
MT_CUDA_KERNEL(void pow_forward(Tensor& y, const Tensor& x, double p));
MT_CUDA_KERNEL(void sum_to(Tensor& out, const Tensor& t));
MT_CUDA_KERNEL(void broadcast_copy(Tensor& out, const Tensor& x));
MT_CUDA_KERNEL(void add_inplace(Tensor& dst, const Tensor& src, double alpha));
MT_CUDA_KERNEL(void sigmoid_gate_forward(Tensor& y, const Tensor& x, const Tensor& z));
MT_CUDA_KERNEL(void sigmoid_gate_backward(Tensor* grad_x, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                                          const Tensor& z));
}  // namespace cuda

}  // namespace moetrain
