#!/usr/bin/python3
"""Independent safetensors reader and writer, for tests/checkpoint/safetensors_test.cpp.

Written from the format description alone (shared/ECOSYSTEM_AND_RELIABILITY.md,
"Safetensors, exactly"), with json, struct and numpy (and sys), so that it shares no code
with src/checkpoint/safetensors.cpp.

  safetensors_read.py read FILE OUT.json
      Parses and strictly validates FILE, prints one line per tensor (name, dtype,
      shape, offsets) and writes OUT.json:
        {"header_length": N, "data_start": 8+N, "metadata": {...} or null,
         "tensors": [{"name", "dtype", "shape", "data_offsets", "values"}, ...]}
      tensors in data-offset order, values flattened row-major. Exits 1 with a message
      on stderr when FILE is not valid safetensors.

  As a module: write_arrays(path, {name: numpy array}, metadata) writes a file
  (used by gpt2_reference.py).

  safetensors_read.py write SPEC.json OUT.safetensors OUT_VALUES.json
      SPEC.json = {"seed": S, "metadata": {...} (optional),
                   "tensors": [{"name", "dtype", "shape", "values" (optional)}, ...]}.
      Values not given are drawn from numpy.random.default_rng(S) (normal for floats,
      uniform over the whole range for integers). The data goes in spec order, the
      header keys in reverse order with "__metadata__" last (readers must sort by
      offsets), header space-padded so the data is 8-byte aligned. OUT_VALUES.json has
      the "read" form above, with the values as stored (F16/BF16 rounded).

Values in JSON: integers exactly; floats as shortest round-trip decimals; NaN and
infinities as the strings "nan", "inf", "-inf".
"""
import json
import struct
import sys

import numpy as np

MAX_HEADER = 100_000_000
# dtype name -> (numpy little-endian storage type, bytes per element)
DTYPES = {
    "F64": ("<f8", 8), "F32": ("<f4", 4), "F16": ("<f2", 2), "BF16": ("<u2", 2),
    "I64": ("<i8", 8), "I32": ("<i4", 4), "U16": ("<u2", 2),
}


class FormatError(Exception):
    pass


def bf16_bits_to_f32(bits):
    return (bits.astype("<u4") << 16).view("<f4")


def f32_to_bf16_bits(values):
    """Round to nearest even (NaN is not expected in test data)."""
    u = np.asarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def json_values(array):
    out = []
    for v in array.reshape(-1).tolist():
        if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))):
            out.append("nan" if v != v else ("inf" if v > 0 else "-inf"))
        else:
            out.append(v)
    return out


def decode(dtype, raw, shape):
    storage, _ = DTYPES[dtype]
    array = np.frombuffer(raw, dtype=storage)
    if dtype == "BF16":
        array = bf16_bits_to_f32(array)
    return array.reshape(shape)


def no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    for k in keys:
        if keys.count(k) > 1:
            raise FormatError(f"duplicate key {k!r}")
    return dict(pairs)


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise FormatError(f"{len(blob)} bytes, shorter than the header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER:
        raise FormatError(f"header length {n} over {MAX_HEADER}")
    if 8 + n > len(blob):
        raise FormatError(f"header length {n} beyond the file end ({len(blob)} bytes)")
    text = blob[8:8 + n].decode("utf-8")
    if not text.startswith("{"):
        raise FormatError("header does not start with '{'")
    header = json.loads(text, object_pairs_hook=no_duplicates)
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise FormatError("__metadata__ is not a string->string map")
    data = blob[8 + n:]
    entries = []
    for name, e in header.items():
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
            raise FormatError(f"{name}: missing fields in {e}")
        dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        if dtype not in DTYPES:
            raise FormatError(f"{name}: unknown dtype {dtype}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise FormatError(f"{name}: bad shape {shape}")
        numel = 1
        for d in shape:
            numel *= d
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise FormatError(f"{name}: bad data_offsets {e['data_offsets']}")
        if end - begin != numel * DTYPES[dtype][1]:
            raise FormatError(f"{name}: {end - begin} bytes for {dtype}{shape}")
        entries.append((begin, end, name, dtype, shape))
    entries.sort()
    position = 0
    for begin, end, name, _, _ in entries:
        if begin != position:
            raise FormatError(f"{name}: starts at {begin}, expected {position} (hole or overlap)")
        position = end
    if position != len(data):
        raise FormatError(f"data buffer is {len(data)} bytes, tensors cover {position}")
    tensors = []
    for begin, end, name, dtype, shape in entries:
        print(f"{name} {dtype} {shape} [{begin}, {end}]")
        tensors.append({"name": name, "dtype": dtype, "shape": shape, "data_offsets": [begin, end],
                        "values": json_values(decode(dtype, data[begin:end], shape))})
    return {"header_length": n, "data_start": 8 + n, "metadata": metadata, "tensors": tensors}


def parse_value(v):
    return float(v) if isinstance(v, str) else v


def make_values(rng, dtype, shape, given):
    count = int(np.prod(shape, dtype=np.int64))
    if dtype in ("F64", "F32", "F16", "BF16"):
        values = np.array([parse_value(v) for v in given], dtype="<f8") if given is not None \
            else rng.standard_normal(count)
        if dtype == "BF16":
            return f32_to_bf16_bits(values.astype("<f4"))
        return values.astype(DTYPES[dtype][0])
    info = np.iinfo(DTYPES[dtype][0])
    if given is not None:
        return np.array(given, dtype=DTYPES[dtype][0])
    return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=DTYPES[dtype][0])


def write_file(out_path, entries, metadata=None):
    """entries: (name, dtype, shape, raw little-endian bytes), in data order. Header keys
    go in reverse order with "__metadata__" last (readers must sort by offsets), the
    header space-padded so the data is 8-byte aligned."""
    header, chunks, position = {}, [], 0
    for name, dtype, shape, raw in entries:
        assert len(raw) == int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + len(raw)]}
        chunks.append(raw)
        position += len(raw)
    reordered = dict(reversed(list(header.items())))
    if metadata is not None:
        reordered["__metadata__"] = metadata
    text = json.dumps(reordered, ensure_ascii=False).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(out_path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


NUMPY_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32",
                "uint16": "U16"}


def write_arrays(out_path, arrays, metadata=None):
    """Writes a dict name -> numpy array (F64/F32/F16/I64/I32/U16 by the array's dtype)."""
    entries = []
    for name, a in arrays.items():
        dtype = NUMPY_DTYPES[a.dtype.name]
        entries.append((name, dtype, a.shape, np.ascontiguousarray(a, dtype=DTYPES[dtype][0]).tobytes()))
    write_file(out_path, entries, metadata)


def write(spec_path, out_path, values_path):
    with open(spec_path) as f:
        spec = json.load(f)
    rng = np.random.default_rng(spec["seed"])
    entries = []
    for t in spec["tensors"]:
        stored = make_values(rng, t["dtype"], t["shape"], t.get("values"))
        entries.append((t["name"], t["dtype"], t["shape"], stored.astype(DTYPES[t["dtype"]][0]).tobytes()))
    write_file(out_path, entries, spec.get("metadata"))
    with open(values_path, "w") as f:
        json.dump(read(out_path), f)


def main(argv):
    if len(argv) == 4 and argv[1] == "read":
        try:
            result = read(argv[2])
        except (FormatError, ValueError, KeyError, TypeError) as e:
            print(f"{argv[2]}: not valid safetensors: {e}", file=sys.stderr)
            return 1
        with open(argv[3], "w") as f:
            json.dump(result, f)
        return 0
    if len(argv) == 5 and argv[1] == "write":
        write(argv[2], argv[3], argv[4])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
