#!/usr/bin/env python3
"""Round-to-nearest 4-bit variants of a model's projections, written as F32
models for `nanoinfer perplexity`: integer zero points (the AWQ / GPTQ
format, `w = (q - z) * s`, f16 scales) against a float offset (Q4_1's form,
`w = min + q * s`), per group of 32 and of 128 inputs (the last group of a
row may be partial, as in the quantizer). The default model's F32 weights
are the dequantized Q4_1 GGUF, so a float offset at group 32 (aligned with
its blocks) reproduces them exactly; the integer zero points show what the
AWQ format itself costs on such weights. numpy only.

    python3 scripts/int4_zero_points.py --f32 models/SmolLM2-135M-Instruct --out /tmp/zq
    for m in g32-float g32-int g128-float g128-int; do
        nanoinfer perplexity --model /tmp/zq/$m --file tests/data/ppl.txt --max-tokens 512 --threads 2
    done
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

from int4_golden import write_safetensors
from int4_sensitivity import read_safetensors

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_groups(m: np.ndarray, integer_zero: bool) -> np.ndarray:
    """Round-to-nearest of whole groups: m is [rows, groups, group]."""
    lo, hi = m.min(-1, keepdims=True), m.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / 15.0, 1e-12)
    if not integer_zero:
        return lo + np.clip(np.round((m - lo) / scale), 0, 15) * scale
    scale = scale.astype(np.float16).astype(np.float64)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    return (np.clip(np.round(m / scale) + zero, 0, 15) - zero) * scale


def rtn(w: np.ndarray, group: int, integer_zero: bool) -> np.ndarray:
    rows, cols = w.shape
    parts = []
    for c in range(0, cols, group):
        part = w[:, c:c + group].astype(np.float64)
        size = part.shape[1]
        parts.append(rtn_groups(part.reshape(rows, 1, size), integer_zero).reshape(rows, size))
    return np.concatenate(parts, axis=1).astype(np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--f32", type=Path, required=True, help="the F32 model directory")
    ap.add_argument("--out", type=Path, required=True, help="where the four models go")
    args = ap.parse_args()
    weights = read_safetensors(args.f32 / "model.safetensors")
    for group in (32, 128):
        for integer_zero in (True, False):
            name = f"g{group}-{'int' if integer_zero else 'float'}"
            out = args.out / name
            out.mkdir(parents=True, exist_ok=True)
            tensors, errors = {}, []
            for key, w in weights.items():
                if any(p in key for p in PROJECTIONS):
                    tensors[key] = rtn(w, group, integer_zero)
                    errors.append(np.mean((tensors[key] - w) ** 2) / np.mean(w.astype(np.float64) ** 2))
                else:
                    tensors[key] = w
            for f in args.f32.iterdir():
                if f.is_file() and f.name != "model.safetensors":
                    shutil.copy(f, out / f.name)
            write_safetensors(out / "model.safetensors", tensors)
            print(f"{name}: relative weight MSE {np.mean(errors):.3e} -> {out}")


if __name__ == "__main__":
    main()
