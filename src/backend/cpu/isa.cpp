#include "backend/cpu/isa.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

#include "core/error.h"

namespace moetrain::cpu {

VectorIsa cpu_vector_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const VectorIsa isa = [] {
    // The AVX-512 copies are compiled for F, VL, BW and DQ (Intel Skylake-SP and later, AMD Zen 4 and later).
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
      return VectorIsa::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return VectorIsa::avx2;
    return VectorIsa::generic;
  }();
  return isa;
#else
  return VectorIsa::generic;
#endif
}

namespace {
std::atomic<int> g_test_cap{-1};  // cap_vector_isa_for_testing; -1: none
}  // namespace

void cap_vector_isa_for_testing(std::optional<VectorIsa> cap) { g_test_cap = cap ? static_cast<int>(*cap) : -1; }

VectorIsa vector_isa() {
  static const VectorIsa isa = [] {
    VectorIsa cap = VectorIsa::avx512;
    const char* v = std::getenv("MOETRAIN_ISA");
    std::string want = v && *v ? v : "auto";
    if (want == "avx2") cap = VectorIsa::avx2;
    else if (want == "generic") cap = VectorIsa::generic;
    else
      MT_CHECK(want == "auto" || want == "avx512",
               "environment variable MOETRAIN_ISA={} is not one of auto, avx512, avx2, generic", want);
    const char* gemm = std::getenv("MOETRAIN_GEMM");
    if (gemm && std::string(gemm) == "portable") cap = std::min(cap, VectorIsa::avx2);
    return std::min(cap, cpu_vector_isa());
  }();
  const int test_cap = g_test_cap.load();
  return test_cap < 0 ? isa : std::min(isa, static_cast<VectorIsa>(test_cap));
}

const char* vector_isa_name(VectorIsa isa) {
  switch (isa) {
    case VectorIsa::avx512:
      return "avx512";
    case VectorIsa::avx2:
      return "avx2";
    case VectorIsa::generic:
      return "generic";
  }
  return "";
}

}  // namespace moetrain::cpu
