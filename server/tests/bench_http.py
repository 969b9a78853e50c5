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
import http.client
import json
import os
import random
import resource
import statistics
import subprocess
import threading
import time
import urllib.parse

from harness import CLI, MODEL, Server


def engine_bench(a, session_args):
    out = subprocess.run(
        [a.cli, "bench", "--model", a.model, "--threads", str(a.threads), "--num-requests", str(a.requests),
         "--input-len", str(a.input_len), "--output-len", str(a.output_len),
         "--concurrency", str(a.concurrency), "--seed", "7", "--json", *session_args],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["output_tokens_per_s"]


def http_bench(base, a, vocab):
    """C client threads, each streaming one request after another. Only the
    standard library, so that it runs on GPU machines without pip."""
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.requests)]
    host, port = urllib.parse.urlsplit(base).netloc.split(":")
    queue = list(range(a.requests))
    lock = threading.Lock()
    tokens = [0]
    errors = []

    def worker():
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        while True:
            with lock:
                if not queue:
                    break
                i = queue.pop()
            body = json.dumps({"prompt": prompts[i], "max_tokens": a.output_len, "ignore_eos": True,
                               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                errors.append(f"status {resp.status}: {resp.read()[:200]!r}")
                return
            for line in resp:
                if line.startswith(b'data: {"choices":[],'):
                    with lock:
                        tokens[0] += json.loads(line[6:])["usage"]["completion_tokens"]
        conn.close()

    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    assert not errors, errors[:3]
    assert tokens[0] == a.requests * a.output_len, (tokens[0], a.requests * a.output_len)
    return tokens[0] / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--cli", default=CLI, help="the nanoinfer binary (nanoinfer-serve beside it)")
    ap.add_argument("session", nargs="*", help="session options for both, e.g. -- --device cuda")
    a = ap.parse_args()
    session = ["--max-seqs", str(a.concurrency), *a.session]
    direct, served = [], []
    for _ in range(a.rounds):
        direct.append(engine_bench(a, session))
        with Server(*session, threads=a.threads, cli=a.cli, model=a.model) as s:
            with open(os.path.join(a.model, "config.json")) as f:
                vocab = json.load(f)["vocab_size"]
            before = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.monotonic()
            served.append(http_bench(s.base, a, vocab))
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
