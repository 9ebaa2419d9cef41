#include "backend/cpu/blas.h"

#include <cblas.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "backend/cpu/parallel.h"
#include "core/error.h"

namespace moetrain::cpu {

namespace {
CBLAS_TRANSPOSE tr(bool t) { return t ? CblasTrans : CblasNoTrans; }

// k == 0: the product is empty and C = beta * C (BLAS would reject lda = 0).
template <class T>
void scale_only(int64_t m, int64_t n, T beta, T* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == T(0) ? T(0) : beta * c[i * ldc + j];
}

// The few entry points of BLIS's typed API we use (blis.h, BLIS 0.9, 64-bit
// dim_t / inc_t: BLIS_INT_TYPE_SIZE 64 on x86-64). trans_t: BLIS_NO_TRANSPOSE = 0,
// BLIS_TRANSPOSE = 1 << 3.
using BlisSgemm = void (*)(int transa, int transb, int64_t m, int64_t n, int64_t k, const float* alpha,
                           const float* a, int64_t rs_a, int64_t cs_a, const float* b, int64_t rs_b, int64_t cs_b,
                           const float* beta, float* c, int64_t rs_c, int64_t cs_c);
using BlisSetThreads = void (*)(int64_t n);
using BlisArchId = int (*)();
using BlisArchString = char* (*)(int id);
constexpr int kBlisTranspose = 1 << 3;

struct Blis {
  BlisSgemm sgemm = nullptr;
  BlisSetThreads set_threads = nullptr;
  std::string arch;
  std::string error;  // why it could not be loaded
};

// BLIS arch ids of 0.9's arch_t (BLIS_ARCH_TYPE takes the number).
constexpr const char* kBlisSkx = "0";
constexpr const char* kBlisHaswell = "3";

// The AVX-512 subsets BLIS's skx kernels use (Skylake-SP and later).
bool cpu_has_skx_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

const Blis& blis() {
  static const Blis b = [] {
    Blis r;
    // Chosen before BLIS initialises (it reads BLIS_ARCH_TYPE once); a value the
    // user set wins.
    if (!std::getenv("BLIS_ARCH_TYPE")) {
      if (cpu_has_skx_avx512()) setenv("BLIS_ARCH_TYPE", kBlisSkx, 0);
      else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) setenv("BLIS_ARCH_TYPE", kBlisHaswell, 0);
    }
    void* h = nullptr;
    for (const char* name : {"/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4", "libblis.so.4"})
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL))) break;
    if (!h) {
      r.error = "libblis.so.4 not found (Debian package libblis4-openmp; launch/setup.sh installs it)";
      return r;
    }
    r.sgemm = reinterpret_cast<BlisSgemm>(dlsym(h, "bli_sgemm"));
    r.set_threads = reinterpret_cast<BlisSetThreads>(dlsym(h, "bli_thread_set_num_threads"));
    auto arch_id = reinterpret_cast<BlisArchId>(dlsym(h, "bli_arch_query_id"));
    auto arch_string = reinterpret_cast<BlisArchString>(dlsym(h, "bli_arch_string"));
    if (!r.sgemm || !r.set_threads || !arch_id || !arch_string) {
      r.sgemm = nullptr;
      r.error = "libblis.so.4 lacks bli_sgemm / bli_thread_set_num_threads / bli_arch_query_id (not BLIS 0.9?)";
      return r;
    }
    r.set_threads(num_threads());  // also initialises BLIS, which arch_id() needs
    r.arch = arch_string(arch_id());
    return r;
  }();
  return b;
}

bool openblas_has_avx512() {
  const char* core = openblas_get_corename();
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (core && std::strcmp(core, c) == 0) return true;
  return false;
}

GemmRoute g_route = GemmRoute::openblas;

void resolve_route() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("MOETRAIN_GEMM");
    std::string want = v && *v ? v : "auto";
    MT_CHECK(want == "auto" || want == "openblas" || want == "blis",
             "environment variable MOETRAIN_GEMM={} is not one of auto, openblas, blis", want);
    if (want == "openblas") return;
    if (want == "auto" && !(cpu_has_skx_avx512() && !openblas_has_avx512())) return;
    const Blis& b = blis();
    if (b.sgemm) {
      g_route = GemmRoute::blis;
      return;
    }
    MT_CHECK(want == "auto", "MOETRAIN_GEMM=blis: {}", b.error);
  });
}
}  // namespace

GemmRoute gemm_route() {
  resolve_route();
  return g_route;
}

void set_gemm_route(GemmRoute route) {
  resolve_route();
  if (route == GemmRoute::blis) {
    MT_CHECK(blis().sgemm, "f32 GEMM route blis: {}", blis().error);
    blis().set_threads(num_threads());
  }
  g_route = route;
}

bool blis_available() { return blis().sgemm != nullptr; }

void set_blas_threads(int n) {
  openblas_set_num_threads(n);
  if (g_route == GemmRoute::blis && blis().set_threads) blis().set_threads(n);
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) return scale_only(m, n, beta, c, ldc);
  if (gemm_route() == GemmRoute::blis) {
    // Row-major operands: row stride ld, column stride 1; op() as BLIS's trans flags.
    blis().sgemm(trans_a ? kBlisTranspose : 0, trans_b ? kBlisTranspose : 0, m, n, k, &alpha, a, lda, 1, b, ldb, 1,
                 &beta, c, ldc, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, tr(trans_a), tr(trans_b), static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) return scale_only(m, n, beta, c, ldc);
  cblas_dgemm(CblasRowMajor, tr(trans_a), tr(trans_b), static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), alpha, a, static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

std::string blas_name() {
  std::string s = openblas_get_config();
  s += " core=";
  s += openblas_get_corename();
  s += "; f32 GEMM: ";
  s += gemm_route() == GemmRoute::blis ? "blis (" + blis().arch + ")" : "openblas";
  return s;
}

}  // namespace moetrain::cpu
