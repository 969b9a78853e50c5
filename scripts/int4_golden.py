#!/usr/bin/env python3
"""Golden fixtures for NanoInfer's AWQ/GPTQ loaders (tests/int4_format.rs).

Writes tiny int4 checkpoints under tests/data/int4/<case>/ (model.safetensors +
config.json with quantization_config) and, next to each, expected.safetensors
holding every layer's dequantized weight `X.weight` as f32 [out, in], computed
the way the reference readers do it (numpy only; no torch needed):

AWQ, GEMM version (AutoAWQ's / transformers' `unpack_awq` + `reverse_awq_order`):
    iweight = (qweight[:, :, None] >> [0, 4, ..., 28]) & 0xF   -> [in, out/8, 8]
    columns of each 8 reordered with AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
    izeros likewise from qzeros
    W[in, out] = (iweight - izeros[group(in)]) * scales[group(in)]

GPTQ (AutoGPTQ / transformers-optimum dequantization):
    zeros  = (qzeros[:, :, None] >> shifts) & 0xF -> [groups, out], then + 1
             for checkpoint_format "gptq" (v1 stores z - 1), as is for "gptq_v2"
    weight = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF -> [in, out]
    W[in, out] = scales[g_idx] * (weight - zeros[g_idx])

The linear layer's weight is W transposed ([out, in]). Packing is the inverse
(AWQ packs column AWQ_ORDER[p] = [0, 2, 4, 6, 1, 3, 5, 7][p] into nibble p),
and the script checks that unpacking returns the values it packed.

Usage: python3 scripts/int4_golden.py [--out tests/data/int4]
The output is deterministic (seeded); rerunning rewrites identical files.
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)

ST_DTYPE = {np.dtype(np.int32): "I32", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format by hand: u64 header length, JSON header, data."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        data = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": ST_DTYPE[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def pack_nibbles(cols: np.ndarray) -> np.ndarray:
    """cols[..., 8] (values 0..15) -> int32 with cols[..., p] in bits 4p..4p+4."""
    words = np.zeros(cols.shape[:-1], dtype=np.uint32)
    for p in range(8):
        words |= (cols[..., p].astype(np.uint32) & 0xF) << np.uint32(4 * p)
    return words.view(np.int32)


# --- AWQ ----------------------------------------------------------------------

def awq_pack(q_in_out: np.ndarray) -> np.ndarray:
    """[rows, out] values -> [rows, out/8] int32, column ORDER[p] in nibble p."""
    r, o = q_in_out.shape
    grouped = q_in_out.reshape(r, o // 8, 8)[:, :, AWQ_ORDER]
    return pack_nibbles(grouped)


def awq_unpack(packed: np.ndarray) -> np.ndarray:
    """The reference reader: shift out nibbles, then reverse AWQ's column order."""
    u = packed.view(np.uint32)
    nib = (u[:, :, None] >> SHIFTS[None, None, :]) & 0xF
    return nib[:, :, AWQ_REVERSE_ORDER].reshape(u.shape[0], -1).astype(np.int64)


def awq_dequant(qweight, qzeros, scales, group, n_in):
    iw = awq_unpack(qweight)                       # [in, out]
    iz = awq_unpack(qzeros)                        # [groups, out]
    g = np.arange(n_in) // group
    w = (iw - iz[g]).astype(np.float32) * scales.astype(np.float32)[g]
    return w.T.copy()                              # [out, in]


# --- GPTQ ---------------------------------------------------------------------

def gptq_pack_weight(q_in_out: np.ndarray) -> np.ndarray:
    """[in, out] -> [in/8, out]: input 8r + p of column o in nibble p of word (r, o)."""
    n_in, o = q_in_out.shape
    return pack_nibbles(q_in_out.reshape(n_in // 8, 8, o).transpose(0, 2, 1))


def gptq_dequant(qweight, qzeros, scales, g_idx, v2):
    u = qweight.view(np.uint32)
    weight = ((u[:, None, :] >> SHIFTS[None, :, None]) & 0xF).reshape(-1, u.shape[1])  # [in, out]
    z = qzeros.view(np.uint32)
    zeros = ((z[:, :, None] >> SHIFTS[None, None, :]) & 0xF).reshape(z.shape[0], -1)   # [groups, out]
    zeros = zeros.astype(np.int64) + (0 if v2 else 1)
    w = scales.astype(np.float32)[g_idx] * (weight.astype(np.int64) - zeros[g_idx]).astype(np.float32)
    return w.T.copy()


def scales_f16(rng, shape):
    return (rng.uniform(0.002, 0.05, size=shape)).astype(np.float16)


def make_awq(rng, out_dir: Path, group: int):
    tensors, expected = {}, {}
    for name, (n_out, n_in) in {"layers.0.proj": (16, 64), "layers.1.proj": (24, 80)}.items():
        ng = -(-n_in // group)
        q = rng.integers(0, 16, size=(n_in, n_out))
        z = rng.integers(0, 16, size=(ng, n_out))
        s = scales_f16(rng, (ng, n_out))
        qweight, qzeros = awq_pack(q), awq_pack(z)
        assert (awq_unpack(qweight) == q).all() and (awq_unpack(qzeros) == z).all()
        tensors |= {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": s}
        expected[f"{name}.weight"] = awq_dequant(qweight, qzeros, s, group, n_in)
        want = ((q - z[np.arange(n_in) // group]) * s.astype(np.float32)[np.arange(n_in) // group]).T
        assert np.array_equal(expected[f"{name}.weight"], want.astype(np.float32))
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    return tensors, expected, qc


def make_gptq(rng, out_dir: Path, group: int, v2: bool):
    tensors, expected = {}, {}
    layers = {"layers.0.proj": (16, 64, False), "layers.1.proj": (8, 128, True)}
    for name, (n_out, n_in, act_order) in layers.items():
        ng = n_in // group
        g_idx = np.arange(n_in) // group
        if act_order:
            # desc_act: inputs visited in a permuted order, g_idx[perm[i]] = i // group.
            perm = rng.permutation(n_in)
            g_idx = np.empty(n_in, dtype=np.int64)
            g_idx[perm] = np.arange(n_in) // group
        q = rng.integers(0, 16, size=(n_in, n_out))
        z = rng.integers(0 if v2 else 1, 16, size=(ng, n_out))   # v1 cannot store z = 0
        s = scales_f16(rng, (ng, n_out))
        stored = z if v2 else z - 1
        qweight = gptq_pack_weight(q)
        qzeros = pack_nibbles(stored.reshape(ng, n_out // 8, 8))
        tensors |= {f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": s,
                    f"{name}.g_idx": g_idx.astype(np.int32)}
        expected[f"{name}.weight"] = gptq_dequant(qweight, qzeros, s, g_idx, v2)
        want = ((q - z[g_idx]) * s.astype(np.float32)[g_idx]).T
        assert np.array_equal(expected[f"{name}.weight"], want.astype(np.float32))
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": False, "desc_act": True,
          "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    return tensors, expected, qc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/data/int4"))
    args = ap.parse_args()
    rng = np.random.default_rng(20261122)
    cases = {
        "awq-g32": lambda: make_awq(rng, None, 32),
        "gptq-g32": lambda: make_gptq(rng, None, 32, v2=False),
        "gptq_v2-g64": lambda: make_gptq(rng, None, 64, v2=True),
    }
    for case, make in cases.items():
        d = Path(args.out) / case
        d.mkdir(parents=True, exist_ok=True)
        tensors, expected, qc = make()
        write_safetensors(d / "model.safetensors", tensors)
        write_safetensors(d / "expected.safetensors", expected)
        (d / "quantization_config.json").write_text(json.dumps(qc, indent=1) + "\n")
        print(f"{d}: {len(expected)} layers")


if __name__ == "__main__":
    main()
