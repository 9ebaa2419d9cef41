// Shared pieces of the CPU benchmarks: the machine's own FMA peak measured in the
// same process, per-step resource use (kernel time, page faults) from getrusage,
// and the PyTorch baselines run as /usr/bin/python3 scripts under bench/.
#pragma once

#include <immintrin.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "backend/cpu/parallel.h"

namespace moetrain::bench {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Independent FMA chains, enough to cover the FMA latency (4-5 cycles) on both
// FMA ports: what the core can do at best, with no memory traffic.
constexpr int kFmaChains = 12;

__attribute__((target("avx2,fma"))) inline double fma_loop_avx2(int64_t iters) {
  __m256 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_set1_ps(0.001f * static_cast<float>(c));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  __m256 s = acc[0];
  for (int c = 1; c < kFmaChains; ++c) s = _mm256_add_ps(s, acc[c]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0];
}

__attribute__((target("avx512f"))) inline double fma_loop_avx512(int64_t iters) {
  __m512 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_set1_ps(0.001f * static_cast<float>(c));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  __m512 s = acc[0];
  for (int c = 1; c < kFmaChains; ++c) s = _mm512_add_ps(s, acc[c]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0];
}

struct FmaPeak {
  double gflops = 0;      // f32, all threads
  const char* isa = "";   // the vector width the probe used (chosen by CPUID)
};

// f32 FMA peak of `threads` threads running the probe at once: best of 5 runs of ~50 ms.
inline FmaPeak fma_peak(int threads) {
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  FmaPeak p;
  p.isa = avx512 ? "avx512f" : avx2 ? "avx2+fma" : "none";
  if (!avx512 && !avx2) return p;
  const int lanes = avx512 ? 16 : 8;
  const int64_t iters = 2'000'000;
  std::vector<double> sink(static_cast<size_t>(threads));  // keeps the loops' results alive
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      double r = avx512 ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
      sink[static_cast<size_t>(omp_get_thread_num())] += r;
    }
    double sec = seconds_since(t0);
    p.gflops = std::max(p.gflops, 2.0 * lanes * kFmaChains * static_cast<double>(iters) * threads / sec / 1e9);
  }
  if (std::isnan(sink[0])) std::fputs("", stderr);
  return p;
}

// Process resource use between two points: kernel (system) time and minor page faults.
struct Usage {
  double user_s = 0, sys_s = 0;
  long minor_faults = 0;
  static Usage now() {
    rusage r{};
    getrusage(RUSAGE_SELF, &r);
    Usage u;
    u.user_s = static_cast<double>(r.ru_utime.tv_sec) + 1e-6 * static_cast<double>(r.ru_utime.tv_usec);
    u.sys_s = static_cast<double>(r.ru_stime.tv_sec) + 1e-6 * static_cast<double>(r.ru_stime.tv_usec);
    u.minor_faults = r.ru_minflt;
    return u;
  }
  Usage operator-(const Usage& o) const { return {user_s - o.user_s, sys_s - o.sys_s, minor_faults - o.minor_faults}; }
};

// Runs a PyTorch baseline script (bench/<script> args) with /usr/bin/python3 and
// returns the number on its "torch_ms_per_step <ms>" line; -1 when it failed.
inline double torch_ms(const std::string& script_and_args) {
  std::string cmd = fmt::format("/usr/bin/python3 {}/bench/{}", MOETRAIN_SOURCE_DIR, script_and_args);
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  char line[256] = {0};
  double ms = -1;
  while (std::fgets(line, sizeof line, p))
    if (std::sscanf(line, "torch_ms_per_step %lf", &ms) == 1) break;
  pclose(p);
  return ms;
}

}  // namespace moetrain::bench
