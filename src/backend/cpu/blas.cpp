#include "backend/cpu/blas.h"

#include <cblas.h>
#include <dlfcn.h>
#include <strings.h>

#include <algorithm>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <string>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

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
    r.set_threads(1);  // the blis route's calls are single-threaded; also initialises BLIS, which arch_id() needs
    r.arch = arch_string(arch_id());
    return r;
  }();
  return b;
}

bool core_is_one_of(const std::string& core, std::initializer_list<const char*> names) {
  for (const char* c : names)
    if (strcasecmp(core.c_str(), c) == 0) return true;
  return false;
}

// OpenBLAS 0.3.21's x86-64 cores (driver/others/dynamic.c) with AVX-512 kernels,
// and those with AVX2 + FMA kernels (Dhyana is Hygon's Zen). Every other core
// (Katmai ... Prescott, Core2, Penryn, Nehalem, Sandybridge, the Opterons and
// Bulldozers, Unknown) has SSE / AVX-only / FMA4 kernels, or is a name this
// list does not know.
bool core_has_avx512(const std::string& core) {
  return core_is_one_of(core, {"SkylakeX", "Cooperlake", "SapphireRapids"});
}
bool core_has_avx2(const std::string& core) {
  return core_has_avx512(core) || core_is_one_of(core, {"Haswell", "Zen", "Dhyana"});
}

GemmRoute g_route = GemmRoute::openblas;
std::string g_route_reason = "MOETRAIN_GEMM not resolved yet";

void resolve_route() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("MOETRAIN_GEMM");
    std::string want = v && *v ? v : "auto";
    MT_CHECK(want == "auto" || want == "openblas" || want == "blis" || want == "blis-threaded" || want == "portable",
             "environment variable MOETRAIN_GEMM={} is not one of auto, openblas, blis, blis-threaded, portable", want);
    const std::string core = openblas_get_corename() ? openblas_get_corename() : "";
    if (want == "openblas") {
      g_route_reason = fmt::format("MOETRAIN_GEMM=openblas: OpenBLAS's {} kernels, as asked", core);
      return;
    }
    if (want == "portable") {
      // The same kernels on every AVX2 + FMA CPU (blas.h): BLIS's haswell ones, whatever
      // BLIS_ARCH_TYPE says, set before BLIS loads.
      MT_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
               "MOETRAIN_GEMM=portable needs a CPU with AVX2 and FMA (x86-64-v3), this one lacks them; our own "
               "kernels run their generic copies here, so its results differ from such CPUs' anyway: use "
               "MOETRAIN_GEMM=auto");
      setenv("BLIS_ARCH_TYPE", kBlisHaswell, 1);
    }
    AutoGemmChoice choice;
    if (want == "auto") {
      choice = choose_auto_gemm(core, cpu_gemm_features());
      g_route_reason = "auto: " + choice.reason;
      if (!choice.blis) return;
    } else {
      g_route_reason = fmt::format("MOETRAIN_GEMM={}, as asked", want);
    }
    const Blis& b = blis();
    if (b.sgemm) {
      g_route = want == "blis-threaded" ? GemmRoute::blis_threaded : GemmRoute::blis;
      MT_ASSERT(want != "portable" || b.arch == "haswell", "MOETRAIN_GEMM=portable but BLIS runs {}", b.arch);
      if (g_route == GemmRoute::blis_threaded) b.set_threads(num_threads());
      return;
    }
    MT_CHECK(want == "auto", "MOETRAIN_GEMM={}: {}", want, b.error);
    // auto wanted BLIS and there is none: OpenBLAS's slow kernels are all that is left.
    g_route_reason = fmt::format("auto: {}; but BLIS cannot be loaded ({}), so OpenBLAS runs anyway", choice.reason,
                                 b.error);
    spdlog::warn("f32 GEMM: {} (docs/performance.md, Intel speed traps)", g_route_reason);
  });
}

// The blis route's split of C: pm x pn blocks, one per thread, each a whole-K
// single-threaded BLIS call, so no thread ever waits for another inside a GEMM
// (BLIS's own barriers spin without yielding: with more threads than free cores
// a GEMM could stall for minutes). The bits do not depend on the thread count:
// every element of C is computed by the same micro-kernel over the same K blocks
// whatever block it falls in, as long as each block takes the same path through
// BLIS as the whole product. BLIS 0.9's haswell configuration sends a product
// with m, n or k below 201 to its "sup" (small/unpacked) kernels, which sum in
// another order, so a product above that size is only cut into blocks that stay
// above it, and one below it is not cut at all: the sup kernels' own choices
// (loop variant, edge kernels) follow the block's shape, and cutting changed bits
// (tests/backend/blas_test.cpp under MOETRAIN_GEMM=portable). skx has no sup
// kernels: there any cut keeps the bits. Cuts fall on whole micro-tiles where
// the sizes allow: skx's sgemm tile is 32 x 12 on C^T (BLIS transposes our
// row-major C for its column-preferring kernel), haswell's 6 x 16 on C, so rows
// are cut at multiples of 12 and columns at multiples of 32.
constexpr int64_t kSplitRows = 12, kSplitCols = 32;
constexpr int64_t kBlisSupThreshold = 201;  // config/haswell/bli_cntx_init_haswell.c, BLIS 0.9: MT = NT = KT
// Smaller GEMMs run on the calling thread: below this many multiply-adds per
// thread the OpenMP fork and join cost more than they save.
constexpr double kMinMaddsPerThread = double(1 << 21);

struct SplitGrid {
  int pm = 1, pn = 1;
};

// Start of part i of p over `extent`, in whole units of `unit` (the last part
// takes the remainder).
int64_t split_start(int64_t extent, int64_t unit, int i, int p) {
  const int64_t units = (extent + unit - 1) / unit;
  return std::min(extent, units * i / p * unit);
}

// The smallest of the p parts of `extent` (0 when a part would be empty).
int64_t smallest_part(int64_t extent, int64_t unit, int p) {
  int64_t smallest = extent;
  for (int i = 0; i < p; ++i)
    smallest = std::min(smallest, split_start(extent, unit, i + 1, p) - split_start(extent, unit, i, p));
  return smallest;
}

// The grid for up to `threads` blocks that packs the least per thread: each block
// packs its rows of op(A) and its columns of op(B), K long, so minimise
// m / pm + n / pn over pm x pn = t, for the largest t <= threads that fits
// (no empty block; with `sup` kernels, blocks of a product above the threshold
// stay above it and a product below it stays whole).
SplitGrid split_grid(int64_t m, int64_t n, int64_t k, int threads, bool sup) {
  const double madds = static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  threads = static_cast<int>(std::min<double>(threads, std::max(1.0, madds / kMinMaddsPerThread)));
  const bool conventional = m >= kBlisSupThreshold && n >= kBlisSupThreshold && k >= kBlisSupThreshold;
  if (sup && !conventional) return {};
  const int64_t min_block = sup ? kBlisSupThreshold : 1;
  for (int t = threads; t > 1; --t) {
    SplitGrid best;
    double best_cost = std::numeric_limits<double>::infinity();
    for (int pm = 1; pm <= t; ++pm) {
      const int pn = t / pm;
      if (pm * pn != t || smallest_part(m, kSplitRows, pm) < min_block ||
          smallest_part(n, kSplitCols, pn) < min_block)
        continue;
      const double cost = static_cast<double>(m) / pm + static_cast<double>(n) / pn;
      if (cost < best_cost) best_cost = cost, best = {pm, pn};
    }
    if (best.pm * best.pn == t) return best;
  }
  return {};
}

void blis_sgemm_split(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                      int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const BlisSgemm sgemm = blis().sgemm;
  // Rows [i0, i1) and columns [j0, j1) of C. Row-major operands: row stride ld, column
  // stride 1; op() as BLIS's trans flags. Row i of op(A) is row i of A, or column i
  // of A when transposed; column j of op(B) likewise.
  auto block = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    if (i0 >= i1 || j0 >= j1) return;
    sgemm(trans_a ? kBlisTranspose : 0, trans_b ? kBlisTranspose : 0, i1 - i0, j1 - j0, k, &alpha,
          trans_a ? a + i0 : a + i0 * lda, lda, 1, trans_b ? b + j0 * ldb : b + j0, ldb, 1, &beta, c + i0 * ldc + j0,
          ldc, 1);
  };
  // Every configuration but skx may have sup kernels (haswell, zen*: BLIS_ARCH_TYPE set by the user).
  static const bool sup = blis().arch != "skx";
  const SplitGrid grid = omp_in_parallel() ? SplitGrid{} : split_grid(m, n, k, num_threads(), sup);
  const int blocks = grid.pm * grid.pn;
  if (blocks == 1) return block(0, m, 0, n);
#pragma omp parallel num_threads(blocks)
  {
    // A team smaller than asked for (OMP_THREAD_LIMIT, nesting) takes several blocks per thread.
    for (int q = omp_get_thread_num(); q < blocks; q += omp_get_num_threads()) {
      const int bi = q / grid.pn, bj = q % grid.pn;
      block(split_start(m, kSplitRows, bi, grid.pm), split_start(m, kSplitRows, bi + 1, grid.pm),
            split_start(n, kSplitCols, bj, grid.pn), split_start(n, kSplitCols, bj + 1, grid.pn));
    }
  }
}
}  // namespace

AutoGemmChoice choose_auto_gemm(const std::string& openblas_core, CpuGemmFeatures cpu) {
  const std::string& core = openblas_core.empty() ? std::string("(none reported)") : openblas_core;
  if (cpu.avx512_skx && !core_has_avx512(openblas_core))
    return {true, fmt::format("OpenBLAS's core {} has no AVX-512 {}kernels and this CPU has AVX-512 F/DQ/BW/VL: "
                              "BLIS (skx)",
                              core, core_has_avx2(openblas_core) ? "" : "(nor AVX2) ")};
  if (cpu.avx2_fma && !core_has_avx2(openblas_core))
    return {true, fmt::format("OpenBLAS's core {} has no AVX2 kernels (its build does not know this CPU) and this CPU "
                              "has AVX2 + FMA: BLIS (haswell)",
                              core)};
  if (cpu.avx512_skx || cpu.avx2_fma)
    return {false, fmt::format("OpenBLAS's core {} has kernels for this CPU's widest vector unit ({})", core,
                               cpu.avx512_skx ? "AVX-512" : "AVX2 + FMA")};
  return {false, fmt::format("this CPU has neither AVX2 + FMA nor AVX-512: OpenBLAS's core {} is the best there is",
                             core)};
}

CpuGemmFeatures cpu_gemm_features() {
  return {__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), cpu_has_skx_avx512()};
}

std::string gemm_route_reason() {
  resolve_route();
  return g_route_reason;
}

GemmRoute gemm_route() {
  resolve_route();
  return g_route;
}

void set_gemm_route(GemmRoute route) {
  resolve_route();
  if (route != GemmRoute::openblas) {
    MT_CHECK(blis().sgemm, "f32 GEMM route {}: {}", gemm_route_name(route), blis().error);
    blis().set_threads(route == GemmRoute::blis_threaded ? num_threads() : 1);
  }
  g_route = route;
  g_route_reason = fmt::format("set to {} by the program (a test or benchmark)", gemm_route_name(route));
}

bool blis_available() {
  resolve_route();  // first: MOETRAIN_GEMM=portable picks BLIS's kernels before it loads
  return blis().sgemm != nullptr;
}

void set_blas_threads(int n) {
  openblas_set_num_threads(n);
  if (g_route == GemmRoute::blis_threaded && blis().set_threads) blis().set_threads(n);
}

const char* gemm_route_name(GemmRoute route) {
  switch (route) {
    case GemmRoute::openblas: return "openblas";
    case GemmRoute::blis: return "blis";
    case GemmRoute::blis_threaded: return "blis-threaded";
  }
  return "?";
}

std::string gemm_threading() {
  const int n = num_threads();
  switch (gemm_route()) {
    case GemmRoute::openblas:
      return fmt::format("OpenBLAS's own OpenMP regions, {} thread{}", n, n == 1 ? "" : "s");
    case GemmRoute::blis:
      return fmt::format("moetrain's OpenMP regions, {} thread{}, one block of C each, single-threaded BLIS calls "
                         "(no barrier inside a GEMM)",
                         n, n == 1 ? "" : "s");
    case GemmRoute::blis_threaded:
      return fmt::format("BLIS's own OpenMP threads, {}, spinning barriers (stall when threads exceed free cores)",
                         n);
  }
  return "?";
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) return scale_only(m, n, beta, c, ldc);
  const GemmRoute route = gemm_route();
  if (route == GemmRoute::blis) return blis_sgemm_split(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (route == GemmRoute::blis_threaded) {
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
  const GemmRoute route = gemm_route();
  s += gemm_route_name(route);
  if (route != GemmRoute::openblas) s += " (" + blis().arch + ")";
  return s;
}

}  // namespace moetrain::cpu
