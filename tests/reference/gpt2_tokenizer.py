#!/usr/bin/python3
"""Reference GPT-2 tokenizer: OpenAI's gpt-2 src/encoder.py, ported unchanged in
substance (bytes_to_unicode, get_pairs, Encoder.bpe, Encoder.encode), for
golden token ids in tests/data/tokenizer_test.cpp.

Usage: gpt2_tokenizer.py ENCODER_DIR INPUT OUTPUT [--errors strict|replace] [--pieces]

Reads INPUT as bytes and decodes it as UTF-8 with the given error handler
(strict: ill-formed UTF-8 is an error, exit code 1; replace: U+FFFD per
maximal ill-formed subpart), so line ends are kept as they are (no newline
translation). Writes the token ids to OUTPUT as text, one id per line; with
--pieces, the pre-tokenizer's pieces instead (the regex matches), one per
line as the hex of their UTF-8 bytes.
Needs only the standard library and `regex` (Debian python3-regex).
"""

import json
import sys
from functools import lru_cache

import regex as re


@lru_cache()
def bytes_to_unicode():
    """Maps each byte to a printable unicode character (encoder.py, verbatim)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    cs = [chr(n) for n in cs]
    return dict(zip(bs, cs))


def get_pairs(word):
    """Set of adjacent symbol pairs in a word (a tuple of symbols)."""
    pairs = set()
    prev_char = word[0]
    for char in word[1:]:
        pairs.add((prev_char, char))
        prev_char = char
    return pairs


class Encoder:
    def __init__(self, encoder, bpe_merges, errors="replace"):
        self.encoder = encoder
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.errors = errors
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.bpe_ranks = dict(zip(bpe_merges, range(len(bpe_merges))))
        self.cache = {}
        self.pat = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        pairs = get_pairs(word)
        if not pairs:
            return token
        while True:
            bigram = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new_word = []
            i = 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                    new_word.extend(word[i:j])
                    i = j
                except ValueError:
                    new_word.extend(word[i:])
                    break
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new_word.append(first + second)
                    i += 2
                else:
                    new_word.append(word[i])
                    i += 1
            new_word = tuple(new_word)
            word = new_word
            if len(word) == 1:
                break
            else:
                pairs = get_pairs(word)
        word = " ".join(word)
        self.cache[token] = word
        return word

    def encode(self, text):
        bpe_tokens = []
        for token in re.findall(self.pat, text):
            token = "".join(self.byte_encoder[b] for b in token.encode("utf-8"))
            bpe_tokens.extend(self.encoder[bpe_token] for bpe_token in self.bpe(token).split(" "))
        return bpe_tokens


def get_encoder(directory):
    with open(directory + "/encoder.json", "r", encoding="utf-8") as f:
        encoder = json.load(f)
    with open(directory + "/vocab.bpe", "r", encoding="utf-8") as f:
        bpe_data = f.read()
    bpe_merges = [tuple(merge_str.split()) for merge_str in bpe_data.split("\n")[1:-1]]
    return Encoder(encoder=encoder, bpe_merges=bpe_merges)


def main(argv):
    args = argv[1:]
    pieces = "--pieces" in args
    if pieces:
        args.remove("--pieces")
    errors = "strict"
    if len(args) == 5 and args[3] == "--errors" and args[4] in ("strict", "replace"):
        errors = args[4]
        args = args[:3]
    if len(args) != 3:
        sys.stderr.write(__doc__)
        return 2
    encoder_dir, input_path, output_path = args
    with open(input_path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        sys.stderr.write(f"{input_path}: {e}\n")
        return 1
    encoder = get_encoder(encoder_dir)
    if pieces:
        lines = [piece.encode("utf-8").hex() for piece in re.findall(encoder.pat, text)]
    else:
        lines = [str(i) for i in encoder.encode(text)]
    with open(output_path, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
