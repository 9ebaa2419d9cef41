// CPU kernels of the elementwise family. Each output element is computed by one
// thread in a fixed order, so results do not depend on the thread count, except
// sum_to, whose per-target sums also run in a fixed order (bitwise reproducible).
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "core/dispatch.h"
#include "ops/common/bf16_rows.h"
#include "ops/elementwise/elementwise_kernels.h"
#include "ops/common/gelu.h"
#include "ops/common/math.h"

namespace moetrain::cpu {

namespace {

constexpr int64_t kGrain = 1 << 14;

// Strides of `s` (right-aligned into nd dims) with 0 where s broadcasts.
std::vector<int64_t> broadcast_strides(const Shape& s, int nd) {
  std::vector<int64_t> st(static_cast<size_t>(nd), 0);
  int64_t stride = 1;
  for (int i = s.ndim() - 1; i >= 0; --i) {
    int o = nd - s.ndim() + i;
    st[static_cast<size_t>(o)] = s[i] == 1 ? 0 : stride;
    stride *= s[i];
  }
  return st;
}

// o[i] = f(a[i], b[i]) over [lo, hi): contiguous operands, run in the
// cpu::vector_isa() copy (run_vector_isa), so the loop vectorises 8 or 16 wide.
template <class T, class F>
inline void binary_range(F f, T* __restrict o, const T* __restrict a, const T* __restrict b, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) o[i] = f(a[i], b[i]);
}

template <class T, class F>
void binary_loop(F f, T* out, const Shape& os, const T* a, const Shape& as, const T* b, const Shape& bs) {
  int64_t n = os.numel();
  if (n == 0) return;
  if (as == os && bs == os) {
    parallel_for(n, kGrain, [&](int64_t lo, int64_t hi) {
      run_vector_isa([](auto... x) { binary_range<T>(x...); }, f, out, a, b, lo, hi);
    });
    return;
  }
  int nd = os.ndim();
  auto sa = broadcast_strides(as, nd), sb = broadcast_strides(bs, nd);
  int64_t inner = nd > 0 ? os[nd - 1] : 1;
  int64_t rows = n / inner;
  int64_t ia = nd > 0 ? sa[static_cast<size_t>(nd - 1)] : 0, ib = nd > 0 ? sb[static_cast<size_t>(nd - 1)] : 0;
  parallel_for(rows, std::max<int64_t>(1, kGrain / inner), [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      int64_t oa = 0, ob = 0, rem = r;
      for (int d = nd - 2; d >= 0; --d) {
        int64_t idx = rem % os[d];
        rem /= os[d];
        oa += idx * sa[static_cast<size_t>(d)];
        ob += idx * sb[static_cast<size_t>(d)];
      }
      T* o = out + r * inner;
      const T* pa = a + oa;
      const T* pb = b + ob;
      if (ia == 1 && ib == 1)  // both rows contiguous (a bias row added to each row of x)
        run_vector_isa([](auto... x) { binary_range<T>(x...); }, f, o, pa, pb, int64_t{0}, inner);
      else
        for (int64_t j = 0; j < inner; ++j) o[j] = f(pa[j * ia], pb[j * ib]);
    }
  });
}

template <class T>
T softplus_of(T x) {  // log(1 + e^x) = max(x, 0) + log1p(e^-|x|)
  return std::max(x, T(0)) + std::log1p(std::exp(-std::abs(x)));
}

template <class T>
inline T unary_value(UnaryOp op, T x) {
  switch (op) {
    case UnaryOp::neg: return -x;
    case UnaryOp::exp: return std::exp(x);
    case UnaryOp::log: return std::log(x);
    case UnaryOp::sqrt: return std::sqrt(x);
    case UnaryOp::square: return x * x;
    case UnaryOp::tanh: return tanh_of(x);
    case UnaryOp::sigmoid: return sigmoid_of(x);
    case UnaryOp::relu: return x > T(0) ? x : T(0);
    case UnaryOp::silu: return x * sigmoid_of(x);
    case UnaryOp::softplus: return softplus_of(x);
    case UnaryOp::gelu_tanh: return gelu_tanh_of(x);
  }
  return x;
}

// d f(x) / dx, given x and y = f(x).
template <class T>
inline T unary_derivative(UnaryOp op, T x, T y) {
  switch (op) {
    case UnaryOp::neg: return T(-1);
    case UnaryOp::exp: return y;
    case UnaryOp::log: return T(1) / x;
    case UnaryOp::sqrt: return T(0.5) / y;
    case UnaryOp::square: return T(2) * x;
    case UnaryOp::tanh: return T(1) - y * y;
    case UnaryOp::sigmoid: return y * (T(1) - y);
    case UnaryOp::relu: return x > T(0) ? T(1) : T(0);
    case UnaryOp::silu: {  // s (1 + x (1 - s))
      T s = sigmoid_of(x);
      return s * (T(1) + x * (T(1) - s));
    }
    case UnaryOp::softplus: return sigmoid_of(x);
    case UnaryOp::gelu_tanh: return gelu_tanh_derivative_of(x);
  }
  return T(0);
}

}  // namespace

void binary_forward(BinaryOp op, Tensor& out, const Tensor& a, const Tensor& b) {
  if (out.dtype() == DType::bf16) {
    // bf16 operands and result: each element as the f32 op on the widened operands,
    // rounded once (the bits of cpu::run_kernel's widening, without f32 copies).
    MT_CHECK(a.dtype() == DType::bf16 && b.dtype() == DType::bf16, "binary: out is bf16 but a is {} and b {}",
             a.dtype(), b.dtype());
    bf16* o = out.data<bf16>();
    const bf16* pa = a.data<bf16>();
    const bf16* pb = b.data<bf16>();
    auto run = [&](auto f) {
      auto narrow = [f](bf16 x, bf16 y) { return bf16::from_float(f(x.to_float(), y.to_float())); };
      binary_loop(narrow, o, out.shape(), pa, a.shape(), pb, b.shape());
    };
    switch (op) {
      case BinaryOp::add: return run([](float x, float y) { return x + y; });
      case BinaryOp::sub: return run([](float x, float y) { return x - y; });
      case BinaryOp::mul: return run([](float x, float y) { return x * y; });
      case BinaryOp::div: return run([](float x, float y) { return x / y; });
      case BinaryOp::max: return run([](float x, float y) { return x > y || x != x ? x : y; });
    }
    return;
  }
  dispatch_float(out.dtype(), "binary", [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data<T>();
    const T* pa = a.data<T>();
    const T* pb = b.data<T>();
    switch (op) {
      case BinaryOp::add: return binary_loop([](T x, T y) { return x + y; }, o, out.shape(), pa, a.shape(), pb, b.shape());
      case BinaryOp::sub: return binary_loop([](T x, T y) { return x - y; }, o, out.shape(), pa, a.shape(), pb, b.shape());
      case BinaryOp::mul: return binary_loop([](T x, T y) { return x * y; }, o, out.shape(), pa, a.shape(), pb, b.shape());
      case BinaryOp::div: return binary_loop([](T x, T y) { return x / y; }, o, out.shape(), pa, a.shape(), pb, b.shape());
      case BinaryOp::max:
        return binary_loop([](T x, T y) { return x > y || x != x ? x : y; }, o, out.shape(), pa, a.shape(), pb,
                           b.shape());
    }
  });
}

namespace {
// Calls fn(std::integral_constant<UnaryOp, op>) so the loops below are compiled
// once per op, with the formula inlined (no switch per element).
template <class F>
void with_op(UnaryOp op, F&& fn) {
  switch (op) {
    case UnaryOp::neg: return fn(std::integral_constant<UnaryOp, UnaryOp::neg>{});
    case UnaryOp::exp: return fn(std::integral_constant<UnaryOp, UnaryOp::exp>{});
    case UnaryOp::log: return fn(std::integral_constant<UnaryOp, UnaryOp::log>{});
    case UnaryOp::sqrt: return fn(std::integral_constant<UnaryOp, UnaryOp::sqrt>{});
    case UnaryOp::square: return fn(std::integral_constant<UnaryOp, UnaryOp::square>{});
    case UnaryOp::tanh: return fn(std::integral_constant<UnaryOp, UnaryOp::tanh>{});
    case UnaryOp::sigmoid: return fn(std::integral_constant<UnaryOp, UnaryOp::sigmoid>{});
    case UnaryOp::relu: return fn(std::integral_constant<UnaryOp, UnaryOp::relu>{});
    case UnaryOp::silu: return fn(std::integral_constant<UnaryOp, UnaryOp::silu>{});
    case UnaryOp::softplus: return fn(std::integral_constant<UnaryOp, UnaryOp::softplus>{});
    case UnaryOp::gelu_tanh: return fn(std::integral_constant<UnaryOp, UnaryOp::gelu_tanh>{});
  }
}
}  // namespace

namespace {
// One op over [lo, hi), run in the copy for cpu::vector_isa() (AVX-512, AVX2 + FMA or
// generic; run_vector_isa), so exp_approx and tanh_of run 16 or 8 wide.
template <class T, UnaryOp kOp>
inline void unary_range(const T* __restrict x, T* __restrict y, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) y[i] = unary_value(kOp, x[i]);
}

template <class T, UnaryOp kOp>
inline void unary_backward_range(const T* __restrict x, const T* __restrict y, const T* __restrict gy,
                                 T* __restrict gx, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) gx[i] = gy[i] * unary_derivative(kOp, x[i], y[i]);
}
}  // namespace

void unary_forward(UnaryOp op, Tensor& y, const Tensor& x) {
  dispatch_float(x.dtype(), "unary", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    with_op(op, [&](auto op_c) {
      parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
        run_vector_isa([](auto... a) { unary_range<T, decltype(op_c)::value>(a...); }, px, py, lo, hi);
      });
    });
  });
}

void unary_backward(UnaryOp op, Tensor& grad_x, const Tensor& grad_y, const Tensor& x, const Tensor& y) {
  dispatch_float(x.dtype(), "unary_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* py = y.data<T>();
    const T* gy = grad_y.data<T>();
    T* gx = grad_x.data<T>();
    with_op(op, [&](auto op_c) {
      parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
        run_vector_isa([](auto... a) { unary_backward_range<T, decltype(op_c)::value>(a...); }, px, py, gy, gx, lo,
                       hi);
      });
    });
  });
}

void affine_forward(Tensor& y, const Tensor& x, double scale, double shift) {
  dispatch_float(x.dtype(), "affine", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    T s = static_cast<T>(scale), c = static_cast<T>(shift);
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) py[i] = px[i] * s + c;
    });
  });
}

void pow_forward(Tensor& y, const Tensor& x, double p) {
  dispatch_float(x.dtype(), "pow", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* py = y.data<T>();
    T e = static_cast<T>(p);
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) py[i] = std::pow(px[i], e);
    });
  });
}

namespace {
// dst[j] = Σ_r src[r, j] over rows in order, in double, for j in [lo, hi). bf16 values
// are read widened and each sum rounded once (store_rounded: through f32, as the
// widening route's f32 kernel and its rounding).
template <class T>
inline void sum_rows(T* __restrict dst, const T* __restrict src, int64_t rows, int64_t n, int64_t lo, int64_t hi) {
  constexpr int64_t kBlock = 256;
  double acc[kBlock];
  for (int64_t j0 = lo; j0 < hi; j0 += kBlock) {
    const int64_t w = std::min(kBlock, hi - j0);
    for (int64_t j = 0; j < w; ++j) acc[j] = 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = src + r * n + j0;
      for (int64_t j = 0; j < w; ++j) acc[j] += static_cast<double>(widened_value(row[j]));
    }
    for (int64_t j = 0; j < w; ++j) store_rounded(dst[j0 + j], acc[j]);
  }
}
}  // namespace

// out[j] = sum over the broadcast dims of t. Each thread owns a range of target
// elements and adds the source rows in a fixed order (accumulating in double). bf16
// (its own path: the bias gradients and broadcast sums of a bf16 model) reads each
// value widened and rounds each sum once, the bits of the widening route.
void sum_to(Tensor& out, const Tensor& t) {
  MT_CHECK(out.dtype() == t.dtype(), "sum_to: out {} and t {} differ in dtype", describe(out), describe(t));
  dispatch_float_or_bf16(t.dtype(), "sum_to", [&](auto tag) {
    using T = decltype(tag);
    const Shape& ts = t.shape();
    int nd = ts.ndim();
    auto so = broadcast_strides(out.shape(), nd);  // stride in out, 0 on reduced dims
    // Strides of t.
    std::vector<int64_t> st(static_cast<size_t>(nd));
    int64_t stride = 1;
    for (int d = nd - 1; d >= 0; --d) {
      st[static_cast<size_t>(d)] = stride;
      stride *= ts[d];
    }
    // Offsets in t of every target element (kept dims) and of every reduced combination.
    std::vector<int64_t> kept_dims, red_dims;
    for (int d = 0; d < nd; ++d) (so[static_cast<size_t>(d)] == 0 && ts[d] != 1 ? red_dims : kept_dims).push_back(d);
    auto offsets = [&](const std::vector<int64_t>& dims) {
      int64_t count = 1;
      for (int64_t d : dims) count *= ts[static_cast<int>(d)];
      std::vector<int64_t> off(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) {
        int64_t rem = i, o = 0;
        for (int k = static_cast<int>(dims.size()) - 1; k >= 0; --k) {
          int d = static_cast<int>(dims[static_cast<size_t>(k)]);
          o += (rem % ts[d]) * st[static_cast<size_t>(d)];
          rem /= ts[d];
        }
        off[static_cast<size_t>(i)] = o;
      }
      return off;
    };
    const T* src = t.data<T>();
    T* dst = out.data<T>();
    // out is t's trailing dims (a bias gradient: [B, T, N] to [N]): t viewed as
    // [rows, n] summed over rows in order, the order of the general loop below (the
    // same bits), with the columns in vectors.
    const Shape& os = out.shape();
    int first = 0;
    while (first < os.ndim() && os[first] == 1) ++first;
    bool trailing = os.ndim() - first <= nd;
    for (int i = first; trailing && i < os.ndim(); ++i) trailing = os[i] == ts[nd - (os.ndim() - i)];
    if (trailing && out.numel() > 0) {
      const int64_t n = out.numel(), rows = t.numel() / n;
      parallel_for(n, 256, [&](int64_t lo, int64_t hi) {
        run_vector_isa([](auto... a) { sum_rows<T>(a...); }, dst, src, rows, n, lo, hi);
      });
      return;
    }
    std::vector<int64_t> base = offsets(kept_dims), red = offsets(red_dims);
    int64_t n = static_cast<int64_t>(base.size());
    parallel_for(n, 256, [&](int64_t lo, int64_t hi) {
      std::vector<double> acc(static_cast<size_t>(hi - lo), 0.0);
      for (int64_t r : red)
        for (int64_t j = lo; j < hi; ++j)
          acc[static_cast<size_t>(j - lo)] += widened_value(src[base[static_cast<size_t>(j)] + r]);
      for (int64_t j = lo; j < hi; ++j) store_rounded(dst[j], acc[static_cast<size_t>(j - lo)]);
    });
  });
}

void broadcast_copy(Tensor& out, const Tensor& x) {
  if (x.dtype() == DType::bf16) {  // a copy: bf16 values as they are (bf16_widen.h lists it as native)
    binary_loop([](bf16 l, bf16) { return l; }, out.data<bf16>(), out.shape(), x.data<bf16>(), x.shape(),
                x.data<bf16>(), x.shape());
    return;
  }
  dispatch_float(x.dtype(), "broadcast_to", [&](auto tag) {
    using T = decltype(tag);
    // x op x with x broadcast on both sides: returns the left operand.
    binary_loop([](T l, T) { return l; }, out.data<T>(), out.shape(), x.data<T>(), x.shape(), x.data<T>(), x.shape());
  });
}

namespace {
// d[i] += a s[i] (d may be s: no restrict; the vectoriser checks the overlap).
template <class T>
inline void add_range(T* d, const T* s, T a, int64_t lo, int64_t hi) {
  if (a == T(1))
    for (int64_t i = lo; i < hi; ++i) d[i] += s[i];
  else
    for (int64_t i = lo; i < hi; ++i) d[i] += a * s[i];
}
}  // namespace

void add_inplace(Tensor& dst, const Tensor& src, double alpha) {
  dispatch_float(dst.dtype(), "add_", [&](auto tag) {
    using T = decltype(tag);
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    T a = static_cast<T>(alpha);
    parallel_for(dst.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      run_vector_isa([](auto... x) { add_range<T>(x...); }, d, s, a, lo, hi);
    });
  });
}

// The same products as the unfused sigmoid then mul (sigmoid_of as the CPU sigmoid).
// sigmoid_gate on bf16 x, z (MLA's output gate in a bf16 model): blocks of kGateBlock
// elements widened into per-thread f32 buffers (ops/common/bf16_rows.h), each element
// as the f32 kernel computes it, each bf16 output rounded once (the bits of
// cpu::run_kernel's widening, without f32 copies of the [B·T, H v] tensors).
constexpr int64_t kGateBlock = 1024;

void sigmoid_gate_forward(Tensor& y, const Tensor& x, const Tensor& z) {
  if (x.dtype() == DType::bf16) {
    MT_CHECK(z.dtype() == DType::bf16 && y.dtype() == DType::bf16, "sigmoid_gate: bf16 x {} with z {}, y {}",
             describe(x), describe(z), describe(y));
    const bf16* px = x.data<bf16>();
    const bf16* pz = z.data<bf16>();
    bf16* py = y.data<bf16>();
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      float xb[kGateBlock], zb[kGateBlock], yb[kGateBlock];  // a block widened, so the f32 loop vectorises
      for (int64_t b = lo; b < hi; b += kGateBlock) {
        const int64_t n = std::min(kGateBlock, hi - b);
        widen_bf16_row(xb, px + b, n);
        widen_bf16_row(zb, pz + b, n);
        for (int64_t i = 0; i < n; ++i) yb[i] = xb[i] * sigmoid_of(zb[i]);
        round_bf16_row(py + b, yb, n);
      }
    });
    return;
  }
  dispatch_float(x.dtype(), "sigmoid_gate", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pz = z.data<T>();
    T* py = y.data<T>();
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) py[i] = px[i] * sigmoid_of(pz[i]);
    });
  });
}

void sigmoid_gate_backward(Tensor* grad_x, Tensor* grad_z, const Tensor& grad_y, const Tensor& x, const Tensor& z) {
  if (x.dtype() == DType::bf16) {
    MT_CHECK(z.dtype() == DType::bf16 && grad_y.dtype() == DType::bf16 &&
                 (!grad_x || grad_x->dtype() == DType::bf16) && (!grad_z || grad_z->dtype() == DType::bf16),
             "sigmoid_gate_backward: bf16 x {} with z {}, grad_y {}", describe(x), describe(z), describe(grad_y));
    const bf16* px = x.data<bf16>();
    const bf16* pz = z.data<bf16>();
    const bf16* gy = grad_y.data<bf16>();
    bf16* gx = grad_x ? grad_x->data<bf16>() : nullptr;
    bf16* gz = grad_z ? grad_z->data<bf16>() : nullptr;
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      float xb[kGateBlock], zb[kGateBlock], gb[kGateBlock], dxb[kGateBlock], dzb[kGateBlock];
      for (int64_t b = lo; b < hi; b += kGateBlock) {
        const int64_t n = std::min(kGateBlock, hi - b);
        widen_bf16_row(xb, px + b, n);
        widen_bf16_row(zb, pz + b, n);
        widen_bf16_row(gb, gy + b, n);
        for (int64_t i = 0; i < n; ++i) {
          const float s = sigmoid_of(zb[i]);
          dxb[i] = gb[i] * s;
          dzb[i] = (gb[i] * xb[i]) * (s * (1.0f - s));
        }
        if (gx) round_bf16_row(gx + b, dxb, n);
        if (gz) round_bf16_row(gz + b, dzb, n);
      }
    });
    return;
  }
  dispatch_float(x.dtype(), "sigmoid_gate_backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pz = z.data<T>();
    const T* gy = grad_y.data<T>();
    T* gx = grad_x ? grad_x->data<T>() : nullptr;
    T* gz = grad_z ? grad_z->data<T>() : nullptr;
    parallel_for(x.numel(), kGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const T s = sigmoid_of(pz[i]);
        if (gx) gx[i] = gy[i] * s;
        if (gz) gz[i] = (gy[i] * px[i]) * (s * (T(1) - s));
      }
    });
  });
}

}  // namespace moetrain::cpu
