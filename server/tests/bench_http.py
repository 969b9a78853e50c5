"""What serving through HTTP costs: output tokens/s of `nanoinfer serve` at
C concurrent streaming clients against `nanoinfer bench --num-requests`
(the same engine with no HTTP) on the same model, session shape, prompts
and lengths, in the same run, alternating A B A B.

    python3 server/tests/bench_http.py [--requests 256] [--concurrency 64]
        [--input-len 128] [--output-len 128] [--rounds 2] [-- session options]

The client runs on the same machine as the server and competes with it
for the CPU; its CPU time is reported.
"""

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import time

import httpx

from harness import CLI, MODEL, Server


def engine_bench(a, session_args):
    out = subprocess.run(
        [CLI, "bench", "--model", MODEL, "--threads", str(a.threads), "--num-requests", str(a.requests),
         "--input-len", str(a.input_len), "--output-len", str(a.output_len),
         "--concurrency", str(a.concurrency), "--seed", "7", "--json", *session_args],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["output_tokens_per_s"]


async def http_bench(base, a, vocab):
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.requests)]
    queue = list(range(a.requests))
    tokens = 0

    async def worker(http):
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = {"prompt": prompts[i], "max_tokens": a.output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", base + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith('data: {"choices":[],'):
                        tokens += json.loads(line[6:])["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=a.concurrency, max_keepalive_connections=a.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.monotonic()
        await asyncio.gather(*(worker(http) for _ in range(a.concurrency)))
        wall = time.monotonic() - start
    assert tokens == a.requests * a.output_len, (tokens, a.requests * a.output_len)
    return tokens / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("session", nargs="*", help="session options for both, e.g. --max-seqs 64")
    a = ap.parse_args()
    session = ["--max-seqs", str(a.concurrency), *a.session]
    direct, served = [], []
    for _ in range(a.rounds):
        direct.append(engine_bench(a, session))
        with Server(*session, threads=a.threads) as s:
            with open(os.path.join(MODEL, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            served.append(asyncio.run(http_bench(s.base, a, vocab)))
            after = resource.getrusage(resource.RUSAGE_SELF)
            client_cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / (
                time.monotonic() - t0)
    d, h = statistics.median(direct), statistics.median(served)
    print(f"{a.requests} requests x ({a.input_len} prompt + {a.output_len} output) tokens, "
          f"concurrency {a.concurrency}, {a.threads} threads, rounds {a.rounds}")
    print(f"nanoinfer bench (no HTTP): {', '.join(f'{x:.1f}' for x in direct)} output tok/s")
    print(f"nanoinfer serve (HTTP, streaming): {', '.join(f'{x:.1f}' for x in served)} output tok/s "
          f"(client used {client_cpu:.2f} CPU cores in the last round)")
    print(f"ratio served / direct (medians): {h / d:.3f}")


if __name__ == "__main__":
    main()
