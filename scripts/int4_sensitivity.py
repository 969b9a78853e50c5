#!/usr/bin/env python3
"""Where an AWQ checkpoint loses its perplexity: an F32 model in which only the
weights whose names match a pattern take their dequantized AWQ values.

    python3 scripts/int4_sensitivity.py --f32 models/SmolLM2-135M-Instruct \
        --awq /tmp/awq --only '\\.up_proj\\.' --out /tmp/mixed
    nanoinfer perplexity --model /tmp/mixed --file tests/data/ppl.txt --max-tokens 512

The dequantization is `int4_golden.py`'s reference reader (AutoAWQ's unpacking).
numpy only; the model files are read with numpy, not the safetensors package.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
from pathlib import Path

import numpy as np

from int4_golden import awq_dequant, write_safetensors

NP_DTYPE = {"F32": np.float32, "F16": np.float16, "I32": np.int32}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    body = memoryview(raw)[8 + n:]
    out = {}
    for name, t in header.items():
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(body[a:b], dtype=NP_DTYPE[t["dtype"]]).reshape(t["shape"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--f32", type=Path, required=True, help="the F32 model directory")
    ap.add_argument("--awq", type=Path, required=True, help="its AWQ checkpoint (nanoinfer quantize)")
    ap.add_argument("--only", required=True, help="regex over weight names to replace")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    weights = read_safetensors(args.f32 / "model.safetensors")
    quant = read_safetensors(args.awq / "model.safetensors")
    group = json.loads((args.awq / "config.json").read_text())["quantization_config"]["group_size"]
    pattern = re.compile(args.only)
    replaced = 0
    for name in list(weights):
        prefix = name.removesuffix(".weight")
        if not pattern.search(name) or prefix + ".qweight" not in quant:
            continue
        n_in = weights[name].shape[1]
        weights[name] = awq_dequant(quant[prefix + ".qweight"], quant[prefix + ".qzeros"],
                                    quant[prefix + ".scales"], group, n_in)
        replaced += 1
    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.f32.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, args.out / f.name)
    write_safetensors(args.out / "model.safetensors", weights)
    print(f"{replaced} weights replaced by their AWQ values -> {args.out}")


if __name__ == "__main__":
    main()
