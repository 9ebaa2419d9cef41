// Row-major GEMM for the CPU kernels:
//   C[M,N] = alpha * op(A) op(B) + beta * C,  op(X) = X or X^T.
// f64 always runs on OpenBLAS (OpenMP flavour). f32, the training path, runs on a
// route chosen once per process:
//   openblas       OpenBLAS with the kernels it picked for this CPU, in its own
//                  OpenMP regions.
//   blis           BLIS (Debian libblis4-openmp, loaded at run time with dlopen),
//                  with its AVX-512 "skx" kernels on CPUs with AVX-512 F/DQ/BW/VL
//                  (Debian's BLIS 0.9 does not recognise some of them and would fall
//                  back to generic C), its "haswell" kernels on AVX2 + FMA. BLIS
//                  runs single-threaded; we split C into one block per thread
//                  (full K each) in one OpenMP region of our own, so the threads
//                  never wait for each other inside a GEMM and meet once, at the
//                  region's end, in libgomp's barrier (which sleeps after
//                  GOMP_SPINCOUNT spins). Same bits for any thread count.
//   blis-threaded  BLIS's own threading (for comparison only): its barriers
//                  (bli_thrcomm_barrier) spin without ever yielding, so with more
//                  threads than free cores (threads > cores, two runs side by side)
//                  a GEMM can take minutes or seemingly hang.
//   portable       blis with BLIS's haswell (AVX2 + FMA) kernels on every CPU that has
//                  them (an error elsewhere): the same bits on any such CPU, for any
//                  thread count, given the same build and libraries (docs/performance.md,
//                  Reproducibility). openblas is not that: its kernels depend on the CPU
//                  and its results on the thread count.
// MOETRAIN_GEMM=auto (default) | openblas | blis | blis-threaded | portable. auto takes blis on
// such AVX-512 CPUs when OpenBLAS runs kernels without AVX-512 there (its core is
// not SkylakeX / Cooperlake / SapphireRapids, e.g. AMD Zen 4/5, or
// OPENBLAS_CORETYPE=Haswell), and on AVX2 + FMA CPUs when OpenBLAS runs kernels
// without AVX2 there (a core its build does not know, reported as Prescott, Core2,
// Nehalem, Sandybridge, ...: Debian's 0.3.21 on recent Xeons runs Prescott's SSE3
// kernels, 5x slower), and OpenBLAS otherwise (choose_auto_gemm); where both have AVX2 kernels
// only (AMD Zen 2/3), BLIS was up to 1.3x faster on some GPT-2 shapes on an idle box
// but collapsed when another process shared the cores, OpenBLAS much less (that was
// BLIS's own threading, now blis-threaded; not measured since on such a CPU).
// bench/cpu_bench's gemm and gemm-step cases compare the routes in one process.
// Called from inside our own OpenMP regions a GEMM runs on the calling thread only.
#pragma once

#include <cstdint>
#include <string>

namespace moetrain::cpu {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
          const double* b, int64_t ldb, double beta, double* c, int64_t ldc);

enum class GemmRoute { openblas, blis, blis_threaded };

// The f32 route in use (resolved from MOETRAIN_GEMM on first use; a bad value or
// MOETRAIN_GEMM=blis without a loadable BLIS throws, naming the variable).
GemmRoute gemm_route();
// Switches the f32 route (benchmarks and tests compare the two in one process).
// Throws when BLIS is asked for and cannot be loaded.
void set_gemm_route(GemmRoute route);
// True when libblis could be loaded (loads it on first call).
bool blis_available();
// Threads for the BLAS libraries' own parallel regions.
void set_blas_threads(int n);

// What MOETRAIN_GEMM=auto does, from OpenBLAS's core name (openblas_get_corename(),
// any case) and the CPU: blis when OpenBLAS's kernels lack the CPU's widest vector
// unit that BLIS has kernels for (AVX-512 F/DQ/BW/VL: SkylakeX, Cooperlake,
// SapphireRapids; AVX2 + FMA: those, Haswell, Zen, Dhyana), with the reason in words.
struct CpuGemmFeatures {
  bool avx2_fma = false;    // AVX2 and FMA (x86-64-v3)
  bool avx512_skx = false;  // AVX-512 F, DQ, BW and VL (BLIS's skx kernels)
};
struct AutoGemmChoice {
  bool blis = false;
  std::string reason;
};
AutoGemmChoice choose_auto_gemm(const std::string& openblas_core, CpuGemmFeatures cpu);
// This CPU's features as choose_auto_gemm reads them.
CpuGemmFeatures cpu_gemm_features();
// Why the f32 route in use was chosen, e.g. "auto: OpenBLAS's core Prescott has no
// AVX2 kernels and this CPU has AVX2 + FMA"; for `moetrain info`.
std::string gemm_route_reason();

// The route's MOETRAIN_GEMM name: "openblas", "blis", "blis-threaded".
const char* gemm_route_name(GemmRoute route);
// How the route in use runs on threads, e.g. "moetrain's OpenMP regions, 2 threads,
// one block of C each, single-threaded BLIS calls (no barrier inside a GEMM)".
std::string gemm_threading();
// e.g. "OpenBLAS 0.3.21 ... core=Zen; f32 GEMM: openblas" or "...; f32 GEMM: blis (skx)"
std::string blas_name();

}  // namespace moetrain::cpu
