#!/usr/bin/env python3
"""Generate the committed reference files under tests/data/ with transformers.

Tests and CI read these files; only this script needs torch + transformers.
Run it after `scripts/fetch_model.py` (f32, and bf16 for the extra perplexity):

    python3 scripts/make_goldens.py [--model DIR] [--bf16-model DIR]
                                    [--only smollm2,tiny,processors]

Everything is float32 on CPU with eager attention, seeded, and deterministic.

Files written
-------------
tests/data/goldens/smollm2.json          SmolLM2-135M-Instruct (our f32 conversion)
tests/data/goldens/tiny-qwen2.json       random-weight models below
tests/data/goldens/tiny-qwen3.json
tests/data/goldens/tiny-llama3.json
tests/data/goldens/logits_processors.json
tests/data/tiny-{qwen2,qwen3,llama3}/    config.json + model.safetensors (F32)
tests/data/ppl.txt                       hand-written English text (committed)

Generation golden schema (smollm2.json and tiny-*.json)
--------------------------------------------------------
{
  "schema_version": 1,
  "generator": "scripts/make_goldens.py",
  "transformers_version": str, "torch_version": str,
  "model": str,                 # directory, relative to the repo root
  "dtype": "float32", "attn_implementation": "eager",
  "max_new_tokens": int,        # 48 for smollm2, 32 for tiny models
  "top_k": 5,
  "eos_token_ids": [int],       # [] for tiny models (no eos stopping anyway)
  "add_special_tokens": bool,   # how `text`/`rendered` were encoded (smollm2 only)
  "cases": [{
    "name": str,
    "text": str | null,         # raw prompt or chat user message; null for tiny models
    "chat": bool,
    "rendered": str | null,     # chat-template output (add_generation_prompt=True)
    "prompt_ids": [int],
    "output_ids": [int],        # exactly max_new_tokens greedy tokens, no eos stop
    "eos_positions": [int],     # indices into output_ids holding an eos id
    "top_logits": [[[id, logit], ... top_k] per generated step],
                                # step i = logits that chose output_ids[i], sorted
                                # by logit descending; float32 values
    "min_top1_margin": float    # smallest top1 - top2 logit gap over all steps
  }],
  "perplexity": {...}           # smollm2 only, see below
}
Greedy decoding recomputes the full sequence each step (no KV cache), so every
step's logits are those of a plain forward pass over prompt + outputs so far.

perplexity (smollm2.json):
  {"file": "tests/data/ppl.txt", "max_tokens": 512, "add_special_tokens": false,
   "n_tokens": int,             # tokens scored = min(512, tokens in the file)
   "n_predictions": n_tokens-1, "nll_mean": float,
   "ppl": float,                # exp(loss) of model(ids, labels=ids), f32 model
   "ppl_bf16_weights": float}   # same, bf16 conversion loaded as float32

Logits processor golden schema (logits_processors.json)
-------------------------------------------------------
{
  "schema_version": 1, "generator": ..., "transformers_version": ..., "torch_version": ...,
  "masked_value": -1e30,        # entries set to -inf by a processor are written as -1e30
  "logits": [float] (64),       # input scores, float32
  "input_ids": [int],           # token history used by the penalties
  "cases": [{
    "name": str,
    "processor": "repetition_penalty" | "temperature" | "top_k" | "top_p" | "min_p"
                 | "presence_frequency" | "chain",
    "params": {...},            # e.g. {"penalty": 1.3}, {"top_k": 5}
    "output": [float] (64)      # scores after the processor; -1e30 = masked
  }]
}
repetition_penalty..min_p are transformers' RepetitionPenaltyLogitsProcessor,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper
(min_tokens_to_keep=1). presence_frequency is the OpenAI formula in numpy:
logits - presence * (count > 0) - frequency * count. "chain" cases
apply repetition_penalty, temperature, top_k, top_p, min_p in that order (the
order transformers' generate uses; params {penalty, temperature, top_k, top_p,
min_p}) and also store "probs", the softmax of the output. "chain" uses the
single-processor parameters (1 token survives), "chain_wide" keeps several.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_model  # noqa: E402

REPO = fetch_model.REPO_ROOT
DATA = REPO / "tests" / "data"
GOLDENS = DATA / "goldens"
TOP_K = 5
MASKED = -1e30
MIN_TINY_MARGIN = 1e-2  # we ask more than the 1e-3 the tests need

RAW_PROMPTS = [
    ("roman", "The history of the Roman Empire begins"),
    ("code", 'def quicksort(arr):\n    """Sort a list of integers in place."""\n'),
    ("numbers", "In 1969, Apollo 11 flew 384,400 km to the Moon: 3 astronauts, 8 days, 21.5 hours on the surface. By 1972,"),
    ("multilingual", "Bonjour ! Je m'appelle Élodie. 日本の首都は東京です。Привет, как дела? ¿Qué tal?"),
]
CHAT_PROMPTS = [
    ("chat_capital", "What is the capital of France?"),
    ("chat_bread", "Give me three tips for baking bread at home."),
    ("chat_math", "What is 12 times 7? Explain briefly."),
    ("chat_code", "Write a Python function that reverses a string."),
]


def log(msg: str) -> None:
    print(f"[make_goldens] {msg}", file=sys.stderr, flush=True)


def f32(x) -> float:
    """A float32 as the shortest decimal that parses back to the same float32."""
    x = np.float32(x)
    if not np.isfinite(x):
        if x < 0:
            return MASKED
        raise ValueError(f"non-finite value {x}")
    return float(str(x))


def header() -> dict:
    return {
        "schema_version": 1,
        "generator": "scripts/make_goldens.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__.split("+")[0],
    }


def rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


_FLAT_LIST = re.compile(r"\[[^\[\]{}\"]*\]")  # a list of numbers only
_LIST_OF_FLAT = re.compile(r"\[(\s*\[[^\[\]{}\"]*\],?)+\s*\]")


def dumps(obj: dict) -> str:
    """Indented JSON whose number lists, and lists of those, sit on one line."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    text = _FLAT_LIST.sub(lambda m: re.sub(r"\s+", "", m.group(0)), text)
    return _LIST_OF_FLAT.sub(lambda m: re.sub(r"\s+", "", m.group(0)), text)


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(obj)
    if json.loads(text) != json.loads(json.dumps(obj)):
        raise RuntimeError("JSON reformatting changed the content")
    path.write_text(text + "\n", encoding="utf-8")
    log(f"wrote {rel(path)} ({path.stat().st_size / 1024:.1f} KiB)")


def load_f32(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


# --------------------------------------------------------------------------
# greedy generation with top-k logits
# --------------------------------------------------------------------------


@torch.no_grad()
def greedy_case(model, prompt_ids: list[int], max_new: int, eos_ids: list[int]) -> dict:
    ids = list(prompt_ids)
    out, tops, margin = [], [], math.inf
    for _ in range(max_new):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        vals, idx = torch.topk(logits, TOP_K)
        nxt = int(logits.argmax())
        if nxt != int(idx[0]):
            raise RuntimeError("argmax and topk disagree")
        margin = min(margin, float(vals[0] - vals[1]))
        tops.append([[int(i), f32(v)] for i, v in zip(idx, vals)])
        out.append(nxt)
        ids.append(nxt)
    return {
        "prompt_ids": list(prompt_ids),
        "output_ids": out,
        "eos_positions": [i for i, t in enumerate(out) if t in eos_ids],
        "top_logits": tops,
        "min_top1_margin": f32(margin),
    }


# --------------------------------------------------------------------------
# SmolLM2
# --------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, ids: list[int]) -> tuple[float, float]:
    t = torch.tensor([ids])
    loss = float(model(t, labels=t).loss)
    return loss, math.exp(loss)


def smollm2(model_dir: Path, bf16_dir: Path | None) -> None:
    log(f"SmolLM2 goldens from {model_dir}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = load_f32(model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    eos = gen_cfg["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    add_special = False  # tokenizer_config has add_bos_token=false; the template has its own markers

    def encode(text: str) -> list[int]:
        a = tok(text, add_special_tokens=add_special).input_ids
        b = raw.encode(text, add_special_tokens=add_special).ids
        if a != b:
            raise RuntimeError(f"AutoTokenizer and tokenizer.json disagree on {text!r}")
        return a

    cases = []
    for name, text in RAW_PROMPTS:
        c = {"name": name, "text": text, "chat": False, "rendered": None}
        c.update(greedy_case(model, encode(text), 48, eos_ids))
        cases.append(c)
        log(f"  {name}: {len(c['prompt_ids'])} prompt tokens, margin {c['min_top1_margin']:.3g}, "
            f"-> {tok.decode(c['output_ids'])[:60]!r}")
    for name, text in CHAT_PROMPTS:
        rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=False)
        c = {"name": name, "text": text, "chat": True, "rendered": rendered}
        c.update(greedy_case(model, encode(rendered), 48, eos_ids))
        cases.append(c)
        log(f"  {name}: {len(c['prompt_ids'])} prompt tokens, eos at {c['eos_positions'][:3]}, "
            f"margin {c['min_top1_margin']:.3g} -> {tok.decode(c['output_ids'])[:60]!r}")

    ppl_file = DATA / "ppl.txt"
    ids = encode(ppl_file.read_text(encoding="utf-8"))[:512]
    nll, ppl = perplexity(model, ids)
    ppl_info = {"file": rel(ppl_file), "max_tokens": 512, "add_special_tokens": add_special,
                "n_tokens": len(ids), "n_predictions": len(ids) - 1,
                "nll_mean": f32(nll), "ppl": f32(ppl)}
    log(f"  perplexity f32: {ppl:.4f} over {len(ids)} tokens")
    if bf16_dir is not None and (bf16_dir / "model.safetensors").is_file():
        del model
        _, ppl_bf16 = perplexity(load_f32(bf16_dir), ids)
        ppl_info["ppl_bf16_weights"] = f32(ppl_bf16)
        log(f"  perplexity bf16 weights: {ppl_bf16:.4f}")
    else:
        log("  bf16 model not found; ppl_bf16_weights omitted")

    golden = header() | {
        "model": f"models/{model_dir.name}",
        "dtype": "float32", "attn_implementation": "eager",
        "max_new_tokens": 48, "top_k": TOP_K, "eos_token_ids": eos_ids,
        "add_special_tokens": add_special, "cases": cases, "perplexity": ppl_info,
    }
    write_json(GOLDENS / "smollm2.json", golden)


# --------------------------------------------------------------------------
# tiny random models
# --------------------------------------------------------------------------

TINY_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_configs() -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        # Qwen2: q/k/v biases (always on in Qwen2Attention), tied embeddings like Qwen2.5-0.5B.
        "qwen2": (Qwen2Config(**TINY_COMMON, rope_theta=1000000.0, tie_word_embeddings=True,
                              use_sliding_window=False, initializer_range=0.3), "classic"),
        # Qwen3: head_dim 32 != 64/4, per-head q/k RMSNorm, tied embeddings like Qwen3-0.6B.
        "qwen3": (Qwen3Config(**TINY_COMMON, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=True,
                              attention_bias=False, initializer_range=0.3), "v5"),
        # Llama 3: llama3 rope scaling whose original context (64) puts head_dim 32's
        # frequencies in all three bands (kept, smoothed, divided by factor).
        "llama3": (LlamaConfig(**TINY_COMMON, head_dim=32, tie_word_embeddings=False, rope_theta=500000.0,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                               initializer_range=0.3), "classic"),
    }


def to_classic_layout(cfg: dict) -> dict:
    """transformers 5 writes `rope_parameters` and `dtype`; most Hub checkpoints use
    the transformers 4 keys `rope_theta`, `rope_scaling` and `torch_dtype`."""
    cfg = dict(cfg)
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)
    return cfg


@torch.no_grad()
def perturb(model, gen: torch.Generator) -> None:
    """Give norms and biases non-trivial values (init sets them to 1 and 0)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def tiny_prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=n).tolist() for n in (1, 5, 17, 40)]


def tiny(arch: str, cfg, layout: str) -> None:
    out_dir = DATA / f"tiny-{arch}"
    for attempt in range(20):
        seed = 1000 + attempt
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
        perturb(model, torch.Generator().manual_seed(seed))
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in out_dir.iterdir():
            f.unlink()
        model.save_pretrained(out_dir, safe_serialization=True)
        (out_dir / "generation_config.json").unlink(missing_ok=True)
        (out_dir / "model.safetensors").chmod(0o644)
        cfg_path = out_dir / "config.json"
        saved = json.loads(cfg_path.read_text())
        if layout == "classic":
            saved = to_classic_layout(saved)
        cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

        # Goldens come from the files on disk, so the config rewrite is covered.
        reloaded = load_f32(out_dir)
        if reloaded.config.rope_parameters != model.config.rope_parameters:
            raise RuntimeError(f"{arch}: rope parameters changed on reload: "
                               f"{reloaded.config.rope_parameters} vs {model.config.rope_parameters}")
        probe = torch.tensor([tiny_prompts(seed, cfg.vocab_size)[2]])
        if not torch.equal(reloaded(probe).logits, model(probe).logits):
            raise RuntimeError(f"{arch}: reloaded model gives different logits")

        cases = []
        for i, prompt in enumerate(tiny_prompts(seed, cfg.vocab_size)):
            c = {"name": f"len{len(prompt)}", "text": None, "chat": False, "rendered": None}
            c.update(greedy_case(reloaded, prompt, 32, []))
            cases.append(c)
        margin = min(c["min_top1_margin"] for c in cases)
        distinct = len({t for c in cases for t in c["output_ids"]})
        log(f"tiny-{arch} seed {seed}: min top1 margin {margin:.4g}, {distinct} distinct output tokens")
        if margin > MIN_TINY_MARGIN and distinct >= 8:
            break
    else:
        raise RuntimeError(f"tiny-{arch}: no seed gave a top-1 margin > {MIN_TINY_MARGIN}")

    golden = header() | {
        "model": rel(out_dir), "seed": seed, "config_layout": layout,
        "dtype": "float32", "attn_implementation": "eager",
        "max_new_tokens": 32, "top_k": TOP_K, "eos_token_ids": [],
        "cases": cases,
    }
    write_json(GOLDENS / f"tiny-{arch}.json", golden)


# --------------------------------------------------------------------------
# logits processors
# --------------------------------------------------------------------------


def processors() -> None:
    from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(64) * 3.0).astype(np.float32)
    history = rng.integers(0, 64, size=24).tolist() + [3, 3, 3, 5, 5]  # some repeats
    scores = torch.tensor(logits)[None]
    input_ids = torch.tensor([history])

    def run(proc, s=scores):
        return proc(input_ids, s.clone())

    def vec(t: torch.Tensor) -> list[float]:
        return [f32(v) for v in t[0].tolist()]

    cases = []

    def add(name, kind, params, out, **extra):
        cases.append({"name": name, "processor": kind, "params": params, "output": vec(out)} | extra)

    for p in (1.3, 0.8):
        add(f"repetition_penalty_{p}", "repetition_penalty", {"penalty": p},
            run(RepetitionPenaltyLogitsProcessor(p)))
    for t in (0.7, 1.5):
        add(f"temperature_{t}", "temperature", {"temperature": t}, run(TemperatureLogitsWarper(t)))
    for k in (5, 1):
        add(f"top_k_{k}", "top_k", {"top_k": k}, run(TopKLogitsWarper(k)))
    for p in (0.8, 0.3):
        add(f"top_p_{p}", "top_p", {"top_p": p}, run(TopPLogitsWarper(p)))
    for p in (0.1, 0.5):
        add(f"min_p_{p}", "min_p", {"min_p": p}, run(MinPLogitsWarper(p)))

    counts = np.bincount(np.array(history), minlength=64).astype(np.float32)
    for pres, freq in ((0.5, 0.3), (-0.4, 0.0), (0.0, 1.1)):
        out = logits - np.float32(pres) * (counts > 0).astype(np.float32) - np.float32(freq) * counts
        add(f"presence_{pres}_frequency_{freq}", "presence_frequency",
            {"presence_penalty": pres, "frequency_penalty": freq}, torch.tensor(out)[None])

    # "chain" uses the single-processor parameters (it leaves one token); "chain_wide"
    # keeps several tokens so that the softmax over survivors is tested too.
    for name, (pen, temp, k, p, mp) in (("chain", (1.3, 0.7, 5, 0.8, 0.1)),
                                        ("chain_wide", (1.1, 1.5, 10, 0.95, 0.05))):
        s = scores.clone()
        for proc in (RepetitionPenaltyLogitsProcessor(pen), TemperatureLogitsWarper(temp), TopKLogitsWarper(k),
                     TopPLogitsWarper(p), MinPLogitsWarper(mp)):
            s = proc(input_ids, s)
        probs = torch.softmax(s, dim=-1)
        add(name, "chain", {"penalty": pen, "temperature": temp, "top_k": k, "top_p": p, "min_p": mp}, s,
            probs=[f32(v) for v in probs[0].tolist()])

    golden = header() | {"masked_value": MASKED, "logits": [f32(v) for v in logits],
                         "input_ids": history, "cases": cases}
    write_json(GOLDENS / "logits_processors.json", golden)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / fetch_model.DEFAULT_OUT["f32"]))
    ap.add_argument("--bf16-model", default=str(REPO / fetch_model.DEFAULT_OUT["bf16"]))
    ap.add_argument("--only", default="smollm2,tiny,processors",
                    help="comma list of: smollm2, tiny, processors")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    unknown = parts - {"smollm2", "tiny", "processors"}
    if unknown:
        ap.error(f"unknown --only parts: {sorted(unknown)}")

    if "processors" in parts:
        processors()
    if "tiny" in parts:
        for arch, (cfg, layout) in tiny_configs().items():
            tiny(arch, cfg, layout)
    if "smollm2" in parts:
        model_dir = Path(args.model).resolve()
        if not (model_dir / "model.safetensors").is_file():
            print(f"{model_dir} has no model.safetensors; run scripts/fetch_model.py first", file=sys.stderr)
            return 1
        smollm2(model_dir, Path(args.bf16_model).resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
