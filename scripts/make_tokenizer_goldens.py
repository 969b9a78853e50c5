#!/usr/bin/env python3
"""Writes the tokenizer test fixtures and goldens.

Reference behaviour comes from the Python `tokenizers` library (encode/decode) and
from `jinja2` configured exactly as transformers' `_compile_jinja_template` does
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, the
`generation` tag, `raise_exception`, `strftime_now`, the json.dumps `tojson`).
Neither torch nor transformers is needed:

    pip install tokenizers jinja2
    python3 scripts/make_tokenizer_goldens.py [--model-dir DIR]

Outputs (all committed):
  tests/data/tokenizer/bytelevel/     small byte-level BPE (GPT-2 / SmolLM2 style)
  tests/data/tokenizer/spm/           small Llama-style BPE with byte fallback
  tests/data/tokenizer/goldens_<fixture>.json
  tests/data/tokenizer/template_goldens.json   renderings of templates/*.jinja
  tests/data/goldens/tokenizer_smollm2.json     only when the model dir exists
"""

import argparse
import json
import os
import re
import sys
from datetime import datetime
from pathlib import Path

import jinja2
import tokenizers
from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "tokenizer"
GOLDENS = ROOT / "tests" / "data" / "goldens"

SPECIAL_KEYS = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
]

LONG_PARAGRAPH = (
    "Streaming detokenization must never split a character: when a model emits "
    "the bytes of an emoji 🧪 or of a CJK ideograph 漢 one token at a time, the "
    "client should only ever see whole characters. Numbers like 1234567 and "
    "3.14159, code like `let x = vec![1, 2, 3];`, and   odd   spacing\n\n"
    "all have to round-trip exactly. Ünïcödé, naïveté, Ελληνικά, кириллица. "
) * 3

STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "1234567890",
    "3.14159265358979323846264338327950288419716939937510",
    "Prices: $1,299.99 and €42 (2024-11-22).",
    "naïve café résumé — “quotes” ‘single’",
    "Ünïcödé: ÄÖÜ äöü ß Ωμέγα русский",
    "日本語のテキストです。中文文本。한국어 텍스트",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵",
    "🤖",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'fn main() {\n\tprintln!("{}", 42);\n}',
    "    leading spaces",
    "trailing spaces    ",
    "multiple   internal\t\ttabs\n\n\nnewlines",
    " ",
    "\n",
    "",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|>",
    "text with <|im_end|> in the middle",
    "<|im_start|",
    'HTML: <div class="a">&amp;</div>',
    "URL https://example.com/path?q=1&r=two#frag",
    "MiXeD CaSe WoRdS and ALLCAPS",
    "don't won't it's we'll they're I'm",
    "a" * 100,
    "Zero-width\u200bspace and\u00a0nbsp",
    "Math: ∑_{i=1}^{n} x_i² ≤ √(π·e) ∞",
    "Arabic مرحبا بالعالم Hebrew שלום Thai สวัสดี Hindi नमस्ते",
    "Mixed 123abc456def 0x1F 1e-10 -42",
    "\r\nWindows line\r\nendings",
    'JSON {"key": [1, 2, {"nested": null}], "ok": true}',
    "e\u0301 a\u0308 decomposed",
    "<s> and </s> look special",
    LONG_PARAGRAPH,
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be kind.  "},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "I don't know, why?"},
    ],
    [
        {"role": "user", "content": "Ünïcödé 日本語 😀\nsecond line\n"},
        {"role": "assistant", "content": "  <|im_end|> is just text here  "},
    ],
    [],
]

# Conversations used only for the template goldens (they exercise more roles).
TEMPLATE_CONVERSATIONS = CONVERSATIONS[:4] + [
    [
        {"role": "system", "content": "\n  # Rules\nAnswer briefly.\n"},
        {"role": "user", "content": "Think first?"},
        {
            "role": "assistant",
            "content": "<think>\nLet me think.\n</think>\n\nThe answer is 4.",
        },
        {"role": "user", "content": "# And now?"},
        {"role": "assistant", "content": "<think>again</think>Done."},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Calling the tool."},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"rain": false}'},
        {"role": "assistant", "content": "21 degrees, dry."},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
    [],
]


# ---------------------------------------------------------------------------
# Chat template rendering, as transformers does it.


class AssistantTracker(Extension):
    """transformers' `{% generation %}` tag; with tracking off it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        call = self.call_method("_generation_support")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def compile_template(source):
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[AssistantTracker, loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def token_content(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def special_tokens_map(config):
    out = {}
    for key in SPECIAL_KEYS:
        content = token_content(config.get(key))
        if content is not None:
            out[key] = content
    extra = [token_content(t) for t in config.get("additional_special_tokens") or []]
    if extra:
        out["additional_special_tokens"] = extra
    return out


def render(template, messages, add_generation_prompt, special_map):
    try:
        text = template.render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **special_map,
        )
        return {"text": text}
    except jinja2.exceptions.TemplateError as e:
        return {"error": str(e)}


def load_chat_template(model_dir, config):
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t["name"]: t["template"] for t in tpl}
        return named.get("default")
    return tpl


# ---------------------------------------------------------------------------
# Fixtures.

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! Hello there, how are you today?",
    "def main():\n    print('hello world')\n    return 0\n",
    "fn main() { println!(\"hello\"); }",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024",
    "the cat sat on the mat and the dog sat on the log",
    "streaming tokens one at a time, never splitting characters",
    "système café naïve über Straße 東京 😀",
]


def write_json(path, obj):
    """Indented JSON with lists of numbers kept on one line (readable diffs)."""
    text = json.dumps(obj, ensure_ascii=False, indent=1)
    text = re.sub(
        r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def build_bytelevel(out_dir):
    """A GPT-2 style byte-level BPE with ChatML special tokens (like SmolLM2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        min_frequency=1,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer=trainer)
    # A non-special added token: kept by decode(skip_special_tokens=True).
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=False)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    chatml = (DATA / "templates" / "chatml_tools.jinja").read_text(encoding="utf-8")
    config = {
        "add_prefix_space": False,
        "bos_token": {
            "__type": "AddedToken",
            "content": "<|im_start|>",
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        },
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": chatml,
        "model_max_length": 2048,
        "tokenizer_class": "GPT2Tokenizer",
    }
    write_json(out_dir / "tokenizer_config.json", config)


def build_spm(out_dir):
    """A Llama-style BPE: '▁' for spaces, byte fallback, BOS added by the post-processor."""
    ascii_alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["▁"]
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=True
    )
    trainer = trainers.BpeTrainer(
        vocab_size=180,
        min_frequency=1,
        initial_alphabet=ascii_alphabet,
        limit_alphabet=len(ascii_alphabet),
        show_progress=False,
    )
    trainer_tok.train_from_iterator(TRAIN_TEXT * 4, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]

    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {}
    for t in specials + byte_tokens:
        vocab[t] = len(vocab)
    for t, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]

    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    inst = (DATA / "templates" / "inst_alternating.jinja").read_text(encoding="utf-8")
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "normalized": False},
        "eos_token": {"__type": "AddedToken", "content": "</s>", "normalized": False},
        "unk_token": "<unk>",
        "pad_token": None,
        "chat_template": [
            {"name": "default", "template": inst},
            {"name": "tool_use", "template": "{{ 'tools:' }}{{ tools | tojson }}"},
        ],
        "legacy": False,
        "tokenizer_class": "LlamaTokenizer",
    }
    write_json(out_dir / "tokenizer_config.json", config)


# ---------------------------------------------------------------------------
# Goldens.


def decode_cases(tok, encodings, special_ids):
    """Id lists (some with special tokens in the middle) and their decodes."""
    cases = []
    picks = [e["ids_with_special"] for e in encodings if e["text"]][:12]
    mixed = []
    for i, ids in enumerate(picks):
        mixed.extend(ids)
        mixed.append(special_ids[i % len(special_ids)])
    picks.append(mixed)
    for ids in picks:
        for skip in (True, False):
            cases.append(
                {"ids": ids, "skip_special_tokens": skip, "text": tok.decode(ids, skip_special_tokens=skip)}
            )
    return cases


def tokenizer_goldens(model_dir):
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    special_map = special_tokens_map(config)
    encodings = []
    for text in STRINGS:
        encodings.append(
            {
                "text": text,
                "ids": tok.encode(text, add_special_tokens=False).ids,
                "ids_with_special": tok.encode(text, add_special_tokens=True).ids,
            }
        )
    added = tok.get_added_tokens_decoder()
    special_ids = sorted(i for i, t in added.items() if t.special)
    vocab = tok.get_vocab(with_added_tokens=True)
    source = load_chat_template(model_dir, config)
    chats = []
    if source is not None:
        template = compile_template(source)
        for messages in CONVERSATIONS:
            for gen in (True, False):
                case = {"messages": messages, "add_generation_prompt": gen}
                case.update(render(template, messages, gen, special_map))
                chats.append(case)
    return {
        "generated_by": "scripts/make_tokenizer_goldens.py",
        "python_tokenizers_version": tokenizers.__version__,
        "jinja2_version": jinja2.__version__,
        "vocab_size": max(vocab.values()) + 1,
        "special_tokens": special_map,
        "bos_token_id": tok.token_to_id(special_map["bos_token"]) if "bos_token" in special_map else None,
        "eos_token_id": tok.token_to_id(special_map["eos_token"]) if "eos_token" in special_map else None,
        "special_ids": special_ids,
        "encode": encodings,
        "decode": decode_cases(tok, encodings, special_ids),
        "chat": chats,
    }


def template_goldens():
    special_map = special_tokens_map(
        json.loads((DATA / "bytelevel" / "tokenizer_config.json").read_text(encoding="utf-8"))
    )
    out = {"special_tokens": special_map, "cases": []}
    for path in sorted((DATA / "templates").glob("*.jinja")):
        template = compile_template(path.read_text(encoding="utf-8"))
        for messages in TEMPLATE_CONVERSATIONS:
            for gen in (True, False):
                case = {"template": path.name, "messages": messages, "add_generation_prompt": gen}
                case.update(render(template, messages, gen, special_map))
                out["cases"].append(case)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-dir",
        default=os.environ.get("NANOINFER_MODEL_DIR", str(ROOT / "models" / "SmolLM2-135M-Instruct")),
    )
    args = parser.parse_args()

    build_bytelevel(DATA / "bytelevel")
    build_spm(DATA / "spm")
    for name in ("bytelevel", "spm"):
        write_json(DATA / f"goldens_{name}.json", tokenizer_goldens(DATA / name))
    write_json(DATA / "template_goldens.json", template_goldens())
    print(f"wrote fixtures and goldens under {DATA}")

    model_dir = Path(args.model_dir)
    if (model_dir / "tokenizer.json").exists():
        write_json(GOLDENS / "tokenizer_smollm2.json", tokenizer_goldens(model_dir))
        print(f"wrote {GOLDENS / 'tokenizer_smollm2.json'}")
    else:
        print(
            f"{model_dir}/tokenizer.json not found: run `python3 scripts/fetch_model.py` "
            "to also write the SmolLM2 goldens",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
