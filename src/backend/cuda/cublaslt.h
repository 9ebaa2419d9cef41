// GEMMs with fused epilogues through cuBLASLt, in row-major terms (our layout):
//   C = op(A) op(B), op(A) m x k, C m x n (leading dims lda, ldb, ldc), then
//   bias:          C[i, j] += bias[j]                                     bias [n]
//   gelu_aux_bias: aux[i, j] = C[i, j] + bias[j]; C[i, j] = gelu(aux[i, j])  aux m x n, ld ld_aux
//   dgelu_bgrad:   C[i, j] *= gelu'(aux[i, j]); bias[j] = Σ_i C[i, j]     bias written
//   bgrad_a:       bias[i] = Σ_p op(A)[i, p]; C unchanged by it           bias [m] written
// cuBLASLt is column-major, so the operands swap (C^T = op(B)^T op(A)^T): our
// bias [n] is its bias over the rows of D, our bgrad_a its BGRADB (the bias
// gradient of its B, our A). f32 (TF32 when cuda::allow_tf32()) and bf16 with f32
// compute; bias and aux have C's type. One handle per device on the device's
// stream; a workspace per device from the caching allocator. docs/cuda.md,
// "cuBLASLt epilogues": the epilogues, the rule for what falls back, the GELU check.
// No CUDA header here: lt_refusal and classify_gelu are plain C++
// (cublaslt_rules.cpp, built and tested without a GPU).
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"

namespace moetrain::cuda {

enum class LtEpilogue { bias, gelu_aux_bias, dgelu_bgrad, bgrad_a };
const char* lt_epilogue_name(LtEpilogue e);

struct LtGemm {
  DType dtype = DType::f32;
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* c = nullptr;
  int64_t ldc = 0;
  LtEpilogue epilogue = LtEpilogue::bias;
  void* bias = nullptr;  // read (bias, gelu_aux_bias) or written (dgelu_bgrad, bgrad_a)
  void* aux = nullptr;   // the GELU input: written by gelu_aux_bias, read by dgelu_bgrad
  int64_t ld_aux = 0;
};

// Why `g` does not take cuBLASLt, "" when it may: f32 or bf16; m, n, k >= 1;
// every leading dim a multiple of 16 bytes and every pointer (A, B, C, bias, aux)
// 16-byte aligned; aux's leading dim >= n and a multiple of 8 (cuBLASLt's own rule).
std::string lt_refusal(const LtGemm& g);

// The GEMMs of linear (ops/linalg/linalg_cuda.cu), built here so the tests can ask
// on the host which path a shape takes (lt_refusal of what they return):
//   forward:  y [rows, out] = x [rows, in] w^T + b (gelu: z = that, y = gelu(z))
//   grad_w:   grad_w [out, in] = grad_z^T x, grad_b = Σ_rows grad_z (bgrad_a)
LtGemm lt_linear_forward(DType dtype, int64_t rows, int64_t in, int64_t out, bool gelu, const void* x,
                         const void* w, const void* b, void* y, void* z);
LtGemm lt_linear_weight_grad(DType dtype, int64_t rows, int64_t in, int64_t out, const void* grad_z, const void* x,
                             void* grad_w, void* grad_b);
// The input gradient of a linear whose input is gelu(z), z [rows, in], w [out, in]:
//   grad_z = (grad_y w) gelu'(z), grad_b = Σ_rows grad_z (dgelu_bgrad, aux z)
LtGemm lt_gelu_input_grad(DType dtype, int64_t rows, int64_t in, int64_t out, const void* grad_y, const void* w,
                          const void* z, void* grad_z, void* grad_b);

// Which GELU a probe's outputs y = gelu(x) follow: the tanh form (ours, GPT-2's),
// the erf form, or neither: the outputs' difference from the tanh form, as a
// multiple α of (erf form - tanh form) plus a rest; the rest's root mean square
// must be within 1e-3 of the values' scale, then |α| <= 0.25 is tanh, within 0.25
// of 1 erf (cublaslt_rules.cpp says why).
enum class GeluForm { tanh, erf, unknown };
GeluForm classify_gelu(const double* x, const double* y, int64_t n);
const char* gelu_form_name(GeluForm f);

// Runs `g` through cublasLtMatmul on `device`'s stream. False, with nothing
// written, when the epilogue is switched off (lt_epilogues_enabled), when
// lt_refusal(g) refuses it, when the epilogue is gelu_aux_bias or dgelu_bgrad and
// lt_gelu_form(device) is not tanh, or when cuBLASLt's heuristic offers no
// algorithm (said once per shape): the caller then takes the plain cuBLAS path,
// whose numbers the tests check as they check the epilogue's.
bool lt_matmul(const LtGemm& g, int device);

// Which epilogues lt_matmul may use, a bit per LtEpilogue (bit 1 << int(e)): all
// by default, or what MOETRAIN_CUBLASLT_EPILOGUES says at the first call (a comma
// list of epilogue names, "all" or "none"; docs/cuda.md). The tests switch them
// off to check the fallback; users to rule an epilogue out.
inline constexpr unsigned kAllLtEpilogues = 0xFu;
unsigned lt_epilogues_enabled();
void set_lt_epilogues_enabled(unsigned mask);
// Parses a MOETRAIN_CUBLASLT_EPILOGUES value into a mask; throws Error naming the
// variable, the bad name and the names it takes (plain C++, cublaslt_rules.cpp).
unsigned parse_lt_epilogues(const std::string& value);

// The GELU this device's cuBLASLt epilogue computes, probed once per device (a
// GEMM with GELU_AUX_BIAS on 256 points in [-4, 4], read back to the host) and
// logged. NVIDIA's documentation says only "GELU", so the fused GELU paths are
// taken only where this says tanh.
GeluForm lt_gelu_form(int device);

// Calls since the start, for the tests, by epilogue (indexed by LtEpilogue):
// cuBLASLt matmuls run; GEMMs cuBLASLt could not take although the shape was
// allowed (no algorithm offered, or the GELU is not the tanh form: reported, not
// a failure); GEMMs of a switched-off epilogue; and every GEMM that fell back to
// the plain path (these two plus lt_refusal's).
struct LtStats {
  int64_t runs[4] = {0, 0, 0, 0};
  int64_t unavailable[4] = {0, 0, 0, 0};
  int64_t disabled[4] = {0, 0, 0, 0};
  int64_t fallbacks = 0;
};
LtStats lt_stats();

}  // namespace moetrain::cuda
