// The plain C++ half of the cuBLASLt wrapper (src/backend/cuda/cublaslt_rules.cpp),
// run without a GPU: which GEMMs of linear take cuBLASLt's epilogues and which the
// plain cuBLAS path, and the check that cuBLASLt's GELU is the tanh form.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/cublaslt.h"
#include "core/error.h"

using namespace moetrain;
using cuda::LtEpilogue;
using cuda::LtGemm;

namespace {

// Fake device addresses with a chosen alignment (never dereferenced).
void* at(std::uintptr_t address) { return reinterpret_cast<void*>(address); }
constexpr std::uintptr_t kX = 0x10000, kW = 0x20000, kB = 0x30000, kY = 0x40000, kZ = 0x50000;

LtGemm forward(DType dt, int64_t rows, int64_t in, int64_t out, bool gelu) {
  return cuda::lt_linear_forward(dt, rows, in, out, gelu, at(kX), at(kW), at(kB), at(kY), at(kZ));
}
LtGemm weight_grad(DType dt, int64_t rows, int64_t in, int64_t out) {
  return cuda::lt_linear_weight_grad(dt, rows, in, out, at(kY), at(kX), at(kW), at(kB));
}

}  // namespace

TEST_CASE("cuBLASLt rules: GPT-2's linear layers take the epilogues in f32 and bf16", "[backend][cublaslt]") {
  // B x T = 8 x 1024 rows; qkv 768 -> 2304, attention projection 768 -> 768, fc 768 -> 3072
  // (with GELU), MLP projection 3072 -> 768.
  struct Layer {
    int64_t in, out;
    bool gelu;
  };
  for (DType dt : {DType::f32, DType::bf16})
    for (Layer l : {Layer{768, 2304, false}, Layer{768, 768, false}, Layer{768, 3072, true}, Layer{3072, 768, false}}) {
      INFO(dtype_name(dt) << " " << l.in << " -> " << l.out);
      LtGemm f = forward(dt, 8192, l.in, l.out, l.gelu);
      CHECK(f.epilogue == (l.gelu ? LtEpilogue::gelu_aux_bias : LtEpilogue::bias));
      CHECK(cuda::lt_refusal(f) == "");
      CHECK(cuda::lt_refusal(weight_grad(dt, 8192, l.in, l.out)) == "");
      if (l.gelu)  // the MLP projection's input gradient through the GELU (mlp_gelu's backward)
        CHECK(cuda::lt_refusal(cuda::lt_gelu_input_grad(dt, 8192, l.out, l.in, at(kY), at(kW), at(kZ), at(kX), at(kB))) ==
              "");
      CHECK(cuda::lt_refusal(forward(dt, 37, l.in, l.out, l.gelu)) == "");  // any row count
    }
}

TEST_CASE("cuBLASLt rules: the column-major mapping of linear's GEMMs", "[backend][cublaslt]") {
  // y [rows, out] = x [rows, in] w^T: row-major m = rows, n = out, k = in, w transposed.
  LtGemm f = forward(DType::f32, 34, 128, 256, true);
  CHECK((f.m == 34 && f.n == 256 && f.k == 128 && !f.trans_a && f.trans_b));
  CHECK((f.lda == 128 && f.ldb == 128 && f.ldc == 256 && f.ld_aux == 256));
  CHECK((f.a == at(kX) && f.b == at(kW) && f.c == at(kY) && f.bias == at(kB) && f.aux == at(kZ)));
  CHECK(forward(DType::f32, 34, 128, 256, false).aux == nullptr);
  // grad_w [out, in] = grad_z^T x: m = out, n = in, k = rows; bias gradient over op(A)'s rows.
  LtGemm g = weight_grad(DType::f32, 34, 128, 256);
  CHECK((g.m == 256 && g.n == 128 && g.k == 34 && g.trans_a && !g.trans_b));
  CHECK((g.lda == 256 && g.ldb == 128 && g.ldc == 128 && g.epilogue == LtEpilogue::bgrad_a));
  CHECK((g.a == at(kY) && g.b == at(kX) && g.c == at(kW) && g.bias == at(kB)));
  // grad_z [rows, in] = (grad_y [rows, out] w [out, in]) gelu'(z): m = rows, n = in, k = out.
  LtGemm d = cuda::lt_gelu_input_grad(DType::f32, 34, 256, 64, at(kY), at(kW), at(kZ), at(kX), at(kB));
  CHECK((d.m == 34 && d.n == 256 && d.k == 64 && !d.trans_a && !d.trans_b && d.epilogue == LtEpilogue::dgelu_bgrad));
  CHECK((d.lda == 64 && d.ldb == 256 && d.ldc == 256 && d.ld_aux == 256));
  CHECK((d.a == at(kY) && d.b == at(kW) && d.aux == at(kZ) && d.c == at(kX) && d.bias == at(kB)));
  // An odd hidden width refuses it (ldb, ldc, aux).
  CHECK(cuda::lt_refusal(cuda::lt_gelu_input_grad(DType::bf16, 34, 100, 64, at(kY), at(kW), at(kZ), at(kX), at(kB)))
            .find("ldb = 100") != std::string::npos);
}

TEST_CASE("cuBLASLt rules: odd shapes, f64, misalignment and empty products take plain cuBLAS",
          "[backend][cublaslt]") {
  using Catch::Contains;
  // GPT-2's vocabulary as an output: ldc = 50257 is not a multiple of 16 bytes.
  CHECK_THAT(cuda::lt_refusal(forward(DType::f32, 8192, 768, 50257, false)), Contains("ldc = 50257"));
  CHECK_THAT(cuda::lt_refusal(forward(DType::bf16, 8192, 768, 50257, false)), Contains("ldc = 50257"));
  CHECK_THAT(cuda::lt_refusal(weight_grad(DType::bf16, 8192, 768, 50257)), Contains("lda = 50257"));
  // The vocabulary padded to a multiple of 64 is taken.
  CHECK(cuda::lt_refusal(forward(DType::bf16, 8192, 768, 50304, false)) == "");
  // An odd input width: lda.
  CHECK_THAT(cuda::lt_refusal(forward(DType::f32, 16, 33, 64, false)), Contains("lda = 33"));
  // 16 bytes are 4 f32 but 8 bf16 elements.
  CHECK(cuda::lt_refusal(forward(DType::f32, 16, 36, 64, false)) == "");
  CHECK_THAT(cuda::lt_refusal(forward(DType::bf16, 16, 36, 64, false)), Contains("8 bf16"));
  // The GELU's aux: cuBLASLt wants its leading dim a multiple of 8 elements, even in f32.
  CHECK(cuda::lt_refusal(forward(DType::f32, 16, 64, 12, false)) == "");
  CHECK_THAT(cuda::lt_refusal(forward(DType::f32, 16, 64, 12, true)), Contains("ld_aux = 12"));
  CHECK_THAT(cuda::lt_refusal(forward(DType::f64, 16, 64, 64, false)), Contains("f64"));
  CHECK_THAT(cuda::lt_refusal(forward(DType::f32, 0, 64, 64, false)), Contains("empty"));
  CHECK_THAT(cuda::lt_refusal(weight_grad(DType::f32, 0, 64, 64)), Contains("empty"));  // K = rows = 0
  // A view 4 bytes into its storage, a missing bias.
  LtGemm f = forward(DType::f32, 16, 64, 64, true);
  f.a = at(kX + 4);
  CHECK_THAT(cuda::lt_refusal(f), Contains("A at") && Contains("16-byte"));
  f = forward(DType::f32, 16, 64, 64, true);
  f.aux = at(kZ + 8);
  CHECK_THAT(cuda::lt_refusal(f), Contains("aux"));
  f = forward(DType::f32, 16, 64, 64, false);
  f.bias = nullptr;
  CHECK_THAT(cuda::lt_refusal(f), Contains("bias is null"));
  f = forward(DType::f32, 16, 64, 64, true);
  f.aux = nullptr;
  CHECK_THAT(cuda::lt_refusal(f), Contains("aux is null"));
}

TEST_CASE("cuBLASLt GELU check: tells the tanh form from the erf form", "[backend][cublaslt]") {
  std::vector<double> x, tanh_y, erf_y, relu_y, noisy_tanh, approx_tanh;
  for (int i = 0; i < 256; ++i) {
    const double v = -4.0 + 8.0 * i / 255.0;
    x.push_back(v);
    tanh_y.push_back(0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))));
    erf_y.push_back(v * 0.5 * std::erfc(-v / std::sqrt(2.0)));  // Φ(v) = erfc(-v/√2)/2
    relu_y.push_back(v > 0 ? v : 0);
    // An f32 GELU with a tanh good to ~5e-4 relative (a hardware approximation) stays tanh.
    approx_tanh.push_back(static_cast<float>(tanh_y.back() * (1 + 4e-4 * std::sin(37.0 * i))));
    noisy_tanh.push_back(tanh_y.back() + 0.05 * std::sin(11.0 * i));
  }
  const int64_t n = static_cast<int64_t>(x.size());
  CHECK(cuda::classify_gelu(x.data(), tanh_y.data(), n) == cuda::GeluForm::tanh);
  CHECK(cuda::classify_gelu(x.data(), approx_tanh.data(), n) == cuda::GeluForm::tanh);
  CHECK(cuda::classify_gelu(x.data(), erf_y.data(), n) == cuda::GeluForm::erf);
  CHECK(cuda::classify_gelu(x.data(), relu_y.data(), n) == cuda::GeluForm::unknown);
  CHECK(cuda::classify_gelu(x.data(), noisy_tanh.data(), n) == cuda::GeluForm::unknown);
  std::vector<double> nan_y = tanh_y;
  nan_y[100] = NAN;
  CHECK(cuda::classify_gelu(x.data(), nan_y.data(), n) == cuda::GeluForm::unknown);
  CHECK(cuda::classify_gelu(x.data(), tanh_y.data(), 0) == cuda::GeluForm::unknown);
}

TEST_CASE("cuBLASLt switch: MOETRAIN_CUBLASLT_EPILOGUES parses to a mask of epilogues", "[backend][cublaslt]") {
  auto bit = [](LtEpilogue e) { return 1u << static_cast<int>(e); };
  CHECK(cuda::parse_lt_epilogues("all") == cuda::kAllLtEpilogues);
  CHECK(cuda::parse_lt_epilogues("none") == 0u);
  CHECK(cuda::parse_lt_epilogues("bias") == bit(LtEpilogue::bias));
  CHECK(cuda::parse_lt_epilogues("dgelu_bgrad,bgrad_a") == (bit(LtEpilogue::dgelu_bgrad) | bit(LtEpilogue::bgrad_a)));
  CHECK(cuda::parse_lt_epilogues("gelu_aux_bias,bias,dgelu_bgrad,bgrad_a") == cuda::kAllLtEpilogues);
  for (const char* bad : {"", "gelu", "bias,", ",bias", "bias,,bgrad_a", "ALL"}) {
    INFO(bad);
    try {
      cuda::parse_lt_epilogues(bad);
      FAIL("accepted");
    } catch (const Error& e) {
      const std::string what = e.what();
      CHECK(what.find("MOETRAIN_CUBLASLT_EPILOGUES=") != std::string::npos);
      CHECK(what.find("is not an epilogue") != std::string::npos);
    }
  }
}
