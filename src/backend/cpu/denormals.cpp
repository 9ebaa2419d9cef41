#include "backend/cpu/denormals.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "backend/cpu/parallel.h"
#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MOETRAIN_HAS_MXCSR 1
#else
#define MOETRAIN_HAS_MXCSR 0
#endif

namespace moetrain::cpu {

namespace {
std::atomic<DenormalMode> g_mode{DenormalMode::flush};

#if MOETRAIN_HAS_MXCSR
constexpr unsigned kFtz = 1u << 15;  // MXCSR.FZ: subnormal results are written as zero
constexpr unsigned kDaz = 1u << 6;   // MXCSR.DAZ: subnormal operands are read as zero
#endif

void apply(DenormalMode mode) {
#if MOETRAIN_HAS_MXCSR
  const unsigned csr = _mm_getcsr();
  const unsigned want = mode == DenormalMode::flush ? (csr | kFtz | kDaz) : (csr & ~(kFtz | kDaz));
  if (want != csr) _mm_setcsr(want);
#else
  (void)mode;
#endif
}
}  // namespace

DenormalMode denormal_mode_from_env() {
  const char* v = std::getenv("MOETRAIN_DENORMALS");
  if (!v || !*v) return DenormalMode::flush;
  const std::string s = v;
  MT_CHECK(s == "flush" || s == "keep", "environment variable MOETRAIN_DENORMALS={} is not flush or keep", s);
  return s == "flush" ? DenormalMode::flush : DenormalMode::keep;
}

void set_denormal_mode(DenormalMode mode) {
  g_mode = mode;
  apply(mode);
  // Every worker of the pool: the widest team asked for so far (libgomp keeps its
  // threads between regions; a thread it adds later copies the creator's MXCSR).
  const int width = std::max({num_threads(), omp_get_max_threads(), widest_thread_count()});
  if (width > 1 && !omp_in_parallel()) {
#pragma omp parallel num_threads(width)
    apply(mode);
  }
}

DenormalMode denormal_mode() { return g_mode; }

void apply_denormal_mode_to_this_thread() { apply(g_mode); }

bool this_thread_flushes_denormals() {
#if MOETRAIN_HAS_MXCSR
  return (_mm_getcsr() & (kFtz | kDaz)) == (kFtz | kDaz);
#else
  return false;
#endif
}

const char* denormal_mode_name(DenormalMode mode) { return mode == DenormalMode::flush ? "flush" : "keep"; }

std::string denormal_description() {
  const char* v = std::getenv("MOETRAIN_DENORMALS");
  const DenormalMode mode = denormal_mode();
  std::string what;
  if (!MOETRAIN_HAS_MXCSR)
    what = "not x86-64: subnormals are kept (no FTZ/DAZ set on this architecture)";
  else if (mode == DenormalMode::flush)
    what = "FTZ+DAZ in the main thread and the OpenMP pool: results and inputs below 2^-126 (f32) / 2^-1022 (f64) "
           "are 0";
  else
    what = "subnormals kept (IEEE gradual underflow; slow on Intel CPUs when kernels make them)";
  return fmt::format("{} (MOETRAIN_DENORMALS={}): {}", denormal_mode_name(mode), v && *v ? v : "flush", what);
}

}  // namespace moetrain::cpu
