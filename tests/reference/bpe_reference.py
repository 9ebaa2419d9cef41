#!/usr/bin/env python3
"""Reference tokenizers and ids for tests/data/bpe_test.cpp, from the originals:
Hugging Face `tokenizers` and OpenAI's `tiktoken` (PyPI; a venv, e.g.
  python3 -m venv /work/.venv-tok && /work/.venv-tok/bin/pip install tokenizers tiktoken).

  bpe_reference.py fixtures OUT   the small tokenizers trained here on the shipped
                                  corpus, the stress texts and the originals' ids
                                  (committed as tests/data/bpe/; rerun by the test
                                  when the packages import, and compared)
  bpe_reference.py big OUT        a tokenizer of more than 65,536 tokens (too big
                                  to commit) and the GPT-2 tables as tokenizer.json
                                  and rank file, with their ids on the same texts

Everything is deterministic: HF's BPE trainer breaks ties by the pair's ids, and the
texts are fixed or drawn from a seeded generator. OUT/expected.json maps each
tokenizer file to {"texts": [...], "ids": [[...], ...]}; texts are in OUT/texts.json
(a list of strings; JSON escapes keep invisible characters visible).
"""
import base64
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
import tiktoken

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(ROOT, "data", "tinyshakespeare.txt")

# Llama 3's and cl100k's split pattern; Qwen2's differs in \p{N} (one digit a piece).
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# DeepSeek-V3's pre-tokenizer: a Sequence of Splits.
DEEPSEEK = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"]
# Kimi K2's pattern (tokenization_kimi.py): \p{Han} and class intersection (&&).
KIMI = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
# o200k's pattern (case classes, \p{M}, [\r\n/]).
O200K = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])


def corpus_text():
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    # Some non-Latin text so that merges cover other scripts too.
    extra = ("我爱自然语言处理。東京は日本の首都です。한국어 텍스트입니다. Привет, мир! Γειά σου κόσμε. "
             "مرحبا بالعالم. नमस्ते दुनिया. 12345 67890 3.14159 2024-01-01 café naïve résumé\n") * 40
    return text[:300_000] + extra


def stress_texts():
    t = [
        "",
        " ",
        "\n",
        "Hello world! I'm here, can't you see? WE'LL go; they'RE it's IT'S it'ſ rock'n'roll ’s",
        "Привет мир, γειά σου κόσμε, مرحبا بالعالم, שלום עולם, हिन्दी नमस्ते, ภาษาไทย",
        "我爱自然语言处理。東京は日本の首都です。ひらがな カタカナ 한국어 텍스트 𠀀𠀁 中文字符",
        "Emoji: 👩‍👩‍👧‍👦 👍🏽 🇯🇵 ❤️ 1️⃣ 🤖🤖🤖",
        # Combining marks, decomposed: NFC composes them (é, ä, ñ, Å, 각), others stay.
        "Cafe\u0301 vs Café; a\u0308 n\u0303 A\u030a \u1100\u1161\u11a8 Z\u0367\u0311a\u0308\u0356l \u0301x q\u0307\u0323",
        "a" + " " * 50 + "b\n\n\n   \t\t c   \r\n\r\n\u3000\u00a0 x\u2003y \u180e z\u2028w\u0085v",
        "1234567890 3.14159 1,000,000 2024-01-01 ٣٤٥ ௧௨ ⅫⅣ ½ 𝟙𝟚 99999999",
        "hello<|end_of_text|>world <|begin_of_text|>x<|endoftext|>y <tool>z</tool> <|end_of_text|><|end_of_text|>",
        "a" * 300 + " " + "ab" * 200 + " " + "!?" * 100,
        "end.\n\nNext!\r\n\r\nquote: \"yes\"\n\t- item/path/to/file.txt\n",
        "a\x00b\x07c\x1bd\x7f",
        # Letters and digits new in Unicode 15 (\p{L}, \p{N} in the patterns).
        "x\U0001E030\U0001E031y \U00011F04\U00011F05 \U0001E4F0\U0001E4F1 \U00031350",
        # ... where a wrong table moves piece boundaries across merges (\p{N}{1,3} groups digits).
        "1\U0001E4F0234 5\U0001E4F0678 2\U0001E4F0024 1\U0001E4F0000 he\U0001E030llo 20\U0001E4F124",
        "MixedCASE camelCase HTTPServer XMLHttpRequest iPhone ÉCOLE écoleÉ",
        "tabs\tand\x0bvt\x0cff lone\rCR",
    ]
    with open(CORPUS, encoding="utf-8") as f:
        t.append(f.read()[:1500])
    # Seeded random strings over the awkward classes.
    rng = random.Random(39)
    pools = ["abcXYZ", "0123456789", " \t\n\r\u00a0\u3000", "'\".,;!?-/()[]", "éüñ\u0301\u0308\u0323",
             "中文字東京ひらカタ한국", "🤖👍🏽❤️\u200d", "ſſ'S'T'RE", "<|end_of_text|>", "ΑΒΓαβγабвгд"]
    for _ in range(40):
        s = []
        for _ in range(rng.randint(1, 60)):
            pool = rng.choice(pools)
            if pool.startswith("<|"):
                s.append(pool)
            else:
                s.extend(rng.choice(pool) for _ in range(rng.randint(1, 5)))
        t.append("".join(s))
    return t


SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"]


def train(pre, normalizer, vocab_size, text, name, out, add_prefix_space=False, template=True, ignore_merges=False,
          extra_added=()):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if normalizer:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator([text], trainer=trainer)
    tok.add_special_tokens(SPECIALS)
    for content, normalized in extra_added:
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(content, normalized=normalized, special=False)])
    bos = tok.token_to_id(SPECIALS[0])
    if template:
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair=None,
                                                           special_tokens=[(SPECIALS[0], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    path = os.path.join(out, name)
    tok.save(path)
    return path


def as_string_merges(path):
    """Rewrites the merges of a saved tokenizer.json as "a b" strings (the older form)."""
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)


def rank_file_from(tokenizer_path, out_path, pattern, description_path, specials):
    """The model vocab of a byte-level tokenizer.json as a tiktoken rank file (rank = id) and its description."""
    with open(tokenizer_path, encoding="utf-8") as f:
        j = json.load(f)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    lines = []
    for token, i in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if token in specials:
            continue
        lines.append(base64.b64encode(bytes(byte_of[c] for c in token)).decode() + " " + str(i))
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    added = {a["content"]: a["id"] for a in j["added_tokens"] if a["content"] in specials}
    with open(description_path, "w", encoding="utf-8") as f:
        json.dump({"pattern": pattern, "special_tokens": added, "document_prefix": [SPECIALS[0]]}, f,
                  ensure_ascii=False, indent=1)
    return added


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def tiktoken_encoding(rank_path, pattern, specials, name):
    ranks = {}
    with open(rank_path) as f:
        for line in f:
            if line.strip():
                b, r = line.split()
                ranks[base64.b64decode(b)] = int(r)
    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def hf_ids(path, texts):
    tok = Tokenizer.from_file(path)
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


def fixtures(out):
    os.makedirs(out, exist_ok=True)
    text = corpus_text()
    texts = stress_texts()
    files = {}
    nfc = normalizers.NFC()
    # Llama 3 style: Split (Llama 3 pattern, Isolated) then ByteLevel without regex; NFC (as Qwen2); merges as strings.
    llama = train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
                                           pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                  nfc, 700, text, "llama3_nfc.tokenizer.json", out, ignore_merges=True,
                  extra_added=[("<tool>", True), ("</tool>", False)])
    as_string_merges(llama)
    files["llama3_nfc.tokenizer.json"] = llama
    # GPT-2 style: ByteLevel with its own regex and add_prefix_space, no normalizer, no template.
    files["gpt2_style.tokenizer.json"] = train(pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True), None,
                                               600, text, "gpt2_style.tokenizer.json", out, template=False)
    # DeepSeek-V3 style: a Sequence of Splits, Isolated.
    files["deepseek_style.tokenizer.json"] = train(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), "isolated") for p in DEEPSEEK] +
                                [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        None, 600, text, "deepseek_style.tokenizer.json", out)
    # Every split behaviour, and invert.
    files["behaviors.tokenizer.json"] = train(
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "merged_with_previous"),
                                 pre_tokenizers.Split(Regex(r"\p{N}"), "contiguous"),
                                 pre_tokenizers.Split(Regex(r"[,;]"), "removed"),
                                 pre_tokenizers.Split(Regex(r"[.!?]"), "merged_with_next"),
                                 pre_tokenizers.Split(Regex(r"\p{L}+"), "isolated", invert=True),
                                 pre_tokenizers.Split("--", "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)]),
        nfc, 500, text, "behaviors.tokenizer.json", out)
    expected = {}
    for name, path in files.items():
        expected[name] = hf_ids(path, texts)
    # tiktoken: the Llama-style vocabulary as a rank file, with Llama 3's and o200k's patterns.
    for name, pattern in [("llama3.tiktoken", LLAMA3), ("o200k_style.tiktoken", O200K), ("kimi_style.tiktoken", KIMI)]:
        rank = os.path.join(out, name)
        specials = rank_file_from(llama, rank, pattern, rank + ".json", SPECIALS)
        enc = tiktoken_encoding(rank, pattern, specials, name)
        expected[name] = [enc.encode(t, allowed_special="all") for t in texts]
    with open(os.path.join(out, "texts.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=True, indent=0)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))


def big(out):
    """More than 65,536 tokens: the Llama-style tokenizer grown by merges of its own tokens, plus GPT-2's tables."""
    os.makedirs(out, exist_ok=True)
    texts = stress_texts()
    with open(CORPUS, encoding="utf-8") as f:
        texts.append(f.read()[:200_000])
    # Every code point that Unicode 14 (PCRE2) and the originals' newer Unicode class differently,
    # and every 29th of the rest: the regex translation (bpe.cpp) against both engines.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import unicodedata
    cps = [c for c in range(0x20, 0x110000) if not 0xD800 <= c < 0xE000 and
           (c % 29 == 0 or unicodedata.category(chr(c)) == "Cn" or chr(c).isspace() or c == 0x180E)]
    texts.append("".join(chr(c) + ("a" if i % 3 else " ") for i, c in enumerate(cps)
                         if c % 29 == 0 or c < 0x40000 or chr(c).isspace()))
    text = corpus_text()
    path = train(pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
                 normalizers.NFC(), 4000, text, "big.tokenizer.json", out)
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    vocab = j["model"]["vocab"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in j["model"]["merges"]]
    # Grow: merge pairs of the most frequent short tokens until the vocabulary passes 70,000
    # (ids above 65,535 are then produced by text that has these pairs).
    tokens = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIALS]
    next_id = max(vocab.values()) + 1  # the special tokens are renumbered after the growth
    target = 70_000
    for left in tokens[256:600]:
        for right in tokens[256:600]:
            if next_id >= target:
                break
            new = left + right
            if new in vocab:
                continue
            vocab[new] = next_id
            merges.append([left, right])
            next_id += 1
    for a in j["added_tokens"]:
        a["id"] = next_id
        vocab_id = next_id
        next_id += 1
        if a["content"] in vocab:
            vocab[a["content"]] = vocab_id
    bos = [a["id"] for a in j["added_tokens"] if a["content"] == SPECIALS[0]][0]
    j["post_processor"]["special_tokens"][SPECIALS[0]]["ids"] = [bos]
    j["model"]["merges"] = merges
    with open(path, "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    expected = {"big.tokenizer.json": hf_ids(path, texts)}
    rank = os.path.join(out, "big.tiktoken")
    specials = rank_file_from(path, rank, LLAMA3, rank + ".json", SPECIALS)
    enc = tiktoken_encoding(rank, LLAMA3, specials, "big")
    expected["big.tiktoken"] = [enc.encode(t, allowed_special="all") for t in texts]
    rank = os.path.join(out, "big_kimi.tiktoken")
    specials = rank_file_from(path, rank, KIMI, rank + ".json", SPECIALS)
    enc = tiktoken_encoding(rank, KIMI, specials, "big_kimi")
    expected["big_kimi.tiktoken"] = [enc.encode(t, allowed_special="all") for t in texts]
    # GPT-2's own tables, as HF and as tiktoken read them.
    gpt2 = Tokenizer(models.BPE.from_file(os.path.join(ROOT, "data/gpt2/encoder.json"),
                                          os.path.join(ROOT, "data/gpt2/vocab.bpe")))
    gpt2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    gpt2.decoder = decoders.ByteLevel()
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    gpt2.add_special_tokens(["<|endoftext|>"])
    gpt2_path = os.path.join(out, "gpt2.tokenizer.json")
    gpt2.save(gpt2_path)
    expected["gpt2.tokenizer.json"] = hf_ids(gpt2_path, texts)
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    ranks = data_gym_to_mergeable_bpe_ranks(os.path.join(ROOT, "data/gpt2/vocab.bpe"),
                                            os.path.join(ROOT, "data/gpt2/encoder.json"))
    gpt2_pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    rank = os.path.join(out, "gpt2.tiktoken")
    with open(rank, "w") as f:
        f.write("".join(base64.b64encode(b).decode() + " " + str(r) + "\n" for b, r in ranks.items()))
    with open(rank + ".json", "w") as f:
        json.dump({"pattern": gpt2_pat, "special_tokens": {"<|endoftext|>": 50256}}, f)
    enc = tiktoken.Encoding(name="gpt2x", pat_str=gpt2_pat, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 50256})
    expected["gpt2.tiktoken"] = [enc.encode(t, allowed_special="all") for t in texts]
    with open(os.path.join(out, "texts.json"), "w", encoding="utf-8") as f:
        json.dump(texts, f, ensure_ascii=True)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, separators=(",", ":"))
    # The pre-tokenizer's pieces of the code point sweep (ids alone would not show a boundary
    # between bytes that no merge joins), for each pattern of the family, from HF's pre_tokenize_str.
    sweep = texts[-1]
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    patterns = {"llama3": [LLAMA3], "o200k": [O200K], "kimi": [KIMI], "deepseek": DEEPSEEK}
    pieces = {}
    for name, pats in patterns.items():
        j["pre_tokenizer"] = json.loads(pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(p), "isolated") for p in pats] +
            [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]).__getstate__())
        file = "pieces_" + name + ".tokenizer.json"
        with open(os.path.join(out, file), "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False)
        tok = Tokenizer.from_file(os.path.join(out, file))
        normalized = tok.normalizer.normalize_str(sweep)
        pieces[file] = [bytes(byte_of[c] for c in p).decode("utf-8") for p, _ in tok.pre_tokenizer.pre_tokenize_str(normalized)]
    j["pre_tokenizer"] = json.loads(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True).__getstate__())
    with open(os.path.join(out, "pieces_gpt2.tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(j, f, ensure_ascii=False)
    tok = Tokenizer.from_file(os.path.join(out, "pieces_gpt2.tokenizer.json"))
    pieces["pieces_gpt2.tokenizer.json"] = [bytes(byte_of[c] for c in p).decode("utf-8") for p, _ in
                                            tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(sweep))]
    with open(os.path.join(out, "pieces.json"), "w") as f:
        json.dump({"text": sweep, "pieces": pieces}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("fixtures", "big"):
        sys.exit(__doc__)
    (fixtures if sys.argv[1] == "fixtures" else big)(sys.argv[2])
