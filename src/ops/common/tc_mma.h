// The tensor-core tile seam shared by the bodies written once for the GPU and
// the host (ops/common/simt.h): attention_tc.h (causal attention) and
// moe/grouped_gemm_tc.h (the MoE experts' grouped GEMM). A 16x16x16 tile product
// takes bf16 operands from shared memory and sums in f32. The seam: which row
// of shared memory each lane hands ldmatrix (tc_ldsm_*), which (row, col) each
// accumulator register holds (tc_acc_cell), and two implementations of the
// instructions: DeviceMma (ldmatrix, mma.sync, cp.async on sm_80+) and HostMma
// (a lane-by-lane model of those instructions written from the PTX ISA's
// fragment tables), so host tests check the lane maps, not only the arithmetic
// (docs/cuda.md, "Attention on tensor cores" and "Grouped expert GEMM on tensor
// cores"). Also here: shared-memory carving (Carver) and a warp's register
// accumulators (TcFrags, tc_zero_frags, tc_store_frags).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "ops/common/simt.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <mma.h>
#endif

namespace moetrain::simt {

// Every shared row is padded by kTcPad elements (docs/cuda.md, "Attention on tensor
// cores"): 16 bytes on a bf16 row, 32 on an f32 row. With dim a multiple of 16,
// a row of dim + 8 elements is an odd multiple of 4 banks (bf16) or of 8 banks
// (f32) modulo 32, so 8 consecutive bf16 rows start in the 8 different groups of
// 4 banks (4 f32 rows in the 4 groups of 8): the rows a tile access reads
// together fall on different banks. dim + 8 is still a multiple of 8 elements
// (ldmatrix's 16-byte rows, cp.async's 16-byte copies) and every tile 32-byte aligned. kTcPad = 0 gives the unpadded
// layout, which the bank tests compare with.
inline constexpr int kTcPad = 8;

// The tile products: 16x16x16, bf16 operands in shared memory, f32
// accumulators in registers, as two PTX mma.m16n8k16 (the left and right 8
// columns of the tile) on operands loaded by ldmatrix.x4 (docs/cuda.md,
// "Attention on tensor cores"). The body side of the seam is below: which row
// of shared memory each lane hands ldmatrix (tc_ldsm_*) and which (row, col)
// each accumulator register holds (tc_acc_cell). DeviceMma feeds these to the
// hardware; HostMma feeds them to a model of the hardware written from the PTX
// ISA's fragment tables, so the host tests check the lane maps, not only the
// arithmetic.
struct TcRC {
  int row, col;
};
// ldmatrix.x4 loads four 8x8 bf16 matrices; lane l gives the address of row l % 8
// of matrix l / 8 (16 bytes), and register m of every lane receives matrix m.
// A (row-major, (i, k) at p[i * ld + k]): matrices (rows i, columns k) 0-7/0-7,
// 8-15/0-7, 0-7/8-15, 8-15/8-15 = mma's a0..a3.
MT_HOST_DEVICE inline TcRC tc_ldsm_a(int lane) { return {lane % 16, 8 * (lane / 16)}; }
// B given as Bᵀ ((k, j) at p[j * ld + k]), loaded as stored: matrices (rows j,
// columns k) 0-7/0-7, 0-7/8-15, 8-15/0-7, 8-15/8-15 = b0, b1 of the left 8
// columns, then b0, b1 of the right 8.
MT_HOST_DEVICE inline TcRC tc_ldsm_bt(int lane) {
  const int m = lane / 8;
  return {lane % 8 + 8 * (m / 2), 8 * (m % 2)};
}
// B row-major ((k, j) at p[k * ld + j]), loaded transposed (.trans): matrices
// (rows k, columns j) 0-7/0-7, 8-15/0-7, 0-7/8-15, 8-15/8-15, the same registers.
MT_HOST_DEVICE inline TcRC tc_ldsm_b(int lane) {
  const int m = lane / 8;
  return {lane % 8 + 8 * (m % 2), 8 * (m / 2)};
}
// A column-major ((i, k) at p[k * ld + i]: Aᵀ stored row-major, as the
// weight gradient's dyᵀ is, staged as rows of dy), loaded transposed (.trans).
// With .trans, lane t receives element (row 2(t % 4) + h, column t / 4) of a
// stored 8x8 matrix; mma's a_m wants A (g = t / 4, 2(t % 4) + h) of its
// submatrix, which is stored at (row k, column i) = (2(t % 4) + h, g): so
// matrix m must be stored rows k, columns i of a_m's submatrix: a0 (i 0-7,
// k 0-7) at rows 0-7 / columns 0-7, a1 (i 8-15, k 0-7) at rows 0-7 / columns
// 8-15, a2 (i 0-7, k 8-15) at rows 8-15 / columns 0-7, a3 at rows 8-15 /
// columns 8-15 (row = k, col = i below). The same addresses as tc_ldsm_bt's:
// B given as Bᵀ and A given as Aᵀ are both the other operand's layout.
MT_HOST_DEVICE inline TcRC tc_ldsm_at(int lane) {
  const int m = lane / 8;
  return {lane % 8 + 8 * (m / 2), 8 * (m % 2)};
}
// Accumulator register e (0..7) of lane l: e / 4 picks the left or right 8
// columns, e % 4 is mma's c0..c3 there (c0, c1 on row l / 4, c2, c3 eight rows below).
MT_HOST_DEVICE inline TcRC tc_acc_cell(int lane, int e) {
  return {lane / 4 + 8 * ((e / 2) % 2), 8 * (e / 4) + 2 * (lane % 4) + e % 2};
}
inline constexpr int kTcAccRegs = 8;  // f32 registers of a lane in one 16x16 accumulator

// The host's tensor core, lane by lane: a tile is what each of the 32 lanes
// holds (operands already rounded to bf16, held as float); the products are in
// f32 in k order (the GPU's order inside a tile is its own).
struct HostMma {
  using E = float;  // an operand in shared memory
  struct Tile {
    float v[32][8];  // lane's registers 0..3, two bf16 each: v[lane][2 * reg + half]
  };
  using TileA = Tile;
  using TileBt = Tile;
  using TileB = Tile;
  struct Acc {
    float v[32][kTcAccRegs];
  };

  static E operand(float f) { return moetrain::bf16::from_float(f).to_float(); }
  // ldmatrix.x4 (PTX ISA, "ldmatrix"): rows[8m + r] is row r of matrix m; lane t
  // receives row t / 4, elements 2(t % 4) and +1 of each matrix (with .trans,
  // column t / 4, rows 2(t % 4) and +1).
  static void ldmatrix(Tile& t, const float* const* rows, bool trans) {
    for (int m = 0; m < 4; ++m)
      for (int lane = 0; lane < 32; ++lane)
        for (int h = 0; h < 2; ++h)
          t.v[lane][2 * m + h] =
              trans ? rows[8 * m + 2 * (lane % 4) + h][lane / 4] : rows[8 * m + lane / 4][2 * (lane % 4) + h];
  }
  template <class Map>
  static void load(Tile& t, const E* p, int ld, Map map, bool trans) {
    const float* rows[32];
    for (int lane = 0; lane < 32; ++lane) {
      const TcRC c = map(lane);
      rows[lane] = p + c.row * ld + c.col;
    }
    ldmatrix(t, rows, trans);
  }
  static void load_a(TileA& t, const E* p, int ld) { load(t, p, ld, tc_ldsm_a, false); }
  static void load_bt(TileBt& t, const E* p, int ld) { load(t, p, ld, tc_ldsm_bt, false); }
  static void load_b(TileB& t, const E* p, int ld) { load(t, p, ld, tc_ldsm_b, true); }
  static void load_at(TileA& t, const E* p, int ld) { load(t, p, ld, tc_ldsm_at, true); }
  static void zero(Acc& t) {
    for (auto& lane : t.v)
      for (float& x : lane) x = 0.0f;
  }
  static void load_acc(Acc& t, const float* p, int ld) {
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < kTcAccRegs; ++e) {
        const TcRC c = tc_acc_cell(lane, e);
        t.v[lane][e] = p[c.row * ld + c.col];
      }
  }
  static void store_acc(float* p, const Acc& t, int ld) {
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < kTcAccRegs; ++e) {
        const TcRC c = tc_acc_cell(lane, e);
        p[c.row * ld + c.col] = t.v[lane][e];
      }
  }
  // Row r of the tile times f[r] (the forward's online-softmax rescale).
  static void scale_rows(Acc& d, const float* f) {
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < kTcAccRegs; ++e) d.v[lane][e] *= f[tc_acc_cell(lane, e).row];
  }
  // D += A B as two mma.m16n8k16.row.col (PTX ISA, "Matrix Fragments for
  // mma.m16n8k16", written here apart from the lane maps above): with g = lane / 4,
  // c = lane % 4, A's register r holds (g + 8(r % 2), 2c + 8(r / 2)) and the next
  // column; B's b0 (k = 2c, 2c + 1; n = g) and b1 (k + 8) of the n-th 8 columns
  // are registers 2n and 2n + 1; C's c0, c1 (g, 2c and + 1) and c2, c3 (g + 8).
  static void mma(Acc& d, const Tile& a, const Tile& b) {
    float A[16][16], B[16][16], C[16][16];
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      for (int r = 0; r < 4; ++r)
        for (int h = 0; h < 2; ++h) A[g + 8 * (r % 2)][2 * c + h + 8 * (r / 2)] = a.v[lane][2 * r + h];
      for (int n = 0; n < 2; ++n) {
        for (int r = 0; r < 2; ++r)
          for (int h = 0; h < 2; ++h) B[2 * c + h + 8 * r][g + 8 * n] = b.v[lane][2 * (2 * n + r) + h];
        for (int i = 0; i < 4; ++i) C[g + 8 * (i / 2)][8 * n + 2 * c + i % 2] = d.v[lane][4 * n + i];
      }
    }
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) {
        float s = C[i][j];
        for (int k = 0; k < 16; ++k) s += A[i][k] * B[k][j];
        C[i][j] = s;
      }
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, c = lane % 4;
      for (int n = 0; n < 2; ++n)
        for (int i = 0; i < 4; ++i) d.v[lane][4 * n + i] = C[g + 8 * (i / 2)][8 * n + 2 * c + i % 2];
    }
  }
  // Staging: 8 consecutive elements (one 16-byte asynchronous copy on the GPU).
  template <class T>
  static void copy8(E* dst, const T* src) {
    for (int i = 0; i < 8; ++i) dst[i] = src[i].to_float();
  }
  static void zero8(E* dst) {
    for (int i = 0; i < 8; ++i) dst[i] = 0.0f;
  }
  static void copy_wait() {}
};

inline float widen(moetrain::bf16 x) { return x.to_float(); }
inline void narrow(moetrain::bf16& dst, float f) { dst = moetrain::bf16::from_float(f); }

#if defined(__CUDACC__)
// The GPU's (sm_80 and later): ldmatrix from shared memory (addresses in the
// .shared window, __cvta_generic_to_shared, so they compile to LDSM), mma.sync
// (HMMA.16816.F32.BF16), 8-byte accumulator loads and stores, cp.async staging.
// Warp-collective; rows 16-byte aligned (row strides multiples of 8 elements).
struct DeviceMma {
  using E = __nv_bfloat16;
  struct Tile {
    uint32_t r[4];
  };
  using TileA = Tile;
  using TileBt = Tile;
  using TileB = Tile;
  struct Acc {
    float x[kTcAccRegs];
  };

  __device__ static int lane() { return static_cast<int>(threadIdx.x & 31); }
  __device__ static uint32_t shared_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
  }
  __device__ static E operand(float f) { return __float2bfloat16_rn(f); }
  __device__ static void ldmatrix(Tile& t, const E* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(t.r[0]), "=r"(t.r[1]), "=r"(t.r[2]), "=r"(t.r[3])
                 : "r"(shared_address(row)));
  }
  __device__ static void ldmatrix_trans(Tile& t, const E* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(t.r[0]), "=r"(t.r[1]), "=r"(t.r[2]), "=r"(t.r[3])
                 : "r"(shared_address(row)));
  }
  __device__ static void load_a(TileA& t, const E* p, int ld) {
    const TcRC c = tc_ldsm_a(lane());
    ldmatrix(t, p + c.row * ld + c.col);
  }
  __device__ static void load_bt(TileBt& t, const E* p, int ld) {
    const TcRC c = tc_ldsm_bt(lane());
    ldmatrix(t, p + c.row * ld + c.col);
  }
  __device__ static void load_b(TileB& t, const E* p, int ld) {
    const TcRC c = tc_ldsm_b(lane());
    ldmatrix_trans(t, p + c.row * ld + c.col);
  }
  __device__ static void load_at(TileA& t, const E* p, int ld) {
    const TcRC c = tc_ldsm_at(lane());
    ldmatrix_trans(t, p + c.row * ld + c.col);
  }
  __device__ static void zero(Acc& t) {
#pragma unroll
    for (int e = 0; e < kTcAccRegs; ++e) t.x[e] = 0.0f;
  }
  // Registers e and e + 1 are two adjacent columns: one 8-byte access.
  __device__ static void load_acc(Acc& t, const float* p, int ld) {
#pragma unroll
    for (int e = 0; e < kTcAccRegs; e += 2) {
      const TcRC c = tc_acc_cell(lane(), e);
      const float2 x = *reinterpret_cast<const float2*>(p + c.row * ld + c.col);
      t.x[e] = x.x;
      t.x[e + 1] = x.y;
    }
  }
  __device__ static void store_acc(float* p, const Acc& t, int ld) {
#pragma unroll
    for (int e = 0; e < kTcAccRegs; e += 2) {
      const TcRC c = tc_acc_cell(lane(), e);
      *reinterpret_cast<float2*>(p + c.row * ld + c.col) = make_float2(t.x[e], t.x[e + 1]);
    }
  }
  __device__ static void scale_rows(Acc& d, const float* f) {
#pragma unroll
    for (int e = 0; e < kTcAccRegs; ++e) d.x[e] *= f[tc_acc_cell(lane(), e).row];
  }
  __device__ static void mma(Acc& d, const Tile& a, const Tile& b) {
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      float* c = d.x + 4 * n;
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
          : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[2 * n]), "r"(b.r[2 * n + 1]));
    }
  }
  // 16 bytes global -> shared without passing through registers (cp.async.cg:
  // cached in L2 only); copy_wait() waits for this thread's copies.
  __device__ static void copy8(E* dst, const __nv_bfloat16* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
                 "l"(__cvta_generic_to_global(src)));
  }
  __device__ static void zero8(E* dst) { *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0); }
  __device__ static void copy_wait() {
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
};

__device__ inline float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline void narrow(__nv_bfloat16& dst, float f) { dst = __float2bfloat16_rn(f); }
#endif

// Carves a kernel's shared memory into arrays (128-byte aligned). With a null
// base it only counts: the launcher sizes the allocation with the same code.
struct Carver {
  unsigned char* base;
  size_t used = 0;
  template <class X>
  MT_HOST_DEVICE X* take(int64_t count) {
    used = (used + 127) / 128 * 128;
    X* p = base ? reinterpret_cast<X*>(base + used) : nullptr;
    used += static_cast<size_t>(count) * sizeof(X);
    return p;
  }
};

// Warp w's N accumulator fragments: 16 rows by 16N columns. Indexed only
// with compile-time indices (unrolled loops): registers on the GPU.
template <class M, int N>
struct TcFrags {
  typename M::Acc f[N];
};
template <class M>
struct TcFrags<M, 0> {};  // the shared path: its accumulators are in shared memory

MT_SIMT_BODY
template <class M, int N>
MT_HOST_DEVICE void tc_zero_frags(TcFrags<M, N>& acc) {
MT_UNROLL
  for (int j = 0; j < N; ++j) M::zero(acc.f[j]);
}

// Warp w's fragments out through `scratch` (its 16 rows of stride ld_s, 64
// columns): four fragments at a time stored, then the lanes walk each row
// (lane on columns lane, lane + 32) calling put(row, col, value), row and
// col within the warp's 16 x 16N block.
MT_SIMT_BODY
template <class M, int N, class Blk, class Put>
MT_HOST_DEVICE void tc_store_frags(const Blk& blk, TcFrags<M, N>& acc, float* scratch, int ld_s, Put&& put) {
MT_UNROLL
  for (int j0 = 0; j0 < N; j0 += 4) {
MT_UNROLL
    for (int jj = 0; jj < 4; ++jj)
      if (j0 + jj < N) M::store_acc(scratch + 16 * jj, acc.f[j0 + jj], ld_s);
    blk.warp_sync();  // the fragments' elements are other lanes' stores
    const int cols = 16 * (N - j0 < 4 ? N - j0 : 4);
    blk.lanes([&](int lane) {
      for (int r = 0; r < 16; ++r)
        for (int c = lane; c < cols; c += 32) put(r, 16 * j0 + c, scratch[r * ld_s + c]);
    });
  }
}
MT_HOST_DEVICE inline int64_t min_i(int64_t a, int64_t b) { return a < b ? a : b; }
MT_HOST_DEVICE inline int64_t max_i(int64_t a, int64_t b) { return a > b ? a : b; }

// A cell of a [rows][dim] tile: element e (tc_cell) or 8-element chunk e
// (tc_chunk: one 16-byte staging copy) in row-major order.
struct TcCell {
  int row, col;
};
MT_HOST_DEVICE inline TcCell tc_cell(int e, int dim) { return {e / dim, e % dim}; }
inline constexpr int kTcChunk = 8;  // elements of one staging copy (16 bytes of bf16)
MT_HOST_DEVICE inline TcCell tc_chunk(int e, int dim) {
  return {e / (dim / kTcChunk), e % (dim / kTcChunk) * kTcChunk};
}

// Whether src is 16-byte aligned: then every staged row whose length is a
// multiple of 8 elements can be copied 16 bytes at a time (the bodies decide
// the rows' part).
template <class T>
MT_HOST_DEVICE bool tc_aligned16(const T* src) {
  return reinterpret_cast<uintptr_t>(src) % 16 == 0;
}

}  // namespace moetrain::simt
