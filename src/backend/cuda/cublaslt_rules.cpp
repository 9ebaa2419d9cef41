// The plain C++ half of backend/cuda/cublaslt.h, built in every build and tested
// without a GPU (tests/backend/cublaslt_test.cpp): which GEMMs cuBLASLt may take,
// and which GELU a probe's outputs follow.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "backend/cuda/cublaslt.h"
#include "core/error.h"

namespace moetrain::cuda {

const char* lt_epilogue_name(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::bias: return "bias";
    case LtEpilogue::gelu_aux_bias: return "gelu_aux_bias";
    case LtEpilogue::dgelu_bgrad: return "dgelu_bgrad";
    case LtEpilogue::bgrad_a: return "bgrad_a";
  }
  return "?";
}

const char* gelu_form_name(GeluForm f) {
  switch (f) {
    case GeluForm::tanh: return "tanh";
    case GeluForm::erf: return "erf";
    case GeluForm::unknown: return "unknown";
  }
  return "?";
}

unsigned parse_lt_epilogues(const std::string& value) {
  if (value == "all") return kAllLtEpilogues;
  if (value == "none") return 0;
  unsigned mask = 0;
  size_t start = 0;
  while (start <= value.size()) {
    const size_t comma = std::min(value.find(',', start), value.size());
    const std::string_view name(value.data() + start, comma - start);
    bool known = false;
    for (int e = 0; e < 4; ++e)
      if (name == lt_epilogue_name(static_cast<LtEpilogue>(e))) {
        mask |= 1u << e;
        known = true;
      }
    MT_CHECK(known,
             "MOETRAIN_CUBLASLT_EPILOGUES={}: '{}' is not an epilogue; give a comma list of bias, gelu_aux_bias, "
             "dgelu_bgrad, bgrad_a, or all, or none",
             value, name);
    start = comma + 1;
  }
  return mask;
}

namespace {

// The switch: MOETRAIN_CUBLASLT_EPILOGUES read at the first use.
std::atomic<unsigned>& enabled_lt_epilogues() {
  static std::atomic<unsigned> mask{[] {
    const char* v = std::getenv("MOETRAIN_CUBLASLT_EPILOGUES");
    return v && *v ? parse_lt_epilogues(v) : kAllLtEpilogues;
  }()};
  return mask;
}

}  // namespace

unsigned lt_epilogues_enabled() { return enabled_lt_epilogues().load(std::memory_order_relaxed); }

void set_lt_epilogues_enabled(unsigned mask) {
  enabled_lt_epilogues().store(mask & kAllLtEpilogues, std::memory_order_relaxed);
}

std::string lt_refusal(const LtGemm& g) {
  if (g.dtype != DType::f32 && g.dtype != DType::bf16)
    return fmt::format("dtype {}: the epilogue path takes f32 and bf16", dtype_name(g.dtype));
  if (g.m < 1 || g.n < 1 || g.k < 1) return fmt::format("empty product (M {}, N {}, K {})", g.m, g.n, g.k);
  const int64_t size = dtype_size(g.dtype), per16 = 16 / size;  // elements per 16 bytes
  const bool with_aux = g.epilogue == LtEpilogue::gelu_aux_bias || g.epilogue == LtEpilogue::dgelu_bgrad;
  struct Ld {
    const char* name;
    int64_t value;
  };
  for (Ld ld : {Ld{"lda", g.lda}, Ld{"ldb", g.ldb}, Ld{"ldc", g.ldc}, Ld{"ld_aux", with_aux ? g.ld_aux : 0}})
    if (ld.value % per16 != 0)
      return fmt::format("{} = {} is not a multiple of 16 bytes ({} {} elements)", ld.name, ld.value, per16,
                         dtype_name(g.dtype));
  if (with_aux && (g.ld_aux < g.n || g.ld_aux % 8 != 0))
    return fmt::format("ld_aux = {}: cuBLASLt needs a multiple of 8 that is at least N = {}", g.ld_aux, g.n);
  struct Ptr {
    const char* name;
    const void* value;
  };
  for (Ptr p : {Ptr{"A", g.a}, Ptr{"B", g.b}, Ptr{"C", g.c}, Ptr{"bias", g.bias}, Ptr{"aux", g.aux}}) {
    if (p.value == nullptr) {
      if (p.name == std::string_view("aux") && !with_aux) continue;  // bias and bgrad_a have none
      return fmt::format("{} is null", p.name);
    }
    if (reinterpret_cast<std::uintptr_t>(p.value) % 16 != 0)
      return fmt::format("{} at {} is not 16-byte aligned", p.name, p.value);
  }
  return "";
}

LtGemm lt_linear_forward(DType dtype, int64_t rows, int64_t in, int64_t out, bool gelu, const void* x,
                         const void* w, const void* b, void* y, void* z) {
  LtGemm g;
  g.dtype = dtype;
  g.trans_b = true;  // x w^T, w [out, in]
  g.m = rows;
  g.n = out;
  g.k = in;
  g.a = x;
  g.lda = in;
  g.b = w;
  g.ldb = in;
  g.c = y;
  g.ldc = out;
  g.epilogue = gelu ? LtEpilogue::gelu_aux_bias : LtEpilogue::bias;
  g.bias = const_cast<void*>(b);  // read only with these epilogues
  if (gelu) {
    g.aux = z;
    g.ld_aux = out;
  }
  return g;
}

LtGemm lt_linear_weight_grad(DType dtype, int64_t rows, int64_t in, int64_t out, const void* grad_z, const void* x,
                             void* grad_w, void* grad_b) {
  LtGemm g;
  g.dtype = dtype;
  g.trans_a = true;  // grad_z^T x, grad_z [rows, out]
  g.m = out;
  g.n = in;
  g.k = rows;
  g.a = grad_z;
  g.lda = out;
  g.b = x;
  g.ldb = in;
  g.c = grad_w;
  g.ldc = in;
  g.epilogue = LtEpilogue::bgrad_a;
  g.bias = grad_b;
  return g;
}

LtGemm lt_gelu_input_grad(DType dtype, int64_t rows, int64_t in, int64_t out, const void* grad_y, const void* w,
                          const void* z, void* grad_z, void* grad_b) {
  LtGemm g;
  g.dtype = dtype;
  g.m = rows;  // grad_y [rows, out] w [out, in]
  g.n = in;
  g.k = out;
  g.a = grad_y;
  g.lda = out;
  g.b = w;
  g.ldb = in;
  g.c = grad_z;
  g.ldc = in;
  g.epilogue = LtEpilogue::dgelu_bgrad;
  g.bias = grad_b;
  g.aux = const_cast<void*>(z);  // read only with this epilogue
  g.ld_aux = in;
  return g;
}

// The two forms differ by a smooth d(x) = erf form - tanh form, at most 4.7e-4
// (|x| = 2.7). The outputs' distance from the tanh form, r = y - tanh form, is
// split into its multiple of d, α = <r, d> / <d, d> (0: tanh, 1: erf), and the
// rest, which must be small: an approximate tanh inside the epilogue adds noise
// of its own that a sign-changing d does not follow, so α stays near 0 for it.
GeluForm classify_gelu(const double* x, const double* y, int64_t n) {
  if (n < 1) return GeluForm::unknown;
  std::vector<double> r(static_cast<size_t>(n)), d(static_cast<size_t>(n));
  double rd = 0, dd = 0, scale = 1;
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    if (!std::isfinite(y[i]) || !std::isfinite(v)) return GeluForm::unknown;
    const double t = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
    const double e = 0.5 * v * std::erfc(-v / std::sqrt(2.0));
    r[static_cast<size_t>(i)] = y[i] - t;
    d[static_cast<size_t>(i)] = e - t;
    rd += r[static_cast<size_t>(i)] * d[static_cast<size_t>(i)];
    dd += d[static_cast<size_t>(i)] * d[static_cast<size_t>(i)];
    scale = std::max(scale, std::abs(y[i]));
  }
  if (dd == 0) return GeluForm::unknown;  // points where the forms agree tell nothing
  const double alpha = rd / dd;
  double rest = 0;
  for (size_t i = 0; i < r.size(); ++i) rest += (r[i] - alpha * d[i]) * (r[i] - alpha * d[i]);
  rest = std::sqrt(rest / static_cast<double>(n));
  if (rest > 1e-3 * scale) return GeluForm::unknown;
  if (std::abs(alpha) <= 0.25) return GeluForm::tanh;
  if (std::abs(alpha - 1) <= 0.25) return GeluForm::erf;
  return GeluForm::unknown;
}

}  // namespace moetrain::cuda
