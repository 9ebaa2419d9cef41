// CUDA kernels of the norm family (the twins of norm_cpu.cpp, same formulas).
// One block per row for the row statistics and grad_x; the weight and bias
// gradients (sums over rows) cut the rows into chunks, sum each chunk for 32
// columns per block in f64, and add the chunks in order: every result is
// deterministic. Arithmetic in acc_t<T> (f32 for f32 and bf16, f64 for f64);
// mean and rstd are stored in acc_t<T> too (the op gives bf16 data f32
// statistics).
#include <algorithm>
#include <type_traits>

#include "ops/common/cuda_helpers.cuh"
#include "ops/norm/norm_kernels.h"
#include "ops/norm/norm_simt.h"

namespace moetrain::cuda {

namespace {

constexpr unsigned kMaxRowBlocks = 1u << 20;  // rows beyond this loop inside the blocks
constexpr int kColTile = 32, kRowLanes = 8;   // parameter-gradient block: 32 columns x 8 row lanes
constexpr int64_t kChunkRows = 256;           // rows per parameter-gradient chunk (at most kMaxChunks chunks)
constexpr int64_t kMaxChunks = 1024;

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, kMaxRowBlocks)); }

template <class T>
__global__ void layer_norm_forward_kernel(T* y, acc_t<T>* mean, acc_t<T>* rstd, const T* x, const T* w, const T* b,
                                          int64_t rows, int64_t n, double eps) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    A s = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += load(xr, j);
    A mu = block_sum(s) / static_cast<A>(n);
    A v = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A d = load(xr, j) - mu;
      v += d * d;
    }
    A rs = A(1) / sqrt(block_sum(v) / static_cast<A>(n) + static_cast<A>(eps));
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    T* yr = y + r * n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A h = (load(xr, j) - mu) * rs;
      store(yr, j, h * (w ? load(w, j) : A(1)) + (b ? load(b, j) : A(0)));
    }
  }
}

template <class T>
__global__ void layer_norm_grad_x_kernel(T* dx, const T* dy, const T* x, const T* w, const acc_t<T>* mean,
                                         const acc_t<T>* rstd, int64_t rows, int64_t n) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    A mu = mean[r], rs = rstd[r], sg = 0, sgx = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A g = load(gr, j) * (w ? load(w, j) : A(1));
      sg += g;
      sgx += g * (load(xr, j) - mu) * rs;
    }
    A mg = block_sum(sg) / static_cast<A>(n);
    A mgx = block_sum(sgx) / static_cast<A>(n);
    T* dr = dx + r * n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A g = load(gr, j) * (w ? load(w, j) : A(1));
      store(dr, j, rs * (g - mg - (load(xr, j) - mu) * rs * mgx));
    }
  }
}

// Partial sums over the rows of chunk blockIdx.y: pw[c, j] = Σ_r dy[r, j] x̂(r, j),
// pb[c, j] = Σ_r dy[r, j], with x̂ = (x - mean) rstd (mean null: x̂ = x rstd),
// times σ(z[r, j]) where a gate z is given.
// Block (32, 8): thread (tx, ty) adds rows ty, ty + 8, ... of the chunk for column
// blockIdx.x * 32 + tx; the 8 row lanes are then added in order.
template <class T, class TZ>
__global__ void norm_param_partials_kernel(double* pw, double* pb, const T* dy, const T* x, const TZ* z,
                                           const acc_t<T>* mean, const acc_t<T>* rstd, int64_t rows, int64_t n,
                                           int64_t chunk_rows) {
  using A = acc_t<T>;
  __shared__ double part_w[kRowLanes][kColTile + 1], part_b[kRowLanes][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColTile + tx, c = blockIdx.y;
  const int64_t r0 = c * chunk_rows, r1 = min(rows, r0 + chunk_rows);
  double aw = 0, ab = 0;
  if (j < n)
    for (int64_t r = r0 + ty; r < r1; r += kRowLanes) {
      A g = load(dy, r * n + j);
      A xh = (load(x, r * n + j) - (mean ? mean[r] : A(0))) * rstd[r];
      if (z) xh *= sigmoid_a(load(z, r * n + j));
      aw += static_cast<double>(g * xh);
      ab += static_cast<double>(g);
    }
  part_w[ty][tx] = aw;
  part_b[ty][tx] = ab;
  __syncthreads();
  if (ty == 0 && j < n) {
    double sw = 0, sb = 0;
    for (int i = 0; i < kRowLanes; ++i) {
      sw += part_w[i][tx];
      sb += part_b[i][tx];
    }
    pw[c * n + j] = sw;
    pb[c * n + j] = sb;
  }
}

// dw[j] = Σ_c pw[c, j], db[j] = Σ_c pb[c, j], chunks in order.
template <class T>
__global__ void norm_param_finish_kernel(T* dw, T* db, const double* pw, const double* pb, int64_t n, int64_t chunks) {
  MT_GRID_LOOP(j, n) {
    double sw = 0, sb = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      sw += pw[c * n + j];
      sb += pb[c * n + j];
    }
    if (dw) store(dw, j, static_cast<acc_t<T>>(sw));
    if (db) store(db, j, static_cast<acc_t<T>>(sb));
  }
}

// The weight and bias gradients (either may be null), for every column (zeros
// when rows == 0): row chunks of kChunkRows (at most kMaxChunks of them) summed
// in parallel, then the chunks in order.
// TZ: the gate's storage type (T, or bf16 under f32: gated_rms_norm's fused cast).
template <class T, class TZ = T>
void norm_param_grads(T* dw, T* db, const T* dy, const T* x, const TZ* z, const acc_t<T>* mean,
                      const acc_t<T>* rstd, int64_t rows, int64_t n, Device device, cudaStream_t s) {
  int64_t chunk_rows = std::max(kChunkRows, (rows + kMaxChunks - 1) / kMaxChunks);
  int64_t chunks = std::max<int64_t>(1, (rows + chunk_rows - 1) / chunk_rows);
  Tensor partial = empty({2, chunks, n}, DType::f64, device);
  double* pw = ptr<double>(partial);
  double* pb = pw + chunks * n;
  const LaunchDims grid((n + kColTile - 1) / kColTile, chunks);
  launch("norm_param_partials_kernel", norm_param_partials_kernel<T, TZ>, grid, dim3(kColTile, kRowLanes), 0, s, pw, pb, dy,
         x, z, mean, rstd, rows, n, chunk_rows);
  launch("norm_param_finish_kernel", norm_param_finish_kernel<T>, blocks_for(n), kThreads, 0, s, dw, db, pw, pb, n,
         chunks);
}

template <class T, class TZ>
__global__ void scaled_norm_forward_kernel(T* y, acc_t<T>* rstd, const T* x, const T* w, const TZ* z, int64_t rows,
                                           int64_t n, double scale, double eps) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    A ss = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A v = load(xr, j);
      ss += v * v;
    }
    A rs = A(1) / sqrt(block_sum(ss) * static_cast<A>(scale) + static_cast<A>(eps));
    if (threadIdx.x == 0) rstd[r] = rs;
    T* yr = y + r * n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A h = load(xr, j) * rs * (w ? load(w, j) : A(1));
      store(yr, j, z ? h * sigmoid_a(load(z, r * n + j)) : h);
    }
  }
}

// dx = r (g - x r scale Σ_j g_j x_j r), g = dy σ(z) ⊙ w (σ(z) = 1 without a gate);
// dz = dy x r w σ(z)(1 - σ(z)) (see norm_cpu.cpp).
template <class T, class TZ>
__global__ void scaled_norm_grad_x_kernel(T* dx, TZ* dz, const T* dy, const T* x, const T* w, const TZ* z,
                                          const acc_t<T>* rstd, int64_t rows, int64_t n, double scale) {
  using A = acc_t<T>;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    const TZ* zr = z ? z + r * n : nullptr;
    A rs = rstd[r], dot = 0;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x)
      dot += load(gr, j) * (zr ? sigmoid_a(load(zr, j)) : A(1)) * (w ? load(w, j) : A(1)) * load(xr, j) * rs;
    dot = block_sum(dot);
    T* dr = dx + r * n;
    for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      A sg = zr ? sigmoid_a(load(zr, j)) : A(1), wj = w ? load(w, j) : A(1), g = load(gr, j) * sg * wj;
      store(dr, j, rs * (g - load(xr, j) * rs * static_cast<A>(scale) * dot));
      if (dz) store(dz, r * n + j, load(gr, j) * (load(xr, j) * rs * wj) * sg * (A(1) - sg));
    }
  }
}

// The fused residual add + norm: one block of kAddNormThreads (a power of two:
// the bodies' tree sums) per row, rows beyond the grid looping inside the blocks.
constexpr int kAddNormThreads = 128;

template <class T>
__global__ void add_norm_forward_kernel(simt::AddNormArgs<T> a) {
  __shared__ acc_t<T> sh[2 * kAddNormThreads];
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x)
    simt::add_norm_forward_row(simt::DeviceBlock{kAddNormThreads}, a, r, sh);
}

template <class T>
__global__ void add_norm_backward_kernel(simt::AddNormArgs<T> a) {
  __shared__ acc_t<T> sh[2 * kAddNormThreads];
  for (int64_t r = blockIdx.x; r < a.rows; r += gridDim.x)
    simt::add_norm_backward_row(simt::DeviceBlock{kAddNormThreads}, a, r, sh);
}

template <class T> const T* ptr_or_null(const Tensor& t) { return t.defined() ? ptr<T>(t) : nullptr; }
template <class T> T* ptr_or_null(Tensor* t) { return t ? ptr<T>(*t) : nullptr; }

// f(T{}, TZ{}): T x's type, TZ the gate's: T, or bf16 under f32 x (the gate's cast
// fused: gated_rms_norm, norm.cpp); no gate: T.
template <class F> void dispatch_gate_types(const Tensor& x, const Tensor& z, const char* op, F&& f) {
  dispatch_float_cuda(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, float>)
      if (z.defined() && z.dtype() == DType::bf16) return f(float{}, bf16_t{});
    return f(T{}, T{});
  });
}

struct RowsCols {
  int64_t rows, n;
};
RowsCols rows_cols(const Tensor& x) {
  int64_t n = x.size(-1);
  return {x.numel() / std::max<int64_t>(n, 1), n};
}

}  // namespace

void layer_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps) {
  auto [rows, n] = rows_cols(x);
  if (rows == 0 || n == 0) return;
  dispatch_float_cuda(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    launch("layer_norm_forward_kernel", layer_norm_forward_kernel<T>, row_blocks(rows), kThreads, 0, stream_of(x),
           ptr<T>(y), ptr<acc_t<T>>(mean), ptr<acc_t<T>>(rstd), ptr<T>(x), ptr_or_null<T>(w), ptr_or_null<T>(b), rows,
           n, eps);
  });
}

void layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_y, const Tensor& x,
                         const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  auto [rows, n] = rows_cols(x);
  if (n == 0) return;
  dispatch_float_cuda(x.dtype(), "layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t s = stream_of(x);
    if (rows > 0) {
      launch("layer_norm_grad_x_kernel", layer_norm_grad_x_kernel<T>, row_blocks(rows), kThreads, 0, s, ptr<T>(grad_x),
             ptr<T>(grad_y), ptr<T>(x), ptr_or_null<T>(w), ptr<acc_t<T>>(mean), ptr<acc_t<T>>(rstd), rows, n);
    }
    if (grad_w || grad_b)
      norm_param_grads<T>(ptr_or_null<T>(grad_w), ptr_or_null<T>(grad_b), ptr<T>(grad_y), ptr<T>(x),
                          static_cast<const T*>(nullptr), ptr<acc_t<T>>(mean), ptr<acc_t<T>>(rstd), rows, n,
                          x.device(), s);
  });
}

void scaled_norm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z, double scale,
                         double eps) {
  auto [rows, n] = rows_cols(x);
  if (rows == 0 || n == 0) return;
  dispatch_gate_types(x, z, "norm", [&](auto tag, auto z_tag) {
    using T = decltype(tag);
    using TZ = decltype(z_tag);
    launch("scaled_norm_forward_kernel", scaled_norm_forward_kernel<T, TZ>, row_blocks(rows), kThreads, 0,
           stream_of(x), ptr<T>(y), ptr<acc_t<T>>(rstd), ptr<T>(x), ptr_or_null<T>(w), ptr_or_null<TZ>(z), rows, n,
           scale, eps);
  });
}

void scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, const Tensor& rstd, double scale) {
  auto [rows, n] = rows_cols(x);
  if (n == 0) return;
  dispatch_gate_types(x, z, "norm_backward", [&](auto tag, auto z_tag) {
    using T = decltype(tag);
    using TZ = decltype(z_tag);
    cudaStream_t s = stream_of(x);
    if (rows > 0) {
      launch("scaled_norm_grad_x_kernel", scaled_norm_grad_x_kernel<T, TZ>, row_blocks(rows), kThreads, 0, s,
             ptr<T>(grad_x), ptr_or_null<TZ>(grad_z), ptr<T>(grad_y), ptr<T>(x), ptr_or_null<T>(w),
             ptr_or_null<TZ>(z), ptr<acc_t<T>>(rstd), rows, n, scale);
    }
    if (grad_w)
      norm_param_grads<T, TZ>(ptr<T>(*grad_w), static_cast<T*>(nullptr), ptr<T>(grad_y), ptr<T>(x),
                              ptr_or_null<TZ>(z), static_cast<const acc_t<T>*>(nullptr), ptr<acc_t<T>>(rstd), rows, n,
                              x.device(), s);
  });
}

namespace {
template <class T>
simt::AddNormArgs<T> add_norm_args(const Tensor& like, const Tensor& w, bool centre, double scale, double eps) {
  auto [rows, n] = rows_cols(like);
  simt::AddNormArgs<T> a;
  a.w = ptr_or_null<T>(w);
  a.rows = rows;
  a.n = n;
  a.centre = centre;
  a.scale = scale;
  a.eps = eps;
  return a;
}

template <class T>
void launch_add_norm_forward(const simt::AddNormArgs<T>& a, cudaStream_t s) {
  launch("add_norm_forward_kernel", add_norm_forward_kernel<T>, row_blocks(a.rows), kAddNormThreads, 0, s, a);
}
template <class T>
void launch_add_norm_backward(const simt::AddNormArgs<T>& a, cudaStream_t s) {
  launch("add_norm_backward_kernel", add_norm_backward_kernel<T>, row_blocks(a.rows), kAddNormThreads, 0, s, a);
}
}  // namespace

void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& d,
                            const Tensor& w, const Tensor& b, double eps) {
  auto [rows, n] = rows_cols(x);
  if (rows == 0 || n == 0) return;
  dispatch_float_cuda(x.dtype(), "add_layer_norm", [&](auto tag) {
    using T = decltype(tag);
    simt::AddNormArgs<T> a = add_norm_args<T>(x, w, true, 1.0, eps);
    a.x = ptr<T>(x);
    a.d = ptr<T>(d);
    a.b = ptr_or_null<T>(b);
    a.h = ptr<T>(h);
    a.y = ptr<T>(y);
    a.mean = ptr<acc_t<T>>(mean);
    a.rstd = ptr<acc_t<T>>(rstd);
    launch_add_norm_forward(a, stream_of(x));
  });
}

void add_layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_h,
                             const Tensor& grad_y, const Tensor& h, const Tensor& w, const Tensor& mean,
                             const Tensor& rstd) {
  auto [rows, n] = rows_cols(h);
  if (n == 0) return;
  dispatch_float_cuda(h.dtype(), "add_layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t s = stream_of(h);
    if (rows > 0) {
      simt::AddNormArgs<T> a = add_norm_args<T>(h, w, true, 1.0, 0.0);
      a.h = ptr<T>(h);
      a.mean = ptr<acc_t<T>>(mean);
      a.rstd = ptr<acc_t<T>>(rstd);
      a.grad_h = ptr<T>(grad_h);
      a.grad_y = ptr<T>(grad_y);
      a.grad_x = ptr<T>(grad_x);
      launch_add_norm_backward(a, s);
    }
    if (grad_w || grad_b)
      norm_param_grads<T>(ptr_or_null<T>(grad_w), ptr_or_null<T>(grad_b), ptr<T>(grad_y), ptr<T>(h),
                          static_cast<const T*>(nullptr), ptr<acc_t<T>>(mean), ptr<acc_t<T>>(rstd), rows, n,
                          h.device(), s);
  });
}

void add_scaled_norm_forward(Tensor& h, Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& d, const Tensor& w,
                             double scale, double eps) {
  auto [rows, n] = rows_cols(x);
  if (rows == 0 || n == 0) return;
  dispatch_float_cuda(x.dtype(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    simt::AddNormArgs<T> a = add_norm_args<T>(x, w, false, scale, eps);
    a.x = ptr<T>(x);
    a.d = ptr<T>(d);
    a.h = ptr<T>(h);
    a.y = ptr<T>(y);
    a.rstd = ptr<acc_t<T>>(rstd);
    launch_add_norm_forward(a, stream_of(x));
  });
}

void add_scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, const Tensor& grad_h, const Tensor& grad_y,
                              const Tensor& h, const Tensor& w, const Tensor& rstd, double scale) {
  auto [rows, n] = rows_cols(h);
  if (n == 0) return;
  dispatch_float_cuda(h.dtype(), "add_rms_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    cudaStream_t s = stream_of(h);
    if (rows > 0) {
      simt::AddNormArgs<T> a = add_norm_args<T>(h, w, false, scale, 0.0);
      a.h = ptr<T>(h);
      a.rstd = ptr<acc_t<T>>(rstd);
      a.grad_h = ptr<T>(grad_h);
      a.grad_y = ptr<T>(grad_y);
      a.grad_x = ptr<T>(grad_x);
      launch_add_norm_backward(a, s);
    }
    if (grad_w)
      norm_param_grads<T>(ptr<T>(*grad_w), static_cast<T*>(nullptr), ptr<T>(grad_y), ptr<T>(h),
                          static_cast<const T*>(nullptr), static_cast<const acc_t<T>*>(nullptr), ptr<acc_t<T>>(rstd),
                          rows, n, h.device(), s);
  });
}

}  // namespace moetrain::cuda
