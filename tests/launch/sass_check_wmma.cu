// The pattern the SASS check (tests/launch/sass_check_test.sh) must reject, compiled
// by the ctest attention_sass_rejects_wmma: tile products as the tensor-core
// attention kernels did before ldmatrix (nvcuda::wmma::load_matrix_sync on
// shared memory reached through a generic pointer carved at a run-time offset,
// which compiles to generic LD.E loads, no LDSM), staged 2 bytes at a time.
#include <cuda_bf16.h>
#include <mma.h>

namespace {

using namespace nvcuda;
using E = __nv_bfloat16;

struct Carved {
  E *X, *Y;
  float* out;
};

__global__ void __launch_bounds__(128) wmma_tiles_kernel(const E* x, const E* y, float* o, int dim, int ld) {
  extern __shared__ __align__(128) unsigned char smem[];
  Carved s{reinterpret_cast<E*>(smem), reinterpret_cast<E*>(smem) + 64 * ld,
           reinterpret_cast<float*>(smem + 2 * 64 * ld * sizeof(E))};
  for (int e = threadIdx.x; e < 64 * dim; e += blockDim.x) {
    s.X[e / dim * ld + e % dim] = x[e];
    s.Y[e / dim * ld + e % dim] = y[e];
  }
  __syncthreads();
  const int w = threadIdx.x / 32;
  for (int j = 0; j < 64; j += 16) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kk = 0; kk < dim; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> a;
      wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> b;
      wmma::load_matrix_sync(a, s.X + 16 * w * ld + kk, ld);
      wmma::load_matrix_sync(b, s.Y + j * ld + kk, ld);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(s.out + 16 * w * 72 + j, acc, 72, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < 64 * 64; e += blockDim.x) o[e] = s.out[e / 64 * 72 + e % 64];
}

}  // namespace

void sass_check_wmma_launch(const E* x, const E* y, float* o, int dim) {
  wmma_tiles_kernel<<<1, 128, 64 * 1024>>>(x, y, o, dim, dim + 8);
}
