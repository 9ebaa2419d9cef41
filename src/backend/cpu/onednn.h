// oneDNN's matmul for the CPU kernels: bf16 x bf16 -> f32 or bf16 with f32 accumulation
// (the matrix products of train.dtype: bf16 on the CPU), and f32 x f32 -> f32
// (bench/cpu_bench's comparison with the BLIS route). oneDNN picks its kernel by CPU:
// AMX (avx512_core_amx), AVX512-BF16 (avx512_core_bf16), or its own fallback that
// widens bf16 to f32 in registers (AVX-512). Below AVX-512 (AVX2-only CPUs) oneDNN 2.6
// has no bf16 matmul: bf16 products then widen A and B to f32 (exact) and run on the
// f32 GEMM route (backend/cpu/blas.h), C rounded once: the same math, slower.
// `moetrain info` says which.
// Primitives are created once per shape, strides, transposes and dtypes and kept (a
// process-wide cache, thread safe) up to kCachedPrimitives, the least recently used
// dropped past that (an MoE layer's expert row counts change every step); oneDNN's
// own primitive cache is switched off (it would keep what ours drops).
//
// Threads: oneDNN runs on OpenMP (Debian's build); called from inside one of our OpenMP
// regions a matmul runs on the calling thread only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "core/dtype.h"

namespace moetrain::cpu::onednn {

// batch row-major products C_i = op(A_i) op(B_i) (+ C_i when accumulate), i < batch,
// op(X) = X or X^T; A_i = a + i * stride_a (elements; stride 0: the same A for all i),
// likewise B and C (stride_c > 0 when batch > 1). op(A) is [m, k], op(B) [k, n], C [m,
// n]; lda, ldb, ldc are the row strides of A, B, C as stored.
// runtime_m / runtime_k: the primitive takes m (or k) at execution, so one primitive
// serves every value (an MoE expert's row count, m in the forward and data products,
// k in the weight gradient's, changes every step: a primitive per value took 0.15-0.35
// ms to make against 0.006-0.3 ms to run, and filled the cache). oneDNN 2.6 then
// picks its gemm:jit kernel instead of brgemm (5-45% slower to run once made; the
// same bits in the shapes checked: docs/performance.md).
struct MatmulShape {
  bool trans_a = false, trans_b = false;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  bool runtime_m = false, runtime_k = false;
};

// a and b have dtype ab (bf16 or f32), c has dtype c_type (f32, or bf16 for bf16
// inputs: the f32 accumulator rounded once). accumulate: C += op(A) op(B) (in f32,
// rounded once for bf16 C). k == 0 writes zeros (or leaves C when accumulating).
void matmul(const MatmulShape& s, DType ab, const void* a, const void* b, DType c_type, void* c,
            bool accumulate = false);

// Whether oneDNN has a bf16 matmul kernel on this CPU (else the widening above).
bool has_bf16_kernels();

// The CPU ISA oneDNN dispatches to here, e.g. "avx512_core_bf16"
// (dnnl::get_effective_cpu_isa).
std::string effective_isa();
// The implementation oneDNN picks for a bf16 x bf16 -> f32 matmul of [m, k] x [k, n],
// e.g. "brg:avx512_core_amx" or "gemm:jit" (the primitive's impl_info_str).
std::string matmul_impl(int64_t m, int64_t n, int64_t k, DType ab = DType::bf16);
// The cache's bound and its entries now.
inline constexpr size_t kCachedPrimitives = 512;
size_t cached_primitives();
// How many matmul calls ran on each oneDNN implementation (impl_info_str:
// "brg:avx512_core_amx", "brg:avx512_core_bf16", "gemm:jit", ...) since the last
// reset_impl_counts(). oneDNN 2.6 runs a product on AMX only through its brgemm matmul
// ("brg:"), which takes dense operands only (row stride = width); a strided one goes to
// gemm:jit, which never uses AMX. The tests check that the products meant for brgemm
// get there.
std::map<std::string, int64_t> impl_counts();
void reset_impl_counts();
// Whether matmul's primitive for these arguments is in the cache now.
bool is_cached(const MatmulShape& s, DType ab, DType c_type, bool accumulate = false);
// oneDNN's version, e.g. "oneDNN 2.6.3".
std::string version();

}  // namespace moetrain::cpu::onednn
