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
// Read once per process; a bad value throws, naming the variable. (The target_clones
// copies of the other elementwise kernels, AVX2 or generic, are chosen by the loader
// and follow neither variable; they have no AVX-512 copy.)
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

}  // namespace moetrain::cpu
