// CUDA kernels of the elementwise family (the CPU twins: elementwise_cpu.cpp,
// whose formulas these follow). bf16 computes in f32; sums (sum_to) accumulate
// in double like the CPU kernel.
#include "ops/elementwise/elementwise_kernels.h"
#include "ops/elementwise/sigmoid_gate_simt.h"

#include "backend/cuda/kernel_utils.cuh"

namespace moetrain::cuda {

namespace {

// A shape right-aligned into nd dims with the strides of up to two operands
// (0 where an operand broadcasts). Passed by value to the kernels.
struct Broadcast {
  int nd = 0;
  int64_t dims[Shape::kMaxDims] = {};
  int64_t sa[Shape::kMaxDims] = {};
  int64_t sb[Shape::kMaxDims] = {};
};

void strides_into(int64_t* st, const Shape& s, int nd) {
  int64_t stride = 1;
  for (int d = 0; d < nd; ++d) st[d] = 0;
  for (int i = s.ndim() - 1; i >= 0; --i) {
    st[nd - s.ndim() + i] = s[i] == 1 ? 0 : stride;
    stride *= s[i];
  }
}

Broadcast broadcast_of(const Shape& out, const Shape& a, const Shape& b) {
  Broadcast bc;
  bc.nd = out.ndim();
  for (int d = 0; d < bc.nd; ++d) bc.dims[d] = out[d];
  strides_into(bc.sa, a, bc.nd);
  strides_into(bc.sb, b, bc.nd);
  return bc;
}

__device__ __forceinline__ void offsets(const Broadcast& bc, int64_t i, int64_t* oa, int64_t* ob) {
  int64_t a = 0, b = 0;
  for (int d = bc.nd - 1; d >= 0; --d) {
    int64_t idx = i % bc.dims[d];
    i /= bc.dims[d];
    a += idx * bc.sa[d];
    b += idx * bc.sb[d];
  }
  *oa = a;
  *ob = b;
}

template <class T> __global__ void broadcast_copy_kernel(T* out, const T* x, int64_t n, Broadcast bc) {
  MT_GRID_LOOP(i, n) {
    int64_t ox, unused;
    offsets(bc, i, &ox, &unused);
    out[i] = x[ox];
  }
}

template <class A> __device__ __forceinline__ A apply(BinaryOp op, A x, A y) {
  switch (op) {
    case BinaryOp::add: return x + y;
    case BinaryOp::sub: return x - y;
    case BinaryOp::mul: return x * y;
    case BinaryOp::div: return x / y;
    case BinaryOp::max: return x > y || x != x ? x : y;  // NaN if either is
  }
  return x;
}

template <class T>
__global__ void binary_same_kernel(BinaryOp op, T* out, const T* a, const T* b, int64_t n) {
  MT_GRID_LOOP(i, n) store(out, i, apply(op, load(a, i), load(b, i)));
}

template <class T>
__global__ void binary_broadcast_kernel(BinaryOp op, T* out, const T* a, const T* b, int64_t n, Broadcast bc) {
  MT_GRID_LOOP(i, n) {
    int64_t oa, ob;
    offsets(bc, i, &oa, &ob);
    store(out, i, apply(op, load(a, oa), load(b, ob)));
  }
}

// The CPU kernel's formulas (math.h's tanh/sigmoid are the same functions up to rounding).
template <class A> __device__ __forceinline__ A sigmoid_d(A x) { return A(1) / (A(1) + exp(-x)); }
template <class A> __device__ __forceinline__ A softplus_d(A x) { return max(x, A(0)) + log1p(exp(-fabs(x))); }
template <class A> __device__ __forceinline__ A gelu_c() { return A(0.7978845608028654); }
template <class A> __device__ __forceinline__ A gelu_a() { return A(0.044715); }

template <class A> __device__ __forceinline__ A unary_value(UnaryOp op, A x) {
  switch (op) {
    case UnaryOp::neg: return -x;
    case UnaryOp::exp: return exp(x);
    case UnaryOp::log: return log(x);
    case UnaryOp::sqrt: return sqrt(x);
    case UnaryOp::square: return x * x;
    case UnaryOp::tanh: return tanh(x);
    case UnaryOp::sigmoid: return sigmoid_d(x);
    case UnaryOp::relu: return x > A(0) ? x : A(0);
    case UnaryOp::silu: return x * sigmoid_d(x);
    case UnaryOp::softplus: return softplus_d(x);
    case UnaryOp::gelu_tanh: {
      A u = gelu_c<A>() * (x + gelu_a<A>() * x * x * x);
      return A(0.5) * x * (A(1) + tanh(u));
    }
  }
  return x;
}

template <class A> __device__ __forceinline__ A unary_derivative(UnaryOp op, A x, A y) {
  switch (op) {
    case UnaryOp::neg: return A(-1);
    case UnaryOp::exp: return y;
    case UnaryOp::log: return A(1) / x;
    case UnaryOp::sqrt: return A(0.5) / y;
    case UnaryOp::square: return A(2) * x;
    case UnaryOp::tanh: return A(1) - y * y;
    case UnaryOp::sigmoid: return y * (A(1) - y);
    case UnaryOp::relu: return x > A(0) ? A(1) : A(0);
    case UnaryOp::silu: {
      A s = sigmoid_d(x);
      return s * (A(1) + x * (A(1) - s));
    }
    case UnaryOp::softplus: return sigmoid_d(x);
    case UnaryOp::gelu_tanh: {
      A u = gelu_c<A>() * (x + gelu_a<A>() * x * x * x);
      A t = tanh(u);
      return A(0.5) * (A(1) + t) + A(0.5) * x * (A(1) - t * t) * gelu_c<A>() * (A(1) + A(3) * gelu_a<A>() * x * x);
    }
  }
  return A(0);
}

template <class T> __global__ void unary_kernel(UnaryOp op, T* y, const T* x, int64_t n) {
  MT_GRID_LOOP(i, n) store(y, i, unary_value(op, load(x, i)));
}

template <class T>
__global__ void unary_backward_kernel(UnaryOp op, T* gx, const T* gy, const T* x, const T* y, int64_t n) {
  MT_GRID_LOOP(i, n) store(gx, i, load(gy, i) * unary_derivative(op, load(x, i), load(y, i)));
}

template <class T> __global__ void affine_kernel(T* y, const T* x, acc_t<T> s, acc_t<T> c, int64_t n) {
  MT_GRID_LOOP(i, n) store(y, i, load(x, i) * s + c);
}

template <class T> __global__ void pow_kernel(T* y, const T* x, acc_t<T> p, int64_t n) {
  MT_GRID_LOOP(i, n) store(y, i, pow(load(x, i), p));
}

template <class T> __global__ void add_inplace_kernel(T* d, const T* s, acc_t<T> alpha, int64_t n) {
  MT_GRID_LOOP(i, n) store(d, i, load(d, i) + alpha * load(s, i));
}

// sigmoid_gate: the arithmetic of sigmoid_gate_simt.h, in the compute type.
template <class T> __global__ void sigmoid_gate_kernel(T* y, const T* x, const T* z, int64_t n) {
  MT_GRID_LOOP(i, n) store(y, i, simt::sigmoid_gate_value(load(x, i), load(z, i)));
}

template <class T>
__global__ void sigmoid_gate_backward_kernel(T* gx, T* gz, const T* gy, const T* x, const T* z, int64_t n) {
  MT_GRID_LOOP(i, n) {
    acc_t<T> dx, dz;
    simt::sigmoid_gate_grads(load(gy, i), load(x, i), load(z, i), dx, dz);
    if (gx) store(gx, i, dx);
    if (gz) store(gz, i, dz);
  }
}

// sum_to: target element j sums t over the reduced dims. `kept`/`red` list dims
// of t with their extents and strides; j and r decompose over them.
struct Reduction {
  int n_kept = 0, n_red = 0;
  int64_t kept_dims[Shape::kMaxDims] = {}, kept_strides[Shape::kMaxDims] = {};
  int64_t red_dims[Shape::kMaxDims] = {}, red_strides[Shape::kMaxDims] = {};
  int64_t n_red_total = 1;
};

__device__ __forceinline__ int64_t decompose(int64_t i, int n, const int64_t* dims, const int64_t* strides) {
  int64_t off = 0;
  for (int k = n - 1; k >= 0; --k) {
    off += (i % dims[k]) * strides[k];
    i /= dims[k];
  }
  return off;
}

// Many targets: a thread per target (neighbouring threads read neighbouring columns).
template <class T> __global__ void sum_to_thread_kernel(T* out, const T* t, int64_t n_out, Reduction rd) {
  MT_GRID_LOOP(j, n_out) {
    int64_t base = decompose(j, rd.n_kept, rd.kept_dims, rd.kept_strides);
    double acc = 0;
    for (int64_t r = 0; r < rd.n_red_total; ++r)
      acc += static_cast<double>(load(t, base + decompose(r, rd.n_red, rd.red_dims, rd.red_strides)));
    store(out, j, static_cast<acc_t<T>>(acc));
  }
}

// Few targets: a block per target.
template <class T> __global__ void sum_to_block_kernel(T* out, const T* t, Reduction rd) {
  int64_t j = blockIdx.x;
  int64_t base = decompose(j, rd.n_kept, rd.kept_dims, rd.kept_strides);
  double acc = 0;
  for (int64_t r = threadIdx.x; r < rd.n_red_total; r += blockDim.x)
    acc += static_cast<double>(load(t, base + decompose(r, rd.n_red, rd.red_dims, rd.red_strides)));
  acc = block_sum(acc);
  if (threadIdx.x == 0) store(out, j, static_cast<acc_t<T>>(acc));
}

}  // namespace

void binary_forward(BinaryOp op, Tensor& out, const Tensor& a, const Tensor& b) {
  int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float_cuda(out.dtype(), "binary", [&](auto tag) {
    using T = decltype(tag);
    if (a.shape() == out.shape() && b.shape() == out.shape())
      launch("binary_same_kernel", binary_same_kernel<T>, blocks_for(n), kThreads, 0, stream_of(out), op, ptr<T>(out),
             ptr<T>(a), ptr<T>(b), n);
    else
      launch("binary_broadcast_kernel", binary_broadcast_kernel<T>, blocks_for(n), kThreads, 0, stream_of(out), op,
             ptr<T>(out), ptr<T>(a), ptr<T>(b), n, broadcast_of(out.shape(), a.shape(), b.shape()));
  });
}

void unary_forward(UnaryOp op, Tensor& y, const Tensor& x) {
  int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "unary", [&](auto tag) {
    using T = decltype(tag);
    launch("unary_kernel", unary_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x), op, ptr<T>(y), ptr<T>(x), n);
  });
}

void unary_backward(UnaryOp op, Tensor& grad_x, const Tensor& grad_y, const Tensor& x, const Tensor& y) {
  int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "unary_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("unary_backward_kernel", unary_backward_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x), op,
           ptr<T>(grad_x), ptr<T>(grad_y), ptr<T>(x), ptr<T>(y), n);
  });
}

void affine_forward(Tensor& y, const Tensor& x, double scale, double shift) {
  int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "affine", [&](auto tag) {
    using T = decltype(tag);
    using A = acc_t<T>;
    launch("affine_kernel", affine_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x), ptr<T>(y), ptr<T>(x),
           static_cast<A>(scale), static_cast<A>(shift), n);
  });
}

void pow_forward(Tensor& y, const Tensor& x, double p) {
  int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "pow", [&](auto tag) {
    using T = decltype(tag);
    launch("pow_kernel", pow_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x), ptr<T>(y), ptr<T>(x),
           static_cast<acc_t<T>>(p), n);
  });
}

void sum_to(Tensor& out, const Tensor& t) {
  int64_t n_out = out.numel();
  if (n_out == 0) return;
  const Shape& ts = t.shape();
  int nd = ts.ndim();
  int64_t so[Shape::kMaxDims];
  strides_into(so, out.shape(), nd);
  Reduction rd;
  int64_t stride = 1;
  int64_t st[Shape::kMaxDims];
  for (int d = nd - 1; d >= 0; --d) {
    st[d] = stride;
    stride *= ts[d];
  }
  for (int d = 0; d < nd; ++d) {
    if (so[d] == 0 && ts[d] != 1) {
      rd.red_dims[rd.n_red] = ts[d];
      rd.red_strides[rd.n_red++] = st[d];
      rd.n_red_total *= ts[d];
    } else {
      rd.kept_dims[rd.n_kept] = ts[d];
      rd.kept_strides[rd.n_kept++] = st[d];
    }
  }
  dispatch_float_cuda(t.dtype(), "sum_to", [&](auto tag) {
    using T = decltype(tag);
    if (n_out >= 4096 || rd.n_red_total < 256)
      launch("sum_to_thread_kernel", sum_to_thread_kernel<T>, blocks_for(n_out), kThreads, 0, stream_of(t), ptr<T>(out),
             ptr<T>(t), n_out, rd);
    else
      launch("sum_to_block_kernel", sum_to_block_kernel<T>, n_out, kThreads, 0, stream_of(t), ptr<T>(out), ptr<T>(t),
             rd);
  });
}

void broadcast_copy(Tensor& out, const Tensor& x) {
  int64_t n = out.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "broadcast_to", [&](auto tag) {
    using T = decltype(tag);
    launch("broadcast_copy_kernel", broadcast_copy_kernel<T>, blocks_for(n), kThreads, 0, stream_of(out), ptr<T>(out),
           ptr<T>(x), n, broadcast_of(out.shape(), x.shape(), x.shape()));
  });
}

void add_inplace(Tensor& dst, const Tensor& src, double alpha) {
  int64_t n = dst.numel();
  if (n == 0) return;
  dispatch_float_cuda(dst.dtype(), "add_", [&](auto tag) {
    using T = decltype(tag);
    launch("add_inplace_kernel", add_inplace_kernel<T>, blocks_for(n), kThreads, 0, stream_of(dst), ptr<T>(dst),
           ptr<T>(src), static_cast<acc_t<T>>(alpha), n);
  });
}

void sigmoid_gate_forward(Tensor& y, const Tensor& x, const Tensor& z) {
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "sigmoid_gate", [&](auto tag) {
    using T = decltype(tag);
    launch("sigmoid_gate_kernel", sigmoid_gate_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x), ptr<T>(y),
           ptr<T>(x), ptr<T>(z), n);
  });
}

void sigmoid_gate_backward(Tensor* grad_x, Tensor* grad_z, const Tensor& grad_y, const Tensor& x, const Tensor& z) {
  const int64_t n = x.numel();
  if (n == 0 || (!grad_x && !grad_z)) return;
  dispatch_float_cuda(x.dtype(), "sigmoid_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    launch("sigmoid_gate_backward_kernel", sigmoid_gate_backward_kernel<T>, blocks_for(n), kThreads, 0, stream_of(x),
           grad_x ? ptr<T>(*grad_x) : nullptr, grad_z ? ptr<T>(*grad_z) : nullptr, ptr<T>(grad_y), ptr<T>(x),
           ptr<T>(z), n);
  });
}

}  // namespace moetrain::cuda
