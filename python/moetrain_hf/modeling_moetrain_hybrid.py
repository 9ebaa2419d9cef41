# coding=utf-8
"""moetrain's hybrid decoder (model_type "moetrain_hybrid") for Hugging Face transformers:
plain PyTorch, CPU or GPU, loaded with trust_remote_code=True from a `moetrain export`
directory (which carries this file and configuration_moetrain_hybrid.py, named by auto_map).

Every layer computes what moetrain computes (docs/model.md of the moetrain repository; the
section names below are its anchors), on the tensors of config.json's layout
(docs/export.md, "The hybrid"):
  * token mixers: KDA (softplus or lower-bound decay gate, low-rank or full-rank output gate,
    grouped value heads), DeltaNet, Gated DeltaNet, linear attention (#kda-layer,
    #other-token-mixers), gated MLA (query LoRA or not, NoPE or RoPE, output gate; #gated-mla)
    and plain causal attention;
  * FFN: SiTU-GLU (fixed or learnable beta, optional linear cap), SwiGLU, GELU (#situ-glu);
  * MoE (#moe): sigmoid or softmax router, the selection bias (e_score_correction_bias, selection
    only), group-limited selection, renormalisation for top_k > 1, routed_scaling_factor, expert
    capacity, latent experts with their norm, shared experts;
  * the plain pre-norm residual stream or Block AttnRes (#block-attnres);
  * tied or untied head.
Decoding keeps per layer a constant-size state for the recurrent mixers (the last W-1 conv
inputs and the [K, V] state per value head) and the latent (MLA) or K/V (attention) per token;
a sequence decoded with the cache equals the one computed without it up to f32 rounding.

Batches must be unpadded (every row the same length): moetrain has no padding mask, and an
attention_mask with zeros is refused rather than ignored.
"""
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import transformers
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

try:
    from .configuration_moetrain_hybrid import MoetrainHybridConfig
except ImportError:  # loaded as a plain module (tests)
    # Not spelled `from configuration_moetrain_hybrid import ...`: transformers 4's check of a
    # remote-code file's imports would demand a package of that name.
    import importlib
    MoetrainHybridConfig = importlib.import_module("configuration_moetrain_hybrid").MoetrainHybridConfig

_TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])


# ---------------------------------------------------------------------------- #norms

def rms_norm(x, weight, eps):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dim, computed in f32 (f64 for f64 x)."""
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dt)
    return y.to(x.dtype)


def l2_norm(x, eps=1e-6):
    """x / sqrt(sum x^2 + eps) over the last dim (eps inside the root, not scaled by the dim)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def softplus(x):
    """log(1 + e^x) for every x, without torch's threshold shortcut."""
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-torch.abs(x)))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def situ_glu(gate, up, beta, linear_beta):
    """#situ-glu: beta tanh(gate/beta) sigmoid(gate) * (lambda tanh(up/lambda) or up)."""
    a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    u = linear_beta * torch.tanh(up / linear_beta) if linear_beta else up
    return a * u


class MoetrainRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def _linear(n_in, n_out):
    return nn.Linear(n_in, n_out, bias=False)


# ---------------------------------------------------------------------------- cache

class MoetrainHybridCache:
    """The decoding state of every layer (docs/model.md#kda-layer, #gated-mla): per layer a
    dict (conv_q/conv_k/conv_v [B, W-1, P], state [B, HV, K, V] for the KDA family; state
    [B, H, K, K+1] for linear attention; c [B, T, r_kv], kr [B, T, d_r] for MLA; k, v for
    attention) and `tokens`, the positions seen."""

    is_compileable = False

    def __init__(self, num_layers):
        self.layers = [dict() for _ in range(num_layers)]
        self.tokens = 0

    def get_seq_length(self, layer_idx=0):
        return self.tokens

    def get_max_length(self):
        return None

    def reorder_cache(self, beam_idx):
        for d in self.layers:
            for k, t in d.items():
                d[k] = t.index_select(0, beam_idx.to(t.device))
        return self

    def __len__(self):
        return len(self.layers)


# ---------------------------------------------------------------------------- #kda-layer

def short_conv(x, weight, cache, key):
    """#short-convolution: c[t] = sum_i w[:, i] x[t - (W-1) + i], zeros before the first token
    (or the cached last W-1 inputs); x [B, T, P], weight [P, 1, W]."""
    B, T, P = x.shape
    W = weight.shape[-1]
    w = weight.reshape(P, W).to(x.dtype)
    prev = cache.get(key) if cache is not None else None
    if prev is None:
        prev = x.new_zeros(B, W - 1, P)
    full = torch.cat([prev, x], 1)                                   # [B, W-1+T, P]
    y = sum(w[:, i] * full[:, i:i + T] for i in range(W))
    if cache is not None:
        cache[key] = full[:, full.shape[1] - (W - 1):].detach().clone()
    return y


def delta_rule_recurrent(q, k, v, g, beta, scale, state):
    """#kda-recurrent-form, one token at a time. q, k [B, T, HV, K] (already repeated for GVA),
    v [B, T, HV, V], g [B, T, HV, K] log decays or None, beta [B, T, HV]; state [B, HV, K, V].
    Returns o [B, T, HV, V] and the final state."""
    T = q.shape[1]
    outs = []
    S = state
    for t in range(T):
        if g is not None:
            S = torch.exp(g[:, t]).unsqueeze(-1) * S                   # decay first
        kt = k[:, t]
        delta = v[:, t] - torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + (beta[:, t, :, None] * kt).unsqueeze(-1) * delta.unsqueeze(-2)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))  # reads the updated state
    return torch.stack(outs, 1), S


def delta_rule_chunked(q, k, v, g, beta, scale, state, chunk_size):
    """#kda-chunked-forward: the recurrence reorganised per chunk of C rows (WY / UT form).
    Same arguments as delta_rule_recurrent. Exponents are only formed as e^(gamma_i - gamma_j)
    for j <= i (#kda-exponent-rule), so strong decays never overflow."""
    B, T, HV, K = q.shape
    qh, kh, vh = (t.transpose(1, 2) for t in (q * scale, k, v))     # [B, HV, T, .]
    gh = g.transpose(1, 2) if g is not None else None
    bh = beta.transpose(1, 2)                                        # [B, HV, T]
    S = state
    outs = []
    for s0 in range(0, T, chunk_size):
        s1 = min(T, s0 + chunk_size)
        L = s1 - s0
        Q, Kc, V, b = qh[:, :, s0:s1], kh[:, :, s0:s1], vh[:, :, s0:s1], bh[:, :, s0:s1]
        gamma = torch.cumsum(gh[:, :, s0:s1], 2) if gh is not None else torch.zeros_like(Kc)  # [B, HV, L, K]
        diff = gamma.unsqueeze(3) - gamma.unsqueeze(2)               # [B, HV, L(i), L(j), K]: gamma_i - gamma_j
        lower = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        strict = lower.clone().fill_diagonal_(False)
        decay = torch.exp(torch.where(lower[:, :, None], diff, torch.full_like(diff, -math.inf)))
        E = torch.einsum("bhid,bhjd,bhijd->bhij", Kc, Kc, decay) * strict
        Aqk = torch.einsum("bhid,bhjd,bhijd->bhij", Q, Kc, decay)
        Akk = b.unsqueeze(-1) * E
        eye = torch.eye(L, dtype=q.dtype, device=q.device)
        Tm = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(b), upper=False, unitriangular=True)
        eg = torch.exp(gamma)
        Wm = Tm @ (Kc * eg)
        U = Tm @ V
        Vnew = U - Wm @ S
        outs.append((Q * eg) @ S + Aqk @ Vnew)
        gC = gamma[:, :, -1:]                                        # [B, HV, 1, K]
        S = torch.exp(gC).transpose(-1, -2) * S + (Kc * torch.exp(gC - gamma)).transpose(-1, -2) @ Vnew
    return torch.cat(outs, 2).transpose(1, 2), S


class MoetrainDeltaMixer(nn.Module):
    """The KDA layer (#kda-layer) and its lower rungs on the same kernels (#other-token-mixers):
    decay "per_channel" (KDA), "per_head" (Gated DeltaNet) or "none" (DeltaNet)."""

    def __init__(self, config, decay):
        super().__init__()
        D = config.hidden_size
        H, HV, K, W = config.kda_num_heads, config.kda_num_value_heads, config.kda_head_dim, config.kda_conv_size
        if HV % H != 0:
            raise ValueError("moetrain_hybrid: %d KDA value heads is not a multiple of %d heads" % (HV, H))
        self.H, self.HV, self.K, self.decay = H, HV, K, decay
        self.lower_bound = config.kda_gate_lower_bound
        self.norm_eps = config.rms_norm_eps
        self.mode, self.chunk_size = config.kda_mode, config.kda_chunk_size
        self.q_proj, self.k_proj, self.v_proj = _linear(D, H * K), _linear(D, H * K), _linear(D, HV * K)
        self.q_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.k_conv1d = nn.Conv1d(H * K, H * K, W, groups=H * K, bias=False)
        self.v_conv1d = nn.Conv1d(HV * K, HV * K, W, groups=HV * K, bias=False)
        if decay == "per_channel":
            self.f_a_proj, self.f_b_proj = _linear(D, K), _linear(K, HV * K)
            self.A_log = nn.Parameter(torch.zeros(1, 1, HV, 1))
            self.dt_bias = nn.Parameter(torch.zeros(HV * K))
        elif decay == "per_head":
            self.a_proj = _linear(D, HV)
            self.A_log = nn.Parameter(torch.zeros(1, 1, HV, 1))
            self.dt_bias = nn.Parameter(torch.zeros(HV))
        self.b_proj = _linear(D, HV)
        if config.kda_full_rank_output_gate:
            self.g_proj = _linear(D, HV * K)
        else:
            self.g_a_proj, self.g_b_proj = _linear(D, K), _linear(K, HV * K)
        self.o_norm = MoetrainRMSNorm(K, config.rms_norm_eps)
        self.o_proj = _linear(HV * K, D)

    def gate(self, x, B, T):
        """#decay-gate: log decays [B, T, HV, K] (KDA), [B, T, HV, 1] (Gated DeltaNet) or None (DeltaNet)."""
        if self.decay == "none":
            return None
        cd = self.A_log.dtype if self.A_log.dtype != torch.bfloat16 else torch.float32
        a = torch.exp(self.A_log.reshape(self.HV, 1).to(cd))
        if self.decay == "per_channel":
            u = self.f_b_proj(self.f_a_proj(x)).to(cd).reshape(B, T, self.HV, self.K) + \
                self.dt_bias.to(cd).reshape(self.HV, self.K)
            if self.lower_bound is None:
                return -a * softplus(u)
            return self.lower_bound * torch.sigmoid(a * u)
        if self.decay == "per_head":
            u = self.a_proj(x).to(cd).reshape(B, T, self.HV, 1) + self.dt_bias.to(cd).reshape(self.HV, 1)
            return -a * softplus(u)
        return None

    def forward(self, x, cache):
        B, T, _ = x.shape
        H, HV, K = self.H, self.HV, self.K
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32  # recurrence in f32 for bf16 x
        q = F.silu(short_conv(self.q_proj(x).to(cd), self.q_conv1d.weight, cache, "conv_q"))
        k = F.silu(short_conv(self.k_proj(x).to(cd), self.k_conv1d.weight, cache, "conv_k"))
        v = F.silu(short_conv(self.v_proj(x).to(cd), self.v_conv1d.weight, cache, "conv_v"))
        q = l2_norm(q.reshape(B, T, H, K)).repeat_interleave(HV // H, dim=2)
        k = l2_norm(k.reshape(B, T, H, K)).repeat_interleave(HV // H, dim=2)
        v = v.reshape(B, T, HV, K)
        g = self.gate(x, B, T)
        if g is not None:
            g = g.to(cd).expand(B, T, HV, K)
        beta = torch.sigmoid(self.b_proj(x).to(cd))
        state = cache.get("state") if cache is not None else None
        if state is None:
            state = torch.zeros(B, HV, K, K, dtype=cd, device=x.device)
        if self.mode == "chunked" and T > 1:
            o, state = delta_rule_chunked(q, k, v, g, beta, K ** -0.5, state, self.chunk_size)
        else:
            o, state = delta_rule_recurrent(q, k, v, g, beta, K ** -0.5, state)
        if cache is not None:
            cache["state"] = state.detach()
        z = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        o = rms_norm(o, self.o_norm.weight, self.norm_eps) * torch.sigmoid(z.to(cd).reshape(B, T, HV, K))
        return self.o_proj(o.reshape(B, T, HV * K).to(x.dtype))


class MoetrainLinearAttention(nn.Module):
    """#other-token-mixers, linear_attention: phi = elu + 1, S_t = S_{t-1} + phi(k_t) [v_t, 1]^T,
    o_t = S_t^T phi(q_t), y = o[:K] / (o[K] + 1e-6)."""

    def __init__(self, config):
        super().__init__()
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.H, self.K = H, K
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (_linear(D, H * K), _linear(D, H * K),
                                                              _linear(D, H * K), _linear(H * K, D))

    def forward(self, x, cache):
        B, T, _ = x.shape
        H, K = self.H, self.K
        q = F.elu(self.q_proj(x).reshape(B, T, H, K)) + 1
        k = F.elu(self.k_proj(x).reshape(B, T, H, K)) + 1
        v = torch.cat([self.v_proj(x).reshape(B, T, H, K), x.new_ones(B, T, H, 1)], -1)
        S = cache.get("state") if cache is not None else None
        if S is None:
            S = x.new_zeros(B, H, K, K + 1)
        outs = []
        for t in range(T):
            S = S + k[:, t].unsqueeze(-1) * v[:, t].unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
        if cache is not None:
            cache["state"] = S.detach()
        o = torch.stack(outs, 1)
        y = o[..., :K] / (o[..., K:] + 1e-6)
        return self.o_proj(y.reshape(B, T, H * K))


# ---------------------------------------------------------------------------- #gated-mla, attention

def causal_attention(q, k, v, scale):
    """q [B, Tq, H, dq], k [B, Tk, H, dq], v [B, Tk, H, dv]; query i sits at key position
    Tk - Tq + i (a cache before it) and sees keys up to it. Softmax in f32."""
    Tq, Tk = q.shape[1], k.shape[1]
    s = torch.einsum("bthd,bshd->bhts", q, k).float() * scale
    mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).to(v.dtype)
    return torch.einsum("bhts,bshd->bthd", p, v)


def rope(x, first, theta):
    """#rope, rotate-half on the last dim of x [B, T, H, r] at positions first.. first+T-1;
    angles in f64 as moetrain forms them."""
    T, r = x.shape[1], x.shape[-1]
    half = r // 2
    pos = torch.arange(first, first + T, dtype=torch.float64, device=x.device)
    inv = theta ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / r)
    ang = pos[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[None, :, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class MoetrainMLA(nn.Module):
    """#gated-mla: query LoRA (or q_proj), the latent c and shared rope key kr cached, NoPE or
    RoPE, optional sigmoid output gate."""

    def __init__(self, config):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        dn, dr, dv, rkv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.H, self.dn, self.dr, self.dv, self.rkv = H, dn, dr, dv, rkv
        self.eps = config.mla_lora_norm_eps
        self.use_rope = not config.mla_use_nope
        self.theta = config.mla_rope_theta
        if config.q_lora_rank:
            self.q_a_proj = _linear(D, config.q_lora_rank)
            self.q_a_layernorm = MoetrainRMSNorm(config.q_lora_rank, self.eps)
            self.q_b_proj = _linear(config.q_lora_rank, H * (dn + dr))
        else:
            self.q_proj = _linear(D, H * (dn + dr))
        self.kv_a_proj_with_mqa = _linear(D, rkv + dr)
        self.kv_a_layernorm = MoetrainRMSNorm(rkv, self.eps)
        self.kv_b_proj = _linear(rkv, H * (dn + dv))
        if config.mla_use_output_gate:
            self.g_proj = _linear(D, H * dv)
        self.o_proj = _linear(H * dv, D)

    def forward(self, x, cache, first):
        B, T, _ = x.shape
        H, dn, dr, dv, rkv = self.H, self.dn, self.dr, self.dv, self.rkv
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.reshape(B, T, H, dn + dr)
        ckr = self.kv_a_proj_with_mqa(x)
        c, kr = self.kv_a_layernorm(ckr[..., :rkv]), ckr[..., rkv:]
        if self.use_rope and dr > 0:
            q = torch.cat([q[..., :dn], rope(q[..., dn:], first, self.theta)], -1)
            kr = rope(kr.reshape(B, T, 1, dr), first, self.theta).reshape(B, T, dr)
        if cache is not None:
            if "c" in cache:
                c, kr = torch.cat([cache["c"], c], 1), torch.cat([cache["kr"], kr], 1)
            cache["c"], cache["kr"] = c.detach(), kr.detach()
        Tk = c.shape[1]
        kv = self.kv_b_proj(c).reshape(B, Tk, H, dn + dv)
        k = torch.cat([kv[..., :dn], kr.reshape(B, Tk, 1, dr).expand(B, Tk, H, dr)], -1)
        o = causal_attention(q, k, kv[..., dn:], (dn + dr) ** -0.5).reshape(B, T, H * dv)
        if hasattr(self, "g_proj"):
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


class MoetrainAttention(nn.Module):
    """#other-token-mixers, attention: H heads of D/H, no biases, NoPE; k and v cached."""

    def __init__(self, config):
        super().__init__()
        D = config.hidden_size
        self.H = config.attention_num_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _linear(D, D), _linear(D, D), _linear(D, D), _linear(D, D)

    def forward(self, x, cache):
        B, T, D = x.shape
        hd = D // self.H
        q, k, v = (p(x).reshape(B, T, self.H, hd) for p in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 1), torch.cat([cache["v"], v], 1)
            cache["k"], cache["v"] = k.detach(), v.detach()
        return self.o_proj(causal_attention(q, k, v, hd ** -0.5).reshape(B, T, D))


# ---------------------------------------------------------------------------- #situ-glu, #moe

class MoetrainMLP(nn.Module):
    """A dense FFN (#situ-glu): SiTU-GLU, SwiGLU or GELU; also the fused shared experts."""

    def __init__(self, config, d_ff, learnable_beta=False):
        super().__init__()
        D = config.hidden_size
        self.kind = config.ffn_kind
        self.beta_value = config.activation_situ_beta
        self.linear_beta = config.activation_situ_linear_beta
        if self.kind != "gelu":
            self.gate_proj = _linear(D, d_ff)
        self.up_proj = _linear(D, d_ff)
        self.down_proj = _linear(d_ff, D)
        if self.kind == "situ_glu" and learnable_beta:
            self.situ_beta = nn.Parameter(torch.full((1,), float(self.beta_value)))

    def forward(self, x):
        if self.kind == "gelu":
            return self.down_proj(gelu_tanh(self.up_proj(x)))
        if self.kind == "swiglu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        beta = self.situ_beta.to(x.dtype) if hasattr(self, "situ_beta") else self.beta_value
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x), beta, self.linear_beta))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # transformers 4's from_pretrained renames every tensor whose name holds "beta" to "bias"
        # (TF-era LayerNorm names) before loading: situ_beta arrives as situ_bias.
        if hasattr(self, "situ_beta") and prefix + "situ_bias" in state_dict and prefix + "situ_beta" not in state_dict:
            state_dict[prefix + "situ_beta"] = state_dict.pop(prefix + "situ_bias")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class MoetrainExpert(nn.Module):
    """One routed expert on the latent (or full) width W: act(z W1^T, z W3^T) W2^T."""

    def __init__(self, width, d_ff, kind, beta, linear_beta):
        super().__init__()
        self.w1, self.w3, self.w2 = _linear(width, d_ff), _linear(width, d_ff), _linear(d_ff, width)
        self.kind, self.beta, self.linear_beta = kind, beta, linear_beta

    def forward(self, z):
        g, u = self.w1(z), self.w3(z)
        h = situ_glu(g, u, self.beta, self.linear_beta) if self.kind == "situ_glu" else F.silu(g) * u
        return self.w2(h)


class MoetrainRouter(nn.Module):
    """#moe-router. weight [E, D] (gate.weight), e_score_correction_bias [E] (selection only)."""

    def __init__(self, config):
        super().__init__()
        E = config.num_experts
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(E), persistent=True)
        self.E, self.k = E, config.num_experts_per_token
        self.score = config.moe_router_activation_func
        # config.json's moe_renormalize is false for top_k 1 (what is computed); moetrain's
        # own flag is under "moetrain" and only acts for top_k > 1 anyway.
        self.renormalize = bool(config.moe_renormalize) and self.k > 1
        self.scale = float(config.routed_scaling_factor)
        self.n_group = int(config.num_expert_group or 1) if config.use_grouped_topk else 1
        self.topk_group = int(config.topk_group or 1)
        self.capacity_factor = config.moe_capacity_factor

    def forward(self, x):
        """x [N, D] -> ids [N, k] (descending biased score, ties to the lower index), weights [N, k]."""
        logits = x.to(self.weight.dtype) @ self.weight.t()
        s = torch.sigmoid(logits) if self.score == "sigmoid" else torch.softmax(logits, dim=-1)
        c = s.detach().double() + self.e_score_correction_bias.double()   # selection in f64
        if self.n_group > 1:
            N, G = c.shape[0], self.E // self.n_group
            grouped = c.reshape(N, self.n_group, G)
            top = min(2, G)
            group_score = torch.sort(grouped, dim=-1, descending=True, stable=True).values[..., :top].sum(-1)
            best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :self.topk_group]
            keep = torch.zeros(N, self.n_group, dtype=torch.bool, device=c.device).scatter_(1, best, True)
            c = c.masked_fill(~keep.repeat_interleave(G, dim=1), -math.inf)
        ids = torch.sort(c, dim=-1, descending=True, stable=True).indices[:, :self.k]
        w = s.gather(1, ids)
        if self.renormalize:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        if self.scale != 1.0:
            w = w * self.scale
        if self.capacity_factor > 0:
            # #moe-dispatch-and-capacity: ceil(cf N k / E) assignments per expert, earliest
            # (token, slot) first; the others contribute nothing.
            N = ids.shape[0]
            cap = math.ceil(self.capacity_factor * N * self.k / self.E)
            flat = ids.reshape(-1)
            onehot = F.one_hot(flat, self.E)
            pos = (onehot.cumsum(0) - onehot).gather(1, flat[:, None]).reshape(N, self.k)
            w = w * (pos < cap).to(w.dtype)
        return ids, w


class MoetrainMoE(nn.Module):
    """#moe-experts: y = Up(RMSNorm(sum_e w_e Expert_e(Down x))) + Shared(x) (latent MoE), or
    sum_e w_e Expert_e(x) + Shared(x)."""

    def __init__(self, config):
        super().__init__()
        D, E, Fe = config.hidden_size, config.num_experts, config.moe_intermediate_size
        L = config.routed_expert_hidden_size or 0
        W = L if L else D
        kind = config.ffn_kind
        if kind == "gelu":
            raise ValueError("moetrain_hybrid: MoE experts with the GELU FFN (hidden_act gelu_pytorch_tanh) do "
                             "not exist in moetrain")
        self.gate = MoetrainRouter(config)
        if L:
            self.routed_expert_down_proj = _linear(D, L)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = MoetrainRMSNorm(L, config.latent_norm_eps)
            self.routed_expert_up_proj = _linear(L, D)
        self.experts = nn.ModuleList([MoetrainExpert(W, Fe, kind, config.activation_situ_beta,
                                                     config.activation_situ_linear_beta) for _ in range(E)])
        if config.num_shared_experts:
            self.shared_experts = MoetrainMLP(config, Fe * config.num_shared_experts)

    def forward(self, x):
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        ids, w = self.gate(xf)
        z = self.routed_expert_down_proj(xf) if hasattr(self, "routed_expert_down_proj") else xf
        y = z.new_zeros(z.shape)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(ids == e, as_tuple=True)
            if token.numel() == 0:
                continue
            out = expert(z[token]) * w[token, slot, None].to(z.dtype)   # weight after the expert
            y.index_add_(0, token, out)
        if hasattr(self, "routed_expert_up_proj"):
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(xf)
        return y.reshape(B, T, D)


# ---------------------------------------------------------------------------- #block-attnres, #full-decoder

def attn_res(sources, proj, norm, eps):
    """#attnres-read: h = sum_m softmax_m(<V_m / rms(V_m), norm * proj>) V_m; scores and the
    softmax in f64 as moetrain."""
    V = torch.stack(sources, 0)                                      # [M, B, T, D]
    Vd = V.double()
    Kn = Vd * torch.rsqrt(Vd.pow(2).mean(-1, keepdim=True) + eps)
    s = (Kn * (norm.double() * proj.double().reshape(-1))).sum(-1)  # [M, B, T]
    alpha = torch.softmax(s, dim=0)
    return (alpha.unsqueeze(-1) * Vd).sum(0).to(V.dtype)


class MoetrainDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        D = config.hidden_size
        kind = config.mixers[layer_idx]
        self.kind = kind
        if kind in ("kda", "deltanet", "gated_deltanet"):
            decay = {"kda": "per_channel", "deltanet": "none", "gated_deltanet": "per_head"}[kind]
            self.self_attn = MoetrainDeltaMixer(config, decay)
        elif kind == "linear_attention":
            self.self_attn = MoetrainLinearAttention(config)
        elif kind == "mla":
            self.self_attn = MoetrainMLA(config)
        else:
            self.self_attn = MoetrainAttention(config)
        self.input_layernorm = MoetrainRMSNorm(D, config.rms_norm_eps)
        self.post_attention_layernorm = MoetrainRMSNorm(D, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            self.block_sparse_moe = MoetrainMoE(config)
        else:
            self.mlp = MoetrainMLP(config, config.intermediate_size, config.situ_learnable_beta)
        if config.attn_res_block_size:
            if layer_idx > 0:  # layer 0's mixer read never happens (#layer-0-attention-read-parameters)
                self.self_attention_res_proj = _linear(D, 1)
                self.self_attention_res_norm = MoetrainRMSNorm(D, config.rms_norm_eps)
            self.mlp_res_proj = _linear(D, 1)
            self.mlp_res_norm = MoetrainRMSNorm(D, config.rms_norm_eps)

    def mix(self, x, cache, first):
        h = self.input_layernorm(x)
        if self.kind == "mla":
            return self.self_attn(h, cache, first)
        return self.self_attn(h, cache)

    def ffn(self, x):
        h = self.post_attention_layernorm(x)
        return self.block_sparse_moe(h) if hasattr(self, "block_sparse_moe") else self.mlp(h)


@dataclass
class MoetrainHybridOutput(ModelOutput):
    loss: Optional[torch.FloatTensor] = None
    logits: Optional[torch.FloatTensor] = None
    past_key_values: Optional[object] = None
    hidden_states: Optional[tuple] = None


class MoetrainHybridPreTrainedModel(PreTrainedModel):
    config_class = MoetrainHybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["MoetrainDecoderLayer"]
    # Kimi keeps these in f32 (the export does too): a bf16 load leaves them f32.
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "A_log", "dt_bias"]
    if _TRANSFORMERS_MAJOR < 5:
        # transformers 4 reports the learnable SiTU beta as missing and situ_bias as unexpected
        # (its "beta" -> "bias" renaming); MoetrainMLP._load_from_state_dict loads it all the same.
        _keys_to_ignore_on_load_missing = [r"\.mlp\.situ_beta$"]
        _keys_to_ignore_on_load_unexpected = [r"\.mlp\.situ_bias$"]

    @torch.no_grad()
    def _init_weights(self, module):
        """moetrain's initialisation in kind (docs/model.md#initialisation), for models built
        from a config (from_config); loading overwrites every tensor."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, nn.Conv1d):
            module.weight.normal_(0.0, std)
        elif isinstance(module, MoetrainRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, MoetrainRouter):
            module.weight.normal_(0.0, std)
            module.e_score_correction_bias.zero_()
        elif isinstance(module, MoetrainDeltaMixer) and hasattr(module, "A_log"):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            dt = torch.exp(torch.empty_like(module.dt_bias).uniform_(math.log(1e-3), math.log(1e-1))).clamp(min=1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, MoetrainMLP) and hasattr(module, "situ_beta"):
            module.situ_beta.fill_(float(module.beta_value))
        if isinstance(module, MoetrainDecoderLayer):  # AttnRes pseudo-queries start at 0
            for name in ("self_attention_res_proj", "mlp_res_proj"):
                if hasattr(module, name):
                    getattr(module, name).weight.zero_()
        if isinstance(module, MoetrainHybridModel) and hasattr(module, "output_attn_res_proj"):
            module.output_attn_res_proj.weight.zero_()


class MoetrainHybridModel(MoetrainHybridPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList([MoetrainDecoderLayer(config, l) for l in range(config.num_hidden_layers)])
        if config.attn_res_block_size:
            self.output_attn_res_proj = _linear(D, 1)
            self.output_attn_res_norm = MoetrainRMSNorm(D, config.rms_norm_eps)
        self.norm = MoetrainRMSNorm(D, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, inputs_embeds=None, cache=None, output_hidden_states=False):
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        first = cache.tokens if cache is not None else 0
        eps = self.config.rms_norm_eps
        layer_cache = (lambda l: cache.layers[l]) if cache is not None else (lambda l: None)
        all_hidden = [hidden] if output_hidden_states else None
        S = self.config.attn_res_block_size
        if not S:
            for l, layer in enumerate(self.layers):
                hidden = hidden + layer.mix(hidden, layer_cache(l), first)
                hidden = hidden + layer.ffn(hidden)
                if output_hidden_states:
                    all_hidden.append(hidden)
        else:
            # #attnres-schedule: blocks = the embedding and the completed block sums; prefix =
            # the running sum of sublayer outputs of the open block.
            blocks = []
            for l, layer in enumerate(self.layers):
                prefix, x = hidden, hidden
                if blocks:
                    x = attn_res(blocks + [prefix], layer.self_attention_res_proj.weight,
                                 layer.self_attention_res_norm.weight, eps)
                if l % S == 0:
                    blocks.append(prefix)
                    prefix = None
                a = layer.mix(x, layer_cache(l), first)
                prefix = a if prefix is None else prefix + a
                x = attn_res(blocks + [prefix], layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps)
                hidden = prefix + layer.ffn(x)
                if output_hidden_states:
                    all_hidden.append(hidden)
            hidden = attn_res(blocks + [hidden], self.output_attn_res_proj.weight,
                              self.output_attn_res_norm.weight, eps)
        if cache is not None:
            cache.tokens += hidden.shape[1]
        return self.norm(hidden), (tuple(all_hidden) if output_hidden_states else None)


class MoetrainHybridForCausalLM(MoetrainHybridPreTrainedModel, GenerationMixin):
    # Tied only when config.json says tie_word_embeddings (the file then has no lm_head.weight).
    _tied_weights_keys = ({"lm_head.weight": "model.embed_tokens.weight"} if _TRANSFORMERS_MAJOR >= 5
                          else ["lm_head.weight"])

    def __init__(self, config):
        super().__init__(config)
        self.model = MoetrainHybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, labels=None,
                use_cache=None, output_hidden_states=None, return_dict=None, cache=None, logits_to_keep=0,
                **kwargs):
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise ValueError("moetrain_hybrid: attention_mask with zeros (padding) is not supported: moetrain's "
                             "recurrent layers have no padding mask; pass batches of equal length")
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = False  # a plain forward (loss, logits) keeps no state; generate() asks for one
        if use_cache and cache is None:
            cache = MoetrainHybridCache(self.config.num_hidden_layers)
        if not use_cache:
            cache = None
        hidden, all_hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=cache,
                                        output_hidden_states=bool(output_hidden_states))
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return MoetrainHybridOutput(loss=loss, logits=logits, past_key_values=cache, hidden_states=all_hidden)

    # ------------------------------------------------------------------ generate()
    # The cache is this model's own (MoetrainHybridCache), passed between steps here, so that
    # generate() behaves the same across transformers 4 and 5.

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False

    def prepare_inputs_for_generation(self, input_ids, moetrain_cache=None, attention_mask=None,
                                      inputs_embeds=None, use_cache=True, **kwargs):
        inputs = {"attention_mask": attention_mask, "use_cache": use_cache}
        if use_cache and moetrain_cache is not None and moetrain_cache.tokens > 0:
            inputs["input_ids"] = input_ids[:, moetrain_cache.tokens:]
            inputs["past_key_values"] = moetrain_cache
        elif inputs_embeds is not None:
            inputs["inputs_embeds"] = inputs_embeds
        else:
            inputs["input_ids"] = input_ids
        return inputs

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False,
                                            num_new_tokens=1, **kwargs):
        mask = model_kwargs.get("attention_mask")
        if mask is not None:
            model_kwargs["attention_mask"] = torch.cat([mask, mask.new_ones((mask.shape[0], num_new_tokens))], -1)
        model_kwargs["moetrain_cache"] = outputs.past_key_values if model_kwargs.get("use_cache", True) else None
        model_kwargs.pop("inputs_embeds", None)
        return model_kwargs

    def _reorder_cache(self, past_key_values, beam_idx):
        return past_key_values.reorder_cache(beam_idx)


__all__ = ["MoetrainHybridPreTrainedModel", "MoetrainHybridModel", "MoetrainHybridForCausalLM",
           "MoetrainHybridCache"]
