#!/usr/bin/python3
"""Loads a directory written by `moetrain export` by its documented names (docs/export.md)
and computes the logits of given tokens with the independent PyTorch references
(k3_reference.py for the hybrid, gpt2_reference.py for GPT-2), in float64. Debian numpy
and torch only; the safetensors files (one, or shards listed in
model.safetensors.index.json) are parsed here with json + numpy, the HDF5 file (model.h5)
with h5py. Used by tests/cli/export_reference_test.cpp.

  export_reader.py DIR IDS OUT.safetensors [DIR IDS OUT.safetensors ...]
      IDS: rows of token ids, "1,2,3/4,5,6" (B rows of T). Writes {"logits": [B, T, V]} (F64)
      for each directory (one process: torch is imported once). Prints one line per tensor
      read ("name dtype shape"), so a failure shows what was there.
"""
import json
import os
import struct
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k3_reference as k3  # noqa: E402
import gpt2_reference  # noqa: E402
from safetensors_read import write_arrays  # noqa: E402

DT = torch.float64
STORAGE = {"F64": "<f8", "F32": "<f4", "BF16": "<u2"}


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    header.pop("__metadata__", None)
    data = blob[8 + n:]
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        a = np.frombuffer(data[begin:end], dtype=STORAGE[e["dtype"]])
        if e["dtype"] == "BF16":
            a = (a.astype("<u4") << 16).view("<f4")  # bf16 is the upper half of an f32
        out[name] = torch.from_numpy(a.astype("<f8").reshape(e["shape"]))
        print(name, e["dtype"], e["shape"])
    return out


def read_dir(d):
    if os.path.exists(os.path.join(d, "model.safetensors")):
        return read_safetensors(os.path.join(d, "model.safetensors"))
    if os.path.exists(os.path.join(d, "model.safetensors.index.json")):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            index = json.load(f)
        p = {}
        for file in sorted(set(index["weight_map"].values())):
            p.update(read_safetensors(os.path.join(d, file)))
        assert set(p) == set(index["weight_map"]), "the shards do not hold exactly the weight_map's tensors"
        return p
    import h5py
    with h5py.File(os.path.join(d, "model.h5"), "r") as f:
        bf16 = f.attrs.get("dtype") in ("bf16", b"bf16")
        p = {}
        for name, ds in f.items():
            a = ds[()]
            if a.dtype == np.uint16 and bf16:
                a = (a.astype("<u4") << 16).view("<f4")
            p[name] = torch.from_numpy(np.asarray(a, dtype="<f8"))
            print(name, ds.dtype, list(ds.shape))
        return p


def sub(p, prefix):
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def hybrid_logits(p, cfg, ids):
    """docs/model.md#attnres-schedule orchestration (or the plain residual stream) over the layers of
    config.json, each piece from k3_reference.py, weights by their Hugging Face names."""
    ext = cfg["moetrain"]
    lin = cfg["linear_attn_config"]
    eps = cfg["rms_norm_eps"]
    D = cfg["hidden_size"]
    activation = "situ_glu" if cfg["hidden_act"] == "situ" else "swiglu"
    beta, linear_beta = cfg.get("activation_situ_beta"), cfg.get("activation_situ_linear_beta")
    moe_layers = cfg["num_experts"] is not None

    def mixer(l, x):
        a = sub(p, f"model.layers.{l}.self_attn.")
        kind = ext["layer_mixers"][l]
        if kind == "kda":
            a["A_log"] = a["A_log"].reshape(-1)
            H, K, HV = lin["num_heads"], lin["head_dim"], ext["kda_num_value_heads"]
            lb = lin["gate_lower_bound"]
            return k3.kda_layer(x, a, H, K, HV, "softplus" if lb is None else "lowerbound", lb, 1e-6, eps)
        if kind == "mla":
            assert cfg["mla_use_nope"] and cfg["mla_use_output_gate"] and cfg["q_lora_rank"] is not None
            return k3.mla(x, a, cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                          cfg["v_head_dim"], ext["mla_lora_norm_eps"])
        B, T, _ = x.shape
        H = ext["attention_num_heads"]
        q, k_, v = ((x @ a[n + "_proj.weight"].T).view(B, T, H, D // H) for n in ("q", "k", "v"))
        return k3.causal_attention(q, k_, v, (D // H) ** -0.5).reshape(B, T, D) @ a["o_proj.weight"].T

    def ffn(l, x):
        if moe_layers and l >= cfg["first_k_dense_replace"]:
            m = sub(p, f"model.layers.{l}.block_sparse_moe.")
            return k3.latent_moe(x, m, cfg["num_experts_per_token"], cfg["moe_router_activation_func"],
                                 cfg["moe_renormalize"], cfg["routed_scaling_factor"], activation, beta, linear_beta,
                                 ext["latent_norm_eps"])["y"]
        m = sub(p, f"model.layers.{l}.mlp.")
        return k3.glu_mlp(x, m["gate_proj.weight"], m["up_proj.weight"], m["down_proj.weight"], activation, beta,
                          linear_beta)

    def read(last, blocks, proj, norm):
        return k3.attnres(last, torch.stack(blocks), p[proj], p[norm], eps)

    hidden = p["model.embed_tokens.weight"][ids]
    L = cfg["num_hidden_layers"]
    S = cfg["attn_res_block_size"]
    if S is None:
        for l in range(L):
            lp = f"model.layers.{l}."
            hidden = hidden + mixer(l, k3.rms_norm(hidden, p[lp + "input_layernorm.weight"], eps))
            hidden = hidden + ffn(l, k3.rms_norm(hidden, p[lp + "post_attention_layernorm.weight"], eps))
    else:
        blocks = []
        for l in range(L):
            lp = f"model.layers.{l}."
            prefix, x = hidden, hidden
            if blocks:
                x = read(prefix, blocks, lp + "self_attention_res_proj.weight", lp + "self_attention_res_norm.weight")
            if l % S == 0:
                blocks.append(prefix)
                prefix = None
            a = mixer(l, k3.rms_norm(x, p[lp + "input_layernorm.weight"], eps))
            prefix = a if prefix is None else prefix + a
            x = read(prefix, blocks, lp + "mlp_res_proj.weight", lp + "mlp_res_norm.weight")
            hidden = prefix + ffn(l, k3.rms_norm(x, p[lp + "post_attention_layernorm.weight"], eps))
        hidden = read(hidden, blocks, "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight")
    out = k3.rms_norm(hidden, p["model.norm.weight"], eps)
    head = p["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    return out @ head.T


def main(argv):
    if len(argv) < 4 or (len(argv) - 1) % 3 != 0:
        print(__doc__, file=sys.stderr)
        return 2
    for i in range(1, len(argv), 3):
        export_logits(*argv[i:i + 3])
    return 0


def export_logits(d, ids_text, out):
    print("directory", d)
    ids = torch.tensor([[int(t) for t in row.split(",")] for row in ids_text.split("/")], dtype=torch.int64)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    p = read_dir(d)
    with torch.no_grad():
        if cfg["model_type"] == "gpt2":
            gcfg = {"n_embd": cfg["n_embd"], "n_head": cfg["n_head"], "n_layer": cfg["n_layer"],
                    "layer_norm_epsilon": cfg["layer_norm_epsilon"]}
            logits = gpt2_reference.forward(p, ids, gcfg)
        else:
            assert cfg["model_type"] in ("kimi_linear", "moetrain_hybrid"), cfg["model_type"]
            logits = hybrid_logits(p, cfg, ids)
    write_arrays(out, {"logits": logits.numpy().astype("<f8")})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
