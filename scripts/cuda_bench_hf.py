#!/usr/bin/env python3
"""The GPU peer for `nanoinfer bench --device cuda`: HF transformers (bf16,
static KV cache, eager) on the same model, plus the machine's measured copy
bandwidth. Optionally creates a random-weight model of Llama-3-8B shape.

  python3 scripts/cuda_bench_hf.py --make-8b DIR      # write the model
  python3 scripts/cuda_bench_hf.py --model DIR -p 512 -n 128 --json
  python3 scripts/cuda_bench_hf.py --model DIR --offline 256 -p 512 -n 256   # batched generate
"""
import argparse
import json
import os
import time

import torch


def make_8b(out, vocab=128256):
    """Llama-3-8B's shape with random weights; `vocab` other than Llama 3's
    takes SmolLM2's BOS/EOS ids (1, 2), for borrowing its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama3 = vocab == 128256
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=128000 if llama3 else 1,
        eos_token_id=128001 if llama3 else 2,
    )
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    print(f"wrote {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params to {out}")


def write_golden(model_dir, new_tokens=12):
    """transformers' greedy continuation of two random prompts (ids + top-5
    logprobs per step), in the format of scripts/cuda_fixtures.py."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_fixtures import golden
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 120000, (n,), generator=g).tolist() for n in (9, 300)]
    gold = {"model": "llama3-8b-shape", "dtype": "bf16", "prompts": prompts, "tokens": [], "top": []}
    with torch.no_grad():
        for p in prompts:
            t, top = golden(model, p, new_tokens)
            gold["tokens"].append(t)
            gold["top"].append(top)
    with open(os.path.join(model_dir, "golden.json"), "w") as f:
        json.dump(gold, f)
    print(f"golden for {model_dir}: {gold['tokens']}")


def copy_bandwidth():
    n = 1 << 30  # 2 GiB of bf16
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    reps = 20
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    return 2 * x.numel() * 2 / dt  # read + write bytes per second


def gemm_peak():
    """The measured bf16 tensor-core peak: the best cuBLAS GEMM (through
    torch) over large squares and the 8B shape's prefill projections at
    4096 rows, in TFLOP/s."""
    best = 0.0
    shapes = [(8192, 8192, 8192), (16384, 16384, 16384), (4096, 28672, 4096), (4096, 4096, 14336)]
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
        c = a @ b
        torch.cuda.synchronize()
        reps = max(5, int(4e14 // (2 * m * n * k)))
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        best = max(best, 2 * m * n * k * reps / (time.perf_counter() - t) / 1e12)
        del a, b, c
    return best


def timed(f, reps=3):
    f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sum(ts) / len(ts)


def bench(model_dir, n_prompt, n_gen, reps):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, n_prompt), generator=g).cuda()
    short = prompt[:, :1]
    with torch.no_grad():
        t_pp = timed(lambda: model(prompt, use_cache=False), reps)

        def gen(n):
            return lambda: model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=n,
                                          min_new_tokens=n, do_sample=False, cache_implementation="static",
                                          pad_token_id=0)
        t1 = timed(gen(1), reps)
        tn = timed(gen(n_gen + 1), reps)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        model.model.embed_tokens.weight.numel() * 2
    return {
        "peer": f"transformers {__import__('transformers').__version__} bf16 eager, static cache",
        "gpu": torch.cuda.get_device_name(),
        "pp_tokens_per_s": n_prompt / t_pp,
        "tg_tokens_per_s": n_gen / (tn - t1),
        "copy_bandwidth_bytes_per_s": copy_bandwidth(),
        "weight_bytes_per_token": weight_bytes,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
    }


def offline(model_dir, requests, n_prompt, n_gen, batch):
    """Offline throughput of HF `generate`: `requests` random prompts of
    n_prompt tokens, n_gen new tokens each (EOS ignored), in batches of
    `batch` with a static cache: the peer of `engine_bench --offline`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, model.config.vocab_size, (requests, n_prompt), generator=g).cuda()
    out_tokens = 0
    with torch.no_grad():
        # Warm-up (kernel selection, cache allocation) on a small batch.
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for b in range(0, requests, batch):
            x = ids[b:b + batch]
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_gen, min_new_tokens=n_gen,
                               do_sample=False, cache_implementation="static", pad_token_id=0)
            out_tokens += (y.shape[1] - n_prompt) * y.shape[0]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return {
        "peer": f"transformers {__import__('transformers').__version__} bf16 eager, static cache, generate",
        "requests": requests,
        "batch": batch,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "seconds": dt,
        "output_tokens_per_s": out_tokens / dt,
        "total_tokens_per_s": (out_tokens + requests * n_prompt) / dt,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--make-8b")
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary size of --make-8b")
    ap.add_argument("--model")
    ap.add_argument("--golden", help="write DIR/golden.json (greedy ids + top-5 logprobs)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--offline", type=int, help="requests for the batched-generate throughput run")
    ap.add_argument("--batch", type=int, default=256, help="generate batch size with --offline")
    ap.add_argument("--peak", action="store_true", help="measure bf16 GEMM TFLOP/s and copy bandwidth")
    a = ap.parse_args()
    if a.peak:
        print(json.dumps({"gpu": torch.cuda.get_device_name(), "bf16_gemm_tflops": round(gemm_peak(), 1),
                          "copy_tb_s": round(copy_bandwidth() / 1e12, 3)}))
    if a.make_8b:
        make_8b(a.make_8b, a.vocab)
    if a.golden:
        write_golden(a.golden)
    if a.model and a.offline:
        print(json.dumps(offline(a.model, a.offline, a.p, a.n, a.batch)))
    elif a.model:
        print(json.dumps(bench(a.model, a.p, a.n, a.r)))


if __name__ == "__main__":
    main()
