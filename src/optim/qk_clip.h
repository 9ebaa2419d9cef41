// QK-Clip (Kimi K2 report §2.1, docs/model.md#qk-clip): after an optimizer step,
// every softmax-attention head h whose largest pre-softmax logit S_max_h passed
// the threshold τ gets γ_h = τ / S_max_h, and its query and key weights are scaled
// so that each of its logits scales by exactly γ_h; heads at or below τ are left
// alone, bit for bit. Functions on tensors, in place (the trailing underscore, as
// copy_); the statistic, the all-reduce over replicas and the call after the step
// belong to the trainer and the attention kernels (not wired yet).
//
// Row layouts, moetrain's [out, in] weights (src/nn):
//   MLA (src/nn/mla.cpp), H heads, dn = qk_nope_head_dim, dr = qk_rope_head_dim,
//   dv = v_head_dim:
//     q_b_proj.weight [H·(dn+dr), r_q] (q_proj.weight [H·(dn+dr), D] without query
//     LoRA): head h's rows start at h·(dn+dr): dn non-rotary rows, then dr rotary.
//     kv_b_proj.weight [H·(dn+dv), r_kv]: head h's rows start at h·(dn+dv): dn k_nope
//     rows, then dv value rows.
//     Clipped head: non-rotary query rows and k_nope rows × √γ, rotary query rows
//     × γ; value rows and the shared rotary key (kv_a_proj_with_mqa) untouched:
//     q_nope·k_nope gains √γ·√γ, q_rot·k_rot gains γ (RoPE is linear, so the
//     rotation commutes with the scale).
//   Plain multi-head attention, hd = D / H:
//     separate projections (src/nn/attention_mixer.cpp self_attn.q_proj.weight and
//     k_proj.weight [D, D], no bias): head h's rows [h·hd, (h+1)·hd) of each × √γ;
//     GPT-2's fused attn.c_attn.weight [3D, D] (Hugging Face's Conv1D [D, 3D] is
//     transposed on import, src/nn/gpt2_hf.cpp) and attn.c_attn.bias [3D]: rows and
//     bias entries [h·hd, (h+1)·hd) (query) and [D + h·hd, D + (h+1)·hd) (key) × √γ;
//     the value third [2D, 3D) untouched. The biases are scaled with their rows, so
//     q = x W_qᵀ + b_q scales by √γ exactly.
// f32 and f64 weights are scaled in their dtype; a bf16 weight in f32, rounded once
// (under mixed precision scale the f32 master and round the bf16 copy from it, as
// the optimizers do, rather than scaling the bf16 copy).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "nn/language_model.h"

namespace moetrain {

// γ_h = min(1, τ / S_max_h) for max_logit S_max [H] (any float dtype and device):
// exactly 1 for a head with S_max ≤ τ (including −∞: no logit seen). τ must be
// finite and > 0 (Error naming `tau`); a NaN or +∞ S_max throws NumericalError
// naming the head.
std::vector<double> qk_clip_factors(const Tensor& max_logit, double tau);

// MlaHeadDims (H, dn, dr, dv): nn/language_model.h, beside the QkClipSite that carries it.

// Each γ_h must be in (0, 1] (from qk_clip_factors); heads with γ_h == 1 are not
// touched. The functions return how many heads they scaled. Shapes are checked
// against the layout above (Error naming the weight and the expected shape).
int64_t qk_clip_mla_(const Tensor& q_weight, const Tensor& kv_b_weight, const std::vector<double>& gamma,
                     const MlaHeadDims& dims);
// Separate query and key projections [H·hd, in] with optional biases [H·hd].
int64_t qk_clip_mha_(const Tensor& q_weight, const Tensor& k_weight, const std::vector<double>& gamma,
                     int64_t n_head, const Tensor& q_bias = {}, const Tensor& k_bias = {});
// GPT-2's fused c_attn: weight [3D, in], bias [3D] or undefined.
int64_t qk_clip_fused_qkv_(const Tensor& c_attn_weight, const Tensor& c_attn_bias, const std::vector<double>& gamma,
                           int64_t n_head);

}  // namespace moetrain
