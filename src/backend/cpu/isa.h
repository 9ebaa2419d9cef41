// The vector ISA of moetrain's own kernel copies that are picked at run time (a
// portable, an AVX2 + FMA and an AVX-512 copy of: the chunked KDA kernels, the tile
// GEMM of small MoE experts, the SiTU-GLU loops). The copies
// round differently (FMA contraction, vector width of the reductions), so the ISA is
// part of what decides the bits of a run (docs/performance.md#reproducibility).
//
// vector_isa() is the widest copy the CPU runs (CPUID), lowered by
//   MOETRAIN_ISA=auto (default) | avx512 | avx2 | generic   a cap, e.g. avx2 on an
//                                 AVX-512 CPU runs the AVX2 copies (compare the paths,
//                                 match an AVX2-only machine's bits);
//   MOETRAIN_GEMM=portable        caps at avx2: the portable route promises the same
//                                 bits on every AVX2 + FMA CPU, so our kernels run
//                                 their AVX2 copies too.
// Read once per process; a bad value throws, naming the variable. run_vector_isa
// below gives any loop such copies (the elementwise, norm, softmax and attention
// kernels). The target_clones copies elsewhere (AdamW, the decay gate: AVX2 or
// generic) are chosen by the loader and follow neither variable.
#pragma once

#include <optional>

namespace moetrain::cpu {

enum class VectorIsa { generic, avx2, avx512 };

VectorIsa vector_isa();
// The best ISA the CPU supports, ignoring the variables.
VectorIsa cpu_vector_isa();
const char* vector_isa_name(VectorIsa isa);  // "generic", "avx2", "avx512"
// Tests: lowers vector_isa() to at most `cap` (nullopt: back to normal), so that one
// process can run every copy the CPU has. Not for use while kernels run on other threads.
void cap_vector_isa_for_testing(std::optional<VectorIsa> cap);

#if defined(__x86_64__) && defined(__GNUC__)
// The targets of the copies (F, VL, BW, DQ, as cpu_vector_isa() checks). flatten inlines
// everything the copy calls, so the inlined code is compiled for its target;
// prefer-vector-width=512: GCC's tuning would otherwise vectorise 256 bits wide.
#define MT_TARGET_AVX2 gnu::target("avx2,fma"), gnu::flatten
#define MT_TARGET_AVX512 gnu::target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512"), gnu::flatten
namespace detail {
template <class F, class... A>
[[MT_TARGET_AVX2]] auto run_avx2(F f, A... a) {
  return f(a...);
}
template <class F, class... A>
[[MT_TARGET_AVX512]] auto run_avx512(F f, A... a) {
  return f(a...);
}
}  // namespace detail
#endif

// f(a...) in the copy for vector_isa(): f and all it calls are inlined into a function
// compiled for that ISA (generic: as built). Pass the arrays as arguments, not lambda
// captures, and take them __restrict in the loop's function: captured pointers may
// alias, and the loop then does not vectorise. Elementwise loops give the same bits in
// every copy that has FMA; reductions as their code orders them (kLanes, ops/common/math.h).
template <class F, class... A>
auto run_vector_isa(F f, A... a) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (vector_isa()) {
    case VectorIsa::avx512:
      return detail::run_avx512(f, a...);
    case VectorIsa::avx2:
      return detail::run_avx2(f, a...);
    case VectorIsa::generic:
      break;
  }
#endif
  return f(a...);
}

}  // namespace moetrain::cpu
