#!/usr/bin/env python3
"""Reference models and goldens for the CUDA tests, made on the GPU machine.

Creates tiny random-weight Llama (llama3 rope scaling), Qwen2 (q/k/v bias) and
Qwen3 (q/k norm, head_dim != hidden/heads) models with transformers, saves
them as HF directories (bf16 safetensors), and records transformers' own
greedy continuation of fixed random prompts in bf16 on the GPU: token ids and
the top-5 logprobs of every step (golden.json), and the same with keys and
values rounded to FP8 e4m3 where attention reads them, as an FP8 KV cache
stores them (golden_fp8kv.json). tests/cuda.rs compares NanoInfer's CUDA
backend against these.

Usage: python3 scripts/cuda_fixtures.py OUT_DIR [--new-tokens 24]
Needs torch + transformers + a GPU (not needed by CI).
"""
import argparse
import json
import os

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
from transformers.integrations.sdpa_attention import sdpa_attention_forward

COMMON = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama3": LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=512,
        ),
    ),
    "qwen2": Qwen2Config(**{**COMMON, "tie_word_embeddings": True}, rope_theta=1000000.0),
    "qwen3": Qwen3Config(**{**COMMON, "head_dim": 128}, rope_theta=1000000.0),
}


def prompts(vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 17, 64, 200, 33, 1]
    # Token 2 is EOS: keep it out of prompts so generation is not biased.
    return [(torch.randint(3, vocab, (n,), generator=g)).tolist() for n in lengths]


def fp8(t):
    """Rounds to e4m3 (nearest even, saturating at +-448, as NanoInfer stores it) and back."""
    return t.clamp(-448, 448).to(torch.float8_e4m3fn).to(t.dtype)


def fp8_kv_attention(module, query, key, value, *args, **kwargs):
    # key/value: the whole cache after this step's update (keys after RoPE
    # and any k norm); rounding already-rounded entries again changes nothing.
    return sdpa_attention_forward(module, query, fp8(key), fp8(value), *args, **kwargs)


AttentionInterface.register("fp8_kv", fp8_kv_attention)


def golden(model, prompt_ids, new_tokens):
    ids = torch.tensor([prompt_ids], device="cuda")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    top = []
    for step_logits in out.logits:
        lp = torch.log_softmax(step_logits[0].float(), dim=-1)
        v, i = lp.topk(5)
        top.append([[int(a), float(b)] for a, b in zip(i.tolist(), v.tolist())])
    return tokens, top


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--new-tokens", type=int, default=24)
    a = ap.parse_args()
    torch.manual_seed(0)
    for name, cfg in CONFIGS.items():
        d = os.path.join(a.out, name)
        cfg.torch_dtype = "bfloat16"
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
        model.save_pretrained(d, safe_serialization=True)
        ps = prompts(cfg.vocab_size)
        default = model.config._attn_implementation
        for attention, file in [(default, "golden.json"), ("fp8_kv", "golden_fp8kv.json")]:
            model.set_attn_implementation(attention)
            gold = {"model": name, "dtype": "bf16", "attention": attention, "prompts": ps, "tokens": [], "top": []}
            with torch.no_grad():
                for p in ps:
                    t, top = golden(model, p, a.new_tokens)
                    gold["tokens"].append(t)
                    gold["top"].append(top)
            with open(os.path.join(d, file), "w") as f:
                json.dump(gold, f)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params -> {d}")
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
