#!/usr/bin/env python3
"""moetrain_hybrid exports in transformers through the remote code they carry
(python/moetrain_hf/, docs/export.md#running-a-moetrain_hybrid-export-in-transformers).

  hf_remote_code.py MOETRAIN_BINARY WORK_DIR [CASE ...]

For every shipped hybrid config (configs/k3-*.yaml, kimi-k3.yaml, the hybrid rungs of
configs/evolution/), shrunk by --set to a few thousand parameters with the same features,
and for single-feature variants of a Kimi-Linear base (SiTU-GLU, learnable SiTU beta, Block
AttnRes, latent MoE, lower-bound and full-rank KDA gates, MLA output gate, MLA RoPE, GVA,
softmax router, grouped routing, top_k 1, capacity, tied head, plain attention, GELU): train
3 steps on random bytes, `moetrain export`, then in transformers
  AutoConfig / AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
must load without a missing or unexpected tensor, the mean loss on the same windows must
agree with `moetrain eval` to 1e-5 relative (f32), and greedy generate() of NEW tokens with
and without its cache must equal `moetrain generate --temperature 0` (same bytes; with expert
capacity only the cached text, since capacity is per forward call). Also
through the recurrent KDA prefill (config.kda_mode), a bf16 export and a sharded export,
and models saved by transformers' save_pretrained (as loaded, after 3 AdamW steps in
transformers, and built by from_config) read back by `moetrain eval/generate --init-from`
with the same loss and greedy text.

Prints one line per check with the measured differences; exits 1 on the first failure.
Needs transformers and torch; tests/cli/hf_remote_code_test.cpp skips when they are missing."""

import json
import os
import shutil
import struct
import subprocess
import sys

import safetensors.torch
import torch
import transformers
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

TOL = 1e-5     # relative, f32
V = 256        # byte tokenizer
T = 32         # eval window
WINDOWS = 4    # eval windows, one batch
PROMPT = "ROMEO: "
NEW = 100      # greedy tokens
# from_pretrained's dtype argument: `dtype` in transformers 5, `torch_dtype` in 4 (where
# `dtype` would land in the config as an unserialisable attribute).
DTYPE_ARG = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"

BIN = WORK = SRC = None
WORST = {"loss": 0.0}


def fail(msg):
    print("FAIL:", msg)
    sys.stdout.flush()
    sys.exit(1)


def run(args, check=True):
    r = subprocess.run([BIN] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and r.returncode != 0:
        fail("moetrain %s exited %d:\n%s" % (" ".join(args), r.returncode, r.stderr.decode(errors="replace")))
    return r


def write_shard(path, tokens):
    """llm.c's token shard (src/data/shard.h): 256 int32 header, uint16 tokens."""
    header = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))


def make_data():
    g = torch.Generator().manual_seed(11)
    os.makedirs(os.path.join(WORK, "data"), exist_ok=True)
    val = torch.randint(0, V, (WINDOWS * T + 1,), generator=g).tolist()
    train = torch.randint(0, V, (4096,), generator=g).tolist()
    write_shard(os.path.join(WORK, "data", "val_000.bin"), val)
    write_shard(os.path.join(WORK, "data", "train_000.bin"), train)
    return val


# ------------------------------------------------------------------ the cases

# Every case: train 3 steps of this size (f32, byte tokenizer, random bytes).
COMMON = ["data.tokenizer=byte", "model.vocab_size=256", "model.n_ctx=256", "train.seq_len=32", "train.batch_size=2",
          "train.max_steps=3", "train.warmup_steps=1", "train.eval_every=0", "train.sample_every=0",
          "train.threads=1", "train.log_every=1000", "train.dtype=f32", "data.val=''", "ckpt.every=0",
          "model.init_std=0.3", "model.embed_init_std=1.0", "train.ep=1", "train.pp=1"]


def shrink(cfg):
    """--set keys that cut a resolved config (dict) to a toy size, keeping every feature."""
    m = cfg["model"]
    out = ["model.d_model=32", "model.d_ff=48", "model.n_head=4"]
    n = min(int(m["n_layer"]), 6)
    out.append("model.n_layer=%d" % n)
    if m.get("layer_mixers"):
        mixers = str(m["layer_mixers"]).split(",")
        out.append("model.layer_mixers=" + ",".join((mixers * n)[:n]))
    kda = m["kda"]
    out += ["model.kda.n_head=2", "model.kda.head_dim=8", "model.kda.chunk_size=16"]
    if int(kda.get("n_value_head", 0) or 0) > 0:
        out.append("model.kda.n_value_head=4")
    mla = m["mla"]
    out += ["model.mla.n_head=2", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8",
            "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8",
            "model.mla.q_lora_rank=%d" % (12 if int(mla.get("q_lora_rank", 0) or 0) > 0 else 0)]
    moe = m["moe"]
    if int(moe.get("num_experts", 0) or 0) > 0:
        groups = int(moe.get("n_group", 1) or 1)
        E = 8 if groups <= 1 else 4 * groups
        out += ["model.moe.num_experts=%d" % E, "model.moe.top_k=%d" % min(int(moe["top_k"]), 3),
                "model.moe.expert_d_ff=16", "model.moe.bias_update_rate=0.05"]
        if int(moe.get("latent_dim", 0) or 0) > 0:
            out.append("model.moe.latent_dim=16")
    if m.get("attn_res"):
        out.append("model.attn_res_block_size=2")
    return out


def shipped_cases():
    cases = []
    names = ["k3-tiny", "k3-small", "k3-base", "k3-shakespeare", "k3-topology-mini", "k3-scaled", "k3-scaled-lite",
             "kimi-k3"]
    paths = [("configs/%s.yaml" % n) for n in names]
    paths += ["configs/evolution/%s.yaml" % n for n in ("02-linear-attention", "03-deltanet", "04-gated-deltanet",
                                                         "05-kda", "06-kimi-linear", "07-k3")]
    for rel in paths:
        path = os.path.join(SRC, rel)
        if not os.path.exists(path):
            continue
        r = run(["eval", "-c", path, "--print-config", "--set", "data.tokenizer=byte"])
        cfg = yaml.safe_load(r.stdout.decode())
        if cfg["model"]["arch"] != "hybrid":
            continue
        cases.append((os.path.splitext(rel[len("configs/"):])[0], ["-c", path], shrink(cfg)))
    return cases


# A Kimi-Linear model (KDA, MLA, MoE, plain residual) that transformers' own class computes;
# each variant adds one feature that makes the export moetrain_hybrid.
BASE = ["model.arch=hybrid", "model.d_model=32", "model.n_layer=4", "model.layer_mixers=kda,kda,mla,kda",
        "model.ffn=swiglu", "model.d_ff=40", "model.attn_res=false", "model.tie_embeddings=false",
        "model.kda.n_head=2", "model.kda.head_dim=8", "model.kda.gate=softplus",
        "model.kda.full_rank_output_gate=false", "model.kda.chunk_size=16", "model.mla.n_head=2",
        "model.mla.q_lora_rank=12", "model.mla.kv_lora_rank=8", "model.mla.qk_nope_head_dim=8",
        "model.mla.qk_rope_head_dim=4", "model.mla.v_head_dim=8", "model.mla.output_gate=false", "model.mla.rope=false",
        "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.num_shared_experts=1", "model.moe.expert_d_ff=16",
        "model.moe.first_dense_layers=1", "model.moe.router_score=sigmoid", "model.moe.renormalize=true",
        "model.moe.routed_scaling_factor=2.0", "model.moe.bias_update_rate=0.05"]

VARIANTS = [
    ("situ_glu", ["model.ffn=situ_glu", "model.situ_beta=3.0", "model.situ_linear_beta=6.0"]),
    ("situ_learnable_beta", ["model.ffn=situ_glu", "model.situ_learnable_beta=true"]),
    ("attn_res", ["model.attn_res=true", "model.attn_res_block_size=2"]),
    ("latent_moe", ["model.moe.latent_dim=16"]),
    ("latent_moe_no_norm", ["model.moe.latent_dim=16", "model.moe.latent_norm=false"]),
    ("kda_lower_bound_gate", ["model.kda.gate=lower_bound", "model.kda.lower_bound=-4.0"]),
    ("kda_full_rank_gate", ["model.kda.full_rank_output_gate=true"]),
    ("kda_gva", ["model.kda.n_value_head=4"]),
    ("mla_output_gate", ["model.mla.output_gate=true"]),
    ("mla_rope", ["model.mla.rope=true", "model.mla.rope_theta=100.0"]),
    ("mla_no_q_lora_eps", ["model.mla.q_lora_rank=0", "model.mla.lora_norm_eps=1e-5"]),
    ("softmax_router", ["model.moe.router_score=softmax", "model.moe.renormalize=false"]),
    # Grouped routing alone is a kimi_linear export (transformers' own class); the MLA output
    # gate (checked alone above) makes it moetrain_hybrid, so the remote code's grouped selection runs.
    ("grouped_routing", ["model.moe.num_experts=8", "model.moe.n_group=4", "model.moe.topk_group=2",
                         "model.mla.output_gate=true"]),
    ("top1_no_shared", ["model.moe.top_k=1", "model.moe.num_shared_experts=0"]),
    ("capacity", ["model.moe.capacity_factor=1.0"]),
    ("tied_head", ["model.tie_embeddings=true", "model.attn_res=true", "model.attn_res_block_size=2"]),
    ("attention_mixer", ["model.layer_mixers=kda,attention,mla,kda", "model.n_head=4"]),
    ("gelu_dense", ["model.ffn=gelu", "model.moe.num_experts=0"]),
]


def base_yaml():
    """`moetrain train` needs -c: a YAML that says only the architecture (BASE sets the rest)."""
    path = os.path.join(WORK, "base.yaml")
    with open(path, "w") as f:
        f.write("model: {arch: hybrid}\ndata: {tokenizer: byte}\n")
    return ["-c", path]


def variant_cases():
    return [("feature/" + name, base_yaml(), BASE + extra) for name, extra in VARIANTS]


# ------------------------------------------------------------------ both sides

def moetrain_loss(source):
    r = run(["eval"] + source + ["--data", os.path.join(WORK, "data", "val_*.bin"), "--seq-len", str(T),
                                 "--batch-size", str(WINDOWS), "--json", "--set", "data.tokenizer=byte"])
    return json.loads(r.stdout.decode())["loss"]


def moetrain_greedy(source):
    r = run(["generate"] + source + ["--prompt", PROMPT, "--max-new-tokens", str(NEW), "--temperature", "0",
                                     "--raw", "--set", "data.tokenizer=byte"])
    return r.stdout


def hf_loss(model, tokens):
    """Mean next-token cross-entropy over the windows moetrain eval reads (one batch)."""
    x = torch.tensor([tokens[i * T:i * T + T] for i in range(WINDOWS)])
    y = torch.tensor([tokens[i * T + 1:i * T + T + 1] for i in range(WINDOWS)])
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


def hf_greedy(model, use_cache):
    ids = torch.tensor([list(PROMPT.encode())])
    with torch.no_grad():
        # synced_gpus given: left None, transformers 4 asks whether the model is FSDP-managed by
        # importing torch.distributed.fsdp, which Debian's torch 1.13 cannot import under Python 3.11.
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, use_cache=use_cache, pad_token_id=0,
                             eos_token_id=None, synced_gpus=False)
    return PROMPT.encode() + bytes(out[0, ids.shape[1]:].tolist()) + b"\n"


def check_loss(name, ours, theirs):
    rel = abs(ours - theirs) / abs(ours)
    WORST["loss"] = max(WORST["loss"], rel)
    if not rel < TOL:
        fail("%s: losses differ by %.2e relative (tolerance %.0e): moetrain %.9g, transformers %.9g"
             % (name, rel, TOL, ours, theirs))
    return rel


def check_text(name, ours, theirs, what):
    if ours != theirs:
        n = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        fail("%s: greedy text %s differs from moetrain generate at byte %d:\n  moetrain     %r\n  transformers %r"
             % (name, what, n, ours, theirs))


def load(out, **kw):
    model, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, output_loading_info=True,
                                                       **{DTYPE_ARG: torch.float32}, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        fail("%s: from_pretrained reports %s" % (out, bad))
    # Every tensor of the export in the model, bit for bit (as f32): a tensor left at its
    # initial value shows here even where the loss hardly moves (a learnable SiTU beta after
    # 3 steps), and where transformers 4 renames it (situ_beta -> situ_bias) on the way.
    state = model.state_dict()
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            for key, t in safetensors.torch.load_file(os.path.join(out, f)).items():
                if key not in state or not torch.equal(state[key].float(), t.float()):
                    fail("%s: %s of %s is %s in the loaded model" % (out, key, f, "absent" if key not in state
                                                                     else "not the file's"))
    model.eval()
    return model


def train_and_export(name, source, overrides, export_args=()):
    run_dir = os.path.join(WORK, "run_" + name.replace("/", "_"))
    out = os.path.join(WORK, "export_" + name.replace("/", "_"))
    for d in (run_dir, out):  # a rerun into the same WORK starts the case afresh
        shutil.rmtree(d, ignore_errors=True)
    sets = []
    for o in COMMON + overrides + ["run.dir=" + run_dir, "data.train=" + os.path.join(WORK, "data", "train_*.bin")]:
        sets += ["--set", o]
    run(["train"] + source + sets)
    r = run(["export", "--checkpoint", os.path.join(run_dir, "model"), "--out", out, "--no-progress"] +
            list(export_args))
    return out, r.stderr.decode(errors="replace")


def check_case(name, source, overrides, tokens):
    out, _ = train_and_export(name, source, overrides)
    cfg = json.load(open(os.path.join(out, "config.json")))
    if cfg["model_type"] != "moetrain_hybrid":
        print("%-34s model_type %s (transformers' own class; hf_roundtrip.py covers it), skipped"
              % (name, cfg["model_type"]))
        return
    for f in ("configuration_moetrain_hybrid.py", "modeling_moetrain_hybrid.py"):
        if not os.path.exists(os.path.join(out, f)):
            fail("%s: the export lacks %s" % (name, f))
    if "AutoModelForCausalLM" not in cfg.get("auto_map", {}):
        fail("%s: config.json has no auto_map.AutoModelForCausalLM" % name)
    conf = AutoConfig.from_pretrained(out, trust_remote_code=True)
    if type(conf).__name__ != "MoetrainHybridConfig":
        fail("%s: AutoConfig gave %s" % (name, type(conf).__name__))
    model = load(out)
    src = ["--checkpoint", out]
    ours = moetrain_loss(src)
    rel = check_loss(name, ours, hf_loss(model, tokens))
    text = moetrain_greedy(src)
    check_text(name, text, hf_greedy(model, True), "with the cache")
    uncached = "cached and uncached"
    if cfg.get("moetrain", {}).get("moe_capacity_factor", 0) > 0:
        # Capacity is per forward call (ceil(cf N k / E) assignments per expert over its N
        # tokens, docs/model.md#moe-dispatch-and-capacity): moetrain generate prefills the prompt
        # and then decodes one token per call, which generate() with the cache does too; without
        # the cache every step recomputes the whole sequence in one call, so other assignments
        # are dropped and the text differs by definition. Only the cached text is compared.
        uncached = "cached (uncached differs by definition: capacity per call)"
    else:
        check_text(name, text, hf_greedy(model, False), "without the cache")
    # The recurrent KDA prefill (one token at a time) gives the same loss.
    model_rec = load(out, kda_mode="recurrent")
    rel_rec = check_loss(name + " (recurrent prefill)", ours, hf_loss(model_rec, tokens))
    print("%-34s loss moetrain %.7f  rel diff %.1e (recurrent prefill %.1e)  greedy %d tokens equal, %s"
          % (name, ours, rel, rel_rec, NEW, uncached))


def extra_checks(tokens):
    """bf16 and sharded exports of a K3-style model; save_pretrained read back by --init-from."""
    name = "k3-features"
    overrides = BASE + ["model.ffn=situ_glu", "model.attn_res=true", "model.attn_res_block_size=2",
                        "model.moe.latent_dim=16", "model.kda.gate=lower_bound", "model.kda.full_rank_output_gate=true",
                        "model.mla.output_gate=true"]
    out, _ = train_and_export(name, base_yaml(), overrides)
    ours_f32 = moetrain_loss(["--checkpoint", out])
    # Sharded: the same model in several files.
    shards, _ = train_and_export(name + "_sharded", base_yaml(), overrides, ["--max-shard-size", "4KB"])
    if not os.path.exists(os.path.join(shards, "model.safetensors.index.json")):
        fail("sharded export: no model.safetensors.index.json")
    model = load(shards)
    ours = moetrain_loss(["--checkpoint", shards])
    rel = check_loss("sharded export", ours, hf_loss(model, tokens))
    check_text("sharded export", moetrain_greedy(["--checkpoint", shards]), hf_greedy(model, True), "with the cache")
    print("%-34s loss %.7f rel diff %.1e, greedy equal" % ("sharded export (%d files)" % len(
        [f for f in os.listdir(shards) if f.endswith(".safetensors")]), ours, rel))
    # bf16: both sides read the rounded weights into f32.
    bf16 = os.path.join(WORK, "export_k3_bf16")
    shutil.rmtree(bf16, ignore_errors=True)
    run(["export", "--checkpoint", os.path.join(WORK, "run_" + name, "model"), "--out", bf16, "--dtype", "bf16",
         "--no-progress"])
    model = load(bf16)
    ours = moetrain_loss(["--checkpoint", bf16])
    rel = check_loss("bf16 export", ours, hf_loss(model, tokens))
    check_text("bf16 export", moetrain_greedy(["--checkpoint", bf16]), hf_greedy(model, True), "with the cache")
    print("%-34s loss %.7f (f32 export %.7f) rel diff %.1e, greedy equal" % ("bf16 export", ours, ours_f32, rel))
    # transformers -> moetrain: save_pretrained of the loaded class, read by --init-from (config.json alone).
    model = load(out)
    saved = os.path.join(WORK, "hf_saved_k3")
    shutil.rmtree(saved, ignore_errors=True)
    model.save_pretrained(saved)
    back = ["--init-from", saved]
    ours = moetrain_loss(back)
    rel = check_loss("save_pretrained -> --init-from", ours, hf_loss(model, tokens))
    check_text("save_pretrained -> --init-from", moetrain_greedy(back), hf_greedy(model, True), "with the cache")
    print("%-34s loss %.7f rel diff %.1e, greedy equal" % ("save_pretrained -> --init-from", ours, rel))
    # Fine-tuned in transformers (3 AdamW steps through this class's backward), saved, read back.
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.tensor([tokens[:T + 1]] * 2)
    for _ in range(3):
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    tuned = os.path.join(WORK, "hf_tuned_k3")
    shutil.rmtree(tuned, ignore_errors=True)
    model.save_pretrained(tuned)
    back = ["--init-from", tuned]
    ours = moetrain_loss(back)
    rel = check_loss("fine-tuned -> --init-from", ours, hf_loss(model, tokens))
    check_text("fine-tuned -> --init-from", moetrain_greedy(back), hf_greedy(model, True), "with the cache")
    print("%-34s loss %.7f (before tuning %.7f) rel diff %.1e, greedy equal" % ("fine-tuned -> --init-from", ours,
                                                                               ours_f32, rel))
    # A model built by transformers from the config alone (random init), saved and read by moetrain.
    conf = AutoConfig.from_pretrained(out, trust_remote_code=True)
    torch.manual_seed(3)
    fresh = AutoModelForCausalLM.from_config(conf, trust_remote_code=True)
    with torch.no_grad():
        for p in fresh.parameters():
            if p.dim() >= 2:
                p.mul_(15.0)
    fresh.eval()
    d = os.path.join(WORK, "hf_fresh_k3")
    shutil.rmtree(d, ignore_errors=True)
    fresh.save_pretrained(d)
    back = ["--init-from", d]
    ours = moetrain_loss(back)
    rel = check_loss("from_config -> --init-from", ours, hf_loss(fresh, tokens))
    check_text("from_config -> --init-from", moetrain_greedy(back), hf_greedy(fresh, True), "with the cache")
    print("%-34s loss %.7f rel diff %.1e, greedy equal" % ("from_config -> --init-from", ours, rel))


def main(argv):
    global BIN, WORK, SRC
    BIN, WORK = os.path.abspath(argv[1]), os.path.abspath(argv[2])
    SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    only = argv[3:]
    os.makedirs(WORK, exist_ok=True)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # loading 52 shards draws one otherwise
    torch.set_num_threads(1)
    print("transformers %s, torch %s" % (transformers.__version__, torch.__version__))
    tokens = make_data()
    for name, source, overrides in shipped_cases() + variant_cases():
        if only and not any(o in name for o in only):
            continue
        check_case(name, source, overrides, tokens)
    if not only or "extra" in only:
        extra_checks(tokens)
    print("largest loss difference %.1e relative" % WORST["loss"])
    print("all remote-code checks agree")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
