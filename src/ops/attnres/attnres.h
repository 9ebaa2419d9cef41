// Block Attention Residuals read (docs/model.md#attnres-read), fused, per token:
//   V   = [b_0, ..., b_{n-1}, p]                 the M = n+1 sources (partial block last)
//   K_m = V_m / sqrt(mean_d V_m[d]^2 + eps)      RMSNorm of each source (no weight)
//   s_m = Σ_d K_m[d] ν[d] w[d]                   w = pseudo-query (`*_res_proj`), ν = key-norm weight (`*_res_norm`)
//   α   = softmax_m(s),   h = Σ_m α_m V_m        values are the RAW sources
// Backward: dp_m = dh·V_m, ds_m = α_m (dp_m − Σ_j α_j dp_j),
//   dV_m = α_m dh + ds_m r_m (u − K_m s_m / D) with u = ν⊙w, r_m = 1/sqrt(mean V_m² + eps),
//   du = Σ_{tokens,m} ds_m K_m,  dw = ν ⊙ du,  dν = w ⊙ du.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// sources: M >= 1 tensors of one shape [..., D]; proj, norm: [D]. Returns [..., D].
Tensor attn_res(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps = 1e-5);

// The softmax weights α [..., M] of the same read, without autograd (diagnostics:
// which depth each token reads from).
Tensor attn_res_weights(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps = 1e-5);

}  // namespace moetrain
