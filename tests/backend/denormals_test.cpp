// Subnormals (backend/cpu/denormals.h): with MOETRAIN_DENORMALS=flush (default)
// the main thread and every OpenMP worker read a subnormal operand as zero (DAZ)
// and write a subnormal result as zero (FTZ); with keep they do neither. And the
// f32 GEMM route's auto choice (backend/cpu/blas.h: choose_auto_gemm) never takes
// OpenBLAS where its kernels lack the CPU's AVX2 / AVX-512.
#include <catch2/catch.hpp>

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/denormals.h"
#include "backend/cpu/parallel.h"
#include "testing.h"

using namespace moetrain;

namespace {

// What the calling thread's arithmetic does with subnormals. volatile: computed
// at run time, under this thread's MXCSR, not folded by the compiler.
struct Underflow {
  float f32_operand = -1, f32_product = -1;     // 2^-140 * 1 (DAZ), 2^-70 * 2^-70 (FTZ)
  double f64_operand = -1, f64_product = -1;    // 2^-1070 * 1, 2^-535 * 2^-535
  bool flushed() const { return f32_operand == 0 && f32_product == 0 && f64_operand == 0 && f64_product == 0; }
  bool kept() const {
    return f32_operand == 0x1p-140f && f32_product == 0x1p-140f && f64_operand == 0x1p-1070 &&
           f64_product == 0x1p-1070;
  }
};

Underflow underflow_here() {
  volatile float sub32 = 0x1p-140f, one32 = 1.0f, half32 = 0x1p-70f;
  volatile double sub64 = 0x1p-1070, one64 = 1.0, half64 = 0x1p-535;
  Underflow u;
  u.f32_operand = sub32 * one32;
  u.f32_product = half32 * half32;
  u.f64_operand = sub64 * one64;
  u.f64_product = half64 * half64;
  return u;
}

// underflow_here() in each chunk of the library's parallel_for, with the OpenMP
// thread that ran it.
struct PerThread {
  std::vector<Underflow> results;
  std::set<int> threads;
};
PerThread underflow_in_parallel_for(int threads) {
  PerThread out;
  out.results.resize(static_cast<size_t>(threads));
  std::vector<int> who(static_cast<size_t>(threads), -1);
  cpu::parallel_for(threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      out.results[static_cast<size_t>(i)] = underflow_here();
      who[static_cast<size_t>(i)] = omp_get_thread_num();
    }
  });
  out.threads.insert(who.begin(), who.end());
  return out;
}

// Restores the thread count and the mode a test found.
struct RestoreThreadsAndMode {
  int threads = cpu::num_threads();
  cpu::DenormalMode mode = cpu::denormal_mode();
  ~RestoreThreadsAndMode() {
    cpu::set_num_threads(threads);
    cpu::set_denormal_mode(mode);
  }
};

}  // namespace

TEST_CASE("denormals: flush makes subnormals zero in the main thread and every OpenMP worker; keep keeps them",
          "[backend][denormals]") {
#if !(defined(__x86_64__) || defined(__i386__))
  SKIP("FTZ/DAZ are set on x86-64 only");
#endif
  RestoreThreadsAndMode restore;
  const int threads = 4;
  cpu::set_num_threads(threads);

  cpu::set_denormal_mode(cpu::DenormalMode::flush);
  CHECK(cpu::this_thread_flushes_denormals());
  CHECK(underflow_here().flushed());
  PerThread flushed = underflow_in_parallel_for(threads);
  CHECK(flushed.threads.size() == static_cast<size_t>(threads));  // every worker of the team ran a chunk
  for (const Underflow& u : flushed.results) CHECK(u.flushed());

  cpu::set_denormal_mode(cpu::DenormalMode::keep);
  CHECK_FALSE(cpu::this_thread_flushes_denormals());
  CHECK(underflow_here().kept());
  PerThread kept = underflow_in_parallel_for(threads);
  CHECK(kept.threads.size() == static_cast<size_t>(threads));
  for (const Underflow& u : kept.results) CHECK(u.kept());

  // Back to flush: a wider pool (new libgomp workers) flushes too, and so does a
  // thread started afterwards (the watchdog's, the checkpoint writer's, MPI's).
  cpu::set_denormal_mode(cpu::DenormalMode::flush);
  const int wider = cpu::widest_thread_count() + 3;
  cpu::set_num_threads(wider);
  PerThread wide = underflow_in_parallel_for(wider);
  CHECK(wide.threads.size() == static_cast<size_t>(wider));
  for (const Underflow& u : wide.results) CHECK(u.flushed());
  Underflow in_thread;
  std::thread([&] { in_thread = underflow_here(); }).join();
  CHECK(in_thread.flushed());
}

TEST_CASE("denormals: every GEMM route, on its threads, flushes subnormal products or keeps them as asked",
          "[backend][denormals]") {
#if !(defined(__x86_64__) || defined(__i386__))
  SKIP("FTZ/DAZ are set on x86-64 only");
#endif
  RestoreThreadsAndMode restore;
  const cpu::GemmRoute saved_route = cpu::gemm_route();
  cpu::set_num_threads(4);
  // 512^3 multiply-adds: OpenBLAS threads it, the blis route splits C over the 4
  // threads (2 x 2 blocks of 256, above BLIS haswell's sup threshold). Every product
  // is 2^-140 (f32) / 2^-1070 (f64), subnormal; each partial sum j * 2^-140 is exact
  // in any order, so the kept result is exactly 512 * 2^-140.
  const int64_t n = 512;
  std::vector<float> a(static_cast<size_t>(n * n), 0x1p-70f), c(static_cast<size_t>(n * n), -1.0f);
  std::vector<double> a64(static_cast<size_t>(n * n), 0x1p-535), c64(static_cast<size_t>(n * n), -1.0);
  std::vector<cpu::GemmRoute> routes{cpu::GemmRoute::openblas};
  if (cpu::blis_available()) routes.insert(routes.end(), {cpu::GemmRoute::blis, cpu::GemmRoute::blis_threaded});
  for (cpu::DenormalMode mode : {cpu::DenormalMode::flush, cpu::DenormalMode::keep}) {
    cpu::set_denormal_mode(mode);
    const bool flush = mode == cpu::DenormalMode::flush;
    for (cpu::GemmRoute route : routes) {
      cpu::set_gemm_route(route);
      INFO("route " << cpu::gemm_route_name(route) << ", " << cpu::denormal_mode_name(mode));
      cpu::gemm(false, false, n, n, n, 1.0f, a.data(), n, a.data(), n, 0.0f, c.data(), n);
      int64_t wrong = 0;
      for (float x : c) wrong += x != (flush ? 0.0f : 0x1p-131f);
      CHECK(wrong == 0);
    }
    cpu::gemm(false, false, n, n, n, 1.0, a64.data(), n, a64.data(), n, 0.0, c64.data(), n);  // OpenBLAS
    int64_t wrong = 0;
    for (double x : c64) wrong += x != (flush ? 0.0 : 0x1p-1061);
    CHECK(wrong == 0);
  }
  cpu::set_gemm_route(saved_route);
}

TEST_CASE("denormals: the process starts flushing unless MOETRAIN_DENORMALS=keep; info says which; a bad value "
          "is refused",
          "[backend][denormals]") {
  // The test main runs init_threads(), as the CLI does: this process flushes unless
  // the environment said keep.
  const char* env = std::getenv("MOETRAIN_DENORMALS");
  if (!env || std::string(env) != "keep") CHECK(cpu::denormal_mode() == cpu::DenormalMode::flush);
  const std::string info = std::string(MOETRAIN_BINARY_DIR) + "/moetrain info";
  auto plain = moetrain::testing::capture_command("env -u MOETRAIN_DENORMALS " + info);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.output, Catch::Contains("denormals   flush (MOETRAIN_DENORMALS=flush)"));
  auto keep = moetrain::testing::capture_command("MOETRAIN_DENORMALS=keep " + info);
  REQUIRE(keep.code == 0);
  CHECK_THAT(keep.output, Catch::Contains("denormals   keep (MOETRAIN_DENORMALS=keep)"));
  auto bad = moetrain::testing::capture_command("MOETRAIN_DENORMALS=off " + info);
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("environment variable MOETRAIN_DENORMALS=off is not flush or keep"));
}

TEST_CASE("gemm route: auto never takes OpenBLAS kernels that lack the CPU's AVX2 / AVX-512",
          "[backend][blas]") {
  const cpu::CpuGemmFeatures avx512{true, true}, avx2{true, false}, sse{false, false};
  // Debian's OpenBLAS 0.3.21 on a recent Xeon: Prescott's SSE3 kernels.
  auto prescott = cpu::choose_auto_gemm("Prescott", avx512);
  CHECK(prescott.blis);
  CHECK_THAT(prescott.reason, Catch::Contains("core Prescott has no AVX-512 (nor AVX2) kernels"));
  for (const char* old : {"Prescott", "Core2", "Nehalem", "Katmai", "Sandybridge", "Barcelona", "Bulldozer",
                          "Piledriver", "Unknown", "", "SomeFutureCore"}) {
    auto c = cpu::choose_auto_gemm(old, avx2);
    INFO(old << ": " << c.reason);
    CHECK(c.blis);
    CHECK(cpu::choose_auto_gemm(old, avx512).blis);
    CHECK_FALSE(cpu::choose_auto_gemm(old, sse).blis);  // nothing better to take there
  }
  CHECK_THAT(cpu::choose_auto_gemm("Nehalem", avx2).reason,
             Catch::Contains("core Nehalem has no AVX2 kernels") && Catch::Contains("BLIS (haswell)"));
  // OpenBLAS's own kernels for the CPU: kept.
  auto haswell = cpu::choose_auto_gemm("Haswell", avx2);
  CHECK_FALSE(haswell.blis);
  CHECK_THAT(haswell.reason, Catch::Contains("core Haswell has kernels for this CPU's widest vector unit (AVX2"));
  CHECK_FALSE(cpu::choose_auto_gemm("Zen", avx2).blis);
  CHECK_FALSE(cpu::choose_auto_gemm("ZEN", avx2).blis);  // single-target builds report upper case
  CHECK_FALSE(cpu::choose_auto_gemm("Dhyana", avx2).blis);
  CHECK_FALSE(cpu::choose_auto_gemm("SkylakeX", avx512).blis);
  CHECK_FALSE(cpu::choose_auto_gemm("Cooperlake", avx512).blis);
  CHECK_FALSE(cpu::choose_auto_gemm("SapphireRapids", avx512).blis);
  CHECK_FALSE(cpu::choose_auto_gemm("SkylakeX", avx2).blis);
  // AVX2 kernels on an AVX-512 CPU (AMD Zen 4/5, OPENBLAS_CORETYPE=Haswell): BLIS's skx, as before.
  auto zen_on_512 = cpu::choose_auto_gemm("Zen", avx512);
  CHECK(zen_on_512.blis);
  CHECK_THAT(zen_on_512.reason, Catch::Contains("core Zen has no AVX-512 kernels") && Catch::Contains("BLIS (skx)"));
}

TEST_CASE("gemm route: info names OpenBLAS's core and why the route was taken", "[backend][blas]") {
  const std::string info = std::string(MOETRAIN_BINARY_DIR) + "/moetrain info";
  auto plain = moetrain::testing::capture_command("env -u MOETRAIN_GEMM " + info);
  REQUIRE(plain.code == 0);
  CHECK_THAT(plain.output, Catch::Contains("gemm why    auto: OpenBLAS's core "));
  auto forced = moetrain::testing::capture_command("MOETRAIN_GEMM=openblas " + info);
  REQUIRE(forced.code == 0);
  CHECK_THAT(forced.output, Catch::Contains("gemm why    MOETRAIN_GEMM=openblas: OpenBLAS's "));
}
