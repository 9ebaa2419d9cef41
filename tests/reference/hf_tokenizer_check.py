"""An export's tokenizer files in transformers against moetrain's ids.

usage: hf_tokenizer_check.py EXPORT_DIR CASES_JSON

CASES_JSON (written by tests/cli/export_tokenizer_test.cpp from moetrain's
tokenizer): {"bos": str|null, "eos": str|null, "cases": [{"text": str,
"ids": [...] (moetrain's encode), "document": [...] (what prepare writes for
the text as one document), "decoded": str (moetrain's decode of ids)}]}.

AutoTokenizer.from_pretrained(EXPORT_DIR) must give, for every text: ids with
add_special_tokens=False, document with add_special_tokens=True, decoded from
decode(ids); and the bos/eos tokens named. Without transformers (CI has it:
launch/test.sh's build/venv-hf-ci, transformers 4.47.1), the same with tokenizers'
Tokenizer.from_file(EXPORT_DIR/tokenizer.json), bos/eos read from
tokenizer_config.json. Prints one line per difference (at most 10) and a summary;
exits 1 on any difference.
"""
import json
import os
import sys


class TokenizersOnly:
    """The part of transformers' tokenizer API used below, on tokenizers alone."""

    def __init__(self, export_dir):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
        with open(os.path.join(export_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        self.bos_token, self.eos_token = config.get("bos_token"), config.get("eos_token")

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": self.tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def main():
    export_dir, cases_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as f:
        spec = json.load(f)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(export_dir)
    except ImportError:
        tok = TokenizersOnly(export_dir)
    problems = []
    if tok.bos_token != spec["bos"]:
        problems.append(f"bos_token is {tok.bos_token!r}, moetrain's {spec['bos']!r}")
    if tok.eos_token != spec["eos"]:
        problems.append(f"eos_token is {tok.eos_token!r}, moetrain's {spec['eos']!r}")
    n_ids = 0
    for i, case in enumerate(spec["cases"]):
        text = case["text"]
        got = tok(text, add_special_tokens=False)["input_ids"]
        if got != case["ids"]:
            problems.append(f"text {i} {text[:40]!r}: ids {got[:20]} != moetrain's {case['ids'][:20]}")
        doc = tok(text)["input_ids"]
        if doc != case["document"]:
            problems.append(f"text {i} {text[:40]!r}: document {doc[:8]}...{doc[-4:]} != moetrain's "
                            f"{case['document'][:8]}...{case['document'][-4:]}")
        decoded = tok.decode(case["ids"])
        if decoded != case["decoded"]:
            problems.append(f"text {i}: decode gives {decoded[:40]!r}, moetrain {case['decoded'][:40]!r}")
        n_ids += len(case["ids"])
    for p in problems[:10]:
        print(p)
    print(f"{type(tok).__name__}: {len(spec['cases'])} texts, {n_ids} ids: "
          + ("all equal" if not problems else f"{len(problems)} differences"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
