"""Reads GGUF files with the `gguf` package's GGUFReader (llama.cpp's gguf-py), the reference for
pollen's GGUF writer. Called by gguf_test.cpp:

  gguf_reference.py FILE.gguf OUT.json [F32_FILE.gguf]

OUT.json holds every key's value, and per tensor its shape (innermost first, as GGUF stores
it), type name and values (dequantised to float). With F32_FILE, each Q8_0 tensor of FILE is also
compared byte for byte with gguf-py's own quantisation of the same tensor in F32_FILE."""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize, quantize


def main():
    reader = GGUFReader(sys.argv[1])
    out = {"fields": {}, "tensors": {}, "q8_0_bytes_differ": 0, "q8_0_tensors": 0}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out["fields"][name] = field.contents()
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        out["tensors"][t.name] = {
            "shape": [int(n) for n in t.shape],
            "type": t.tensor_type.name,
            "offset": int(t.data_offset),
            "values": values.tolist(),
        }
    if len(sys.argv) > 3:
        plain = {t.name: t for t in GGUFReader(sys.argv[3]).tensors}
        for t in reader.tensors:
            if t.tensor_type.name != "Q8_0":
                continue
            ours = np.asarray(t.data).tobytes()
            theirs = quantize(np.asarray(plain[t.name].data, dtype=np.float32), t.tensor_type)
            out["q8_0_tensors"] += 1
            out["q8_0_bytes_differ"] += int(ours != theirs.tobytes())
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
