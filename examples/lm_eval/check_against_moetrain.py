#!/usr/bin/env python3
"""Check lm-evaluation-harness's numbers on a moetrain export against `moetrain eval`
(docs/export.md#lm-evaluation-harness).

  check_against_moetrain.py MOETRAIN_BINARY EXPORT_DIR LM_EVAL_OUTPUT_DIR [--work DIR]

LM_EVAL_OUTPUT_DIR is lm_eval's --output_path of a run with --log_samples on EXPORT_DIR
(the newest results_*.json below it is read, with its samples_*.jsonl). For each logged
sample, the same tokens go through `moetrain eval --checkpoint EXPORT_DIR`, one token shard
per sequence and one window per shard (window i predicts tokens 1..T from 0..T-1):

  log p(continuation | context) = S(context) - S(context + continuation), S(x) the summed
  loss of `moetrain eval` on x with T = len(x) - 1 (0 for one token), with
  loglikelihood_rolling (shakespeare_ppl): lm-eval's rolling windows of the doc's tokens
    (lm_eval.utils.get_rolling_token_windows, made disjoint, as its HF backend does): the
    first is [prefix] -> tokens[:max_length], then windows of max_length tokens; summed;
  loglikelihood (shakespeare_next_line): lm-eval's split of context and continuation
    (trailing whitespace of the context moves to the continuation).
Tokens as lm-eval's HF backend encodes: tokenizer.encode with its default special tokens, or
model_args' add_bos_token choice.

The prefix token is lm-eval's: model_args' prefix_token_id, else the tokenizer's bos, else
its eos. Tolerance: each log-likelihood within 1e-5 relative of the summed magnitudes
(|a - b| <= 1e-5 (|S_whole| + |S_context|) + 1e-6; f32 sums over up to ~700 tokens on both
sides), the aggregates (bits_per_byte, byte and word perplexity) within 1e-5 relative, and
acc / acc_norm equal, except for questions whose two best choices lie within the tolerance
(reported). Prints a table; exits 1 on a disagreement, 2 on unusable input.
"""

import glob
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile

REL = 1e-5
ABS = 1e-6


def die(code, msg):
    print("check_against_moetrain: " + msg, file=sys.stderr)
    sys.exit(code)


def newest(pattern, what):
    files = sorted(glob.glob(pattern, recursive=True), key=os.path.getmtime)
    if not files:
        die(2, "no %s matches %s (run lm_eval with --output_path and --log_samples)" % (what, pattern))
    return files[-1]


def parse_model_args(ma):
    if isinstance(ma, dict):
        return ma
    out = {}
    for part in (ma or "").split(","):
        if "=" in part:
            k, v = part.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def as_bool(v):
    return v if isinstance(v, bool) or v is None else str(v).lower() in ("1", "true", "yes")


class Moetrain:
    def __init__(self, binary, export, work):
        self.binary, self.export, self.work, self.n = binary, export, work, 0

    def summed_loss(self, tokens):
        """-sum_{t>=1} log p(tokens[t] | tokens[:t]) by `moetrain eval` (one window of len-1)."""
        if len(tokens) < 2:
            return 0.0
        self.n += 1
        path = os.path.join(self.work, "seq.bin")
        header = [20240520, 1, len(tokens)] + [0] * 253  # llm.c shard (src/data/shard.h)
        fmt = "<%dH" % len(tokens) if max(tokens) < 65536 else "<%dI" % len(tokens)
        if max(tokens) >= 65536:
            header[1] = 2
        with open(path, "wb") as f:
            f.write(struct.pack("<256i", *header))
            f.write(struct.pack(fmt, *tokens))
        r = subprocess.run([self.binary, "eval", "--checkpoint", self.export, "--data", path, "--seq-len",
                            str(len(tokens) - 1), "--batch-size", "1", "--json", "--threads", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if r.returncode != 0:
            die(2, "moetrain eval exited %d: %s" % (r.returncode, r.stderr.decode(errors="replace").strip()))
        return json.loads(r.stdout)["loss"] * (len(tokens) - 1)


def close(a, b, scale):
    return abs(a - b) <= REL * scale + ABS


def main(argv):
    args = argv[1:]
    work = None
    if "--work" in args:
        i = args.index("--work")
        work = args[i + 1]
        del args[i:i + 2]
    if len(args) != 3:
        die(2, "usage: check_against_moetrain.py MOETRAIN_BINARY EXPORT_DIR LM_EVAL_OUTPUT_DIR [--work DIR]")
    binary, export, out = args
    results_path = newest(os.path.join(out, "**", "results_*.json"), "results_*.json")
    results = json.load(open(results_path))
    stamp = os.path.basename(results_path)[len("results_"):-len(".json")]
    folder = os.path.dirname(results_path)

    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(export, trust_remote_code=True)  # as lm-eval loads it
    margs = parse_model_args(results.get("config", {}).get("model_args"))
    add_bos = as_bool(margs.get("add_bos_token"))
    enc_kw = {} if add_bos is None else {"add_special_tokens": add_bos}
    prefix = margs.get("prefix_token_id")
    prefix = int(prefix) if prefix is not None else (tok.bos_token_id if tok.bos_token_id is not None
                                                     else tok.eos_token_id)
    max_length = int(results.get("max_length") or 2048)

    def encode(text):
        return tok.encode(text, **enc_kw)

    work = work or tempfile.mkdtemp(prefix="lm_eval_check_")
    os.makedirs(work, exist_ok=True)
    mt = Moetrain(binary, export, work)
    failures = []
    rows = []

    def samples(task):
        path = os.path.join(folder, "samples_%s_%s.jsonl" % (task, stamp))
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    # ---------------------------------------------------------------- rolling
    ppl = samples("shakespeare_ppl")
    if ppl is not None:
        if prefix is None:
            die(2, "the tokenizer has no bos or eos token and model_args no prefix_token_id")
        worst, sum_ll_lm, sum_ll_mt, n_bytes, n_words = 0.0, 0.0, 0.0, 0, 0
        for s in ppl:
            text = s["doc"]["text"]
            ll_lm = float(s["filtered_resps"][0])
            ll_mt, scale = 0.0, 0.0
            # lm-eval's own rolling windows (one for a doc shorter than max_length)
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=encode(text), prefix_token=prefix, max_seq_len=max_length, context_len=1)):
                s_ctx, s_whole = mt.summed_loss(ctx), mt.summed_loss(ctx + cont)
                ll_mt += s_ctx - s_whole
                scale += abs(s_ctx) + abs(s_whole)
            worst = max(worst, abs(ll_lm - ll_mt) / scale)
            if not close(ll_lm, ll_mt, scale):
                failures.append("shakespeare_ppl doc %d: lm-eval %.9g, moetrain %.9g" % (s["doc_id"], ll_lm, ll_mt))
            sum_ll_lm += ll_lm
            sum_ll_mt += ll_mt
            n_bytes += len(text.encode("utf-8"))
            n_words += len(re.split(r"\s+", text))
        rows.append(("shakespeare_ppl", "docs checked", len(ppl), len(ppl), "", ""))
        rows.append(("", "log-likelihood (per doc)", "", "", "%.1e" % worst, "worst rel"))
        mine = {"bits_per_byte": -sum_ll_mt / n_bytes / math.log(2), "byte_perplexity": math.exp(-sum_ll_mt / n_bytes),
                "word_perplexity": math.exp(-sum_ll_mt / n_words)}
        got = results["results"]["shakespeare_ppl"]
        for k, v in mine.items():
            theirs = got.get(k + ",none")
            rel = abs(theirs - v) / abs(v)
            rows.append(("", k, "%.7g" % theirs, "%.7g" % v, "%.1e" % rel, "rel"))
            if not rel <= REL:
                failures.append("shakespeare_ppl %s: lm-eval %.9g, moetrain %.9g" % (k, theirs, v))

    # ---------------------------------------------------------------- multiple choice
    mc = samples("shakespeare_next_line")
    if mc is not None:
        worst, acc, acc_norm, ambiguous = 0.0, 0, 0, 0
        for s in mc:
            doc = s["doc"]
            context = doc["context"]
            n_sp = len(context) - len(context.rstrip())
            lls_mt = []
            s_ctx = None
            for j, choice in enumerate(doc["choices"]):
                ctx, cont = (context[:-n_sp], context[-n_sp:] + choice) if n_sp else (context, choice)
                ctx_ids = encode(ctx)
                whole = encode(ctx + cont)
                if s_ctx is None:
                    s_ctx = mt.summed_loss(ctx_ids)
                s_whole = mt.summed_loss(whole)
                ll_mt = s_ctx - s_whole
                ll_lm = float(s["filtered_resps"][j][0])
                lls_mt.append(ll_mt)
                worst = max(worst, abs(ll_lm - ll_mt) / (abs(s_whole) + abs(s_ctx)))
                if not close(ll_lm, ll_mt, abs(s_whole) + abs(s_ctx)):
                    failures.append("shakespeare_next_line doc %d choice %d: lm-eval %.9g, moetrain %.9g"
                                    % (s["doc_id"], j, ll_lm, ll_mt))
            lens = [float(len(c)) for c in doc["choices"]]
            best = max(range(4), key=lambda j: (lls_mt[j], -j))
            best_norm = max(range(4), key=lambda j: (lls_mt[j] / lens[j], -j))
            srt = sorted(lls_mt)
            if srt[-1] - srt[-2] <= REL * abs(srt[-1]) * 2:
                ambiguous += 1
            acc += best == int(doc["label"])
            acc_norm += best_norm == int(doc["label"])
        got = results["results"]["shakespeare_next_line"]
        n = len(mc)
        rows.append(("shakespeare_next_line", "questions checked", n, n, "", ""))
        rows.append(("", "log-likelihood (per choice)", "", "", "%.1e" % worst, "worst rel"))
        for k, v in (("acc", acc / n), ("acc_norm", acc_norm / n)):
            theirs = got.get(k + ",none")
            rows.append(("", k, "%.4f" % theirs, "%.4f" % v, "%.4f" % abs(theirs - v), "abs"))
            if abs(theirs - v) > ambiguous / n + 1e-12:
                failures.append("shakespeare_next_line %s: lm-eval %.6f, moetrain %.6f" % (k, theirs, v))
        if ambiguous:
            rows.append(("", "near-ties (two best within tolerance)", ambiguous, "", "", ""))

    if ppl is None and mc is None:
        die(2, "%s has no samples of shakespeare_ppl or shakespeare_next_line" % folder)
    print("%s: lm-eval results %s, %d moetrain eval runs" % (export, results_path, mt.n))
    print("| task | quantity | lm-eval | moetrain eval | difference | |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| %s | %s | %s | %s | %s | %s |" % r)
    for f in failures[:20]:
        print("FAIL: " + f)
    if failures:
        print("FAIL: %d disagreement(s) beyond the tolerance (%.0e relative)" % (len(failures), REL))
        return 1
    print("OK: lm-eval agrees with moetrain eval within %.0e relative" % REL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
