// The KDA benchmark case shared by bench/kda_bench.cpp and bench/cpu_bench.cpp:
// B = 1, H = HV = 4, K = V = 64 (cpu_bench also 128), chunk 64, f32; q/k unit rows (as
// the layer passes them), g in the K3 lower-bound gate range (-5, 0).
//
// FLOP models (2 per multiply-add), per head:
//   recurrent, per token: forward 7KV; backward 23KV (segment recomputation 7KV, BPTT 16KV).
//   chunked, per chunk of C: 16C²K + 14C²V + 20CKV + 14C³/3 (in-chunk matrices A^kk, A^qk, M, W
//   counted as dense matmuls, built twice: forward and backward recomputation).
#pragma once

#include "moetrain.h"

namespace moetrain::bench {

constexpr int64_t kKdaB = 1, kKdaH = 4, kKdaK = 64, kKdaV = 64, kKdaC = 64;

inline double kda_recurrent_flops(int64_t T) { return 30.0 * kKdaK * kKdaV * T * kKdaB * kKdaH; }
inline double kda_chunked_flops(int64_t T, int64_t K = kKdaK, int64_t V = kKdaV) {
  double c = kKdaC, k = static_cast<double>(K), v = static_cast<double>(V);
  double per_chunk = 16 * c * c * k + 14 * c * c * v + 20 * c * k * v + 14.0 / 3.0 * c * c * c;
  return per_chunk * static_cast<double>((T + kKdaC - 1) / kKdaC) * kKdaB * kKdaH;
}

struct KdaInputs {
  Tensors leaves;  // q, k, v, g, beta (requires grad)
  Tensor grad_o, grad_state;
};

inline KdaInputs make_kda_inputs(int64_t T, int64_t K = kKdaK, int64_t V = kKdaV) {
  Tensor q = randn({kKdaB, T, kKdaH, K}, DType::f32, 1), k = randn({kKdaB, T, kKdaH, K}, DType::f32, 2);
  q = div(q, sqrt(sum(square(q), -1, true)));
  k = div(k, sqrt(sum(square(k), -1, true)));
  Tensor v = randn({kKdaB, T, kKdaH, V}, DType::f32, 3);
  Tensor g = mul_scalar(sigmoid(randn({kKdaB, T, kKdaH, K}, DType::f32, 4)), -5.0);
  Tensor beta = sigmoid(randn({kKdaB, T, kKdaH}, DType::f32, 5));
  KdaInputs in;
  for (Tensor t : {q, k, v, g, beta}) {
    t = t.detach().clone();
    t.set_requires_grad(true);
    in.leaves.push_back(t);
  }
  in.grad_o = randn({kKdaB, T, kKdaH, V}, DType::f32, 6);
  in.grad_state = randn({kKdaB, kKdaH, K, V}, DType::f32, 7);
  return in;
}

}  // namespace moetrain::bench
