"""Load on `nanoinfer serve`: many concurrent streaming clients for a while,
some of which disconnect mid-stream, plus bursts beyond the bounded queue.

Checks, at the end: every accepted request ended exactly once (the server's
accepted count equals its finished count; every stream read to the end
carried one finish reason per choice and `[DONE]`), refused ones got 503
with Retry-After, disconnects were cancelled, KV usage is back to zero and
the server's memory stayed flat.

    python3 server/tests/load_test.py [--secs 60] [--clients 64]
"""

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx

from harness import Server, metrics, rss_kib, wait_until

PROMPTS = [
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "List three colours.",
    "What is 12 times 7?",
    "Tell me a short story about a robot.",
    "Describe the city of Paris in one paragraph.",
]


class Tally:
    def __init__(self):
        self.completed = 0
        self.disconnected = 0
        self.refused = 0
        self.bad = []
        self.tokens = 0


async def one_request(http, base, rng, tally, burst=False):
    """One request; a steady client told 503 waits before its next one, as
    Retry-After asks (bursts do not: they are there to overflow)."""
    if not await attempt(http, base, rng, tally, burst) and not burst:
        await asyncio.sleep(rng.uniform(0.2, 1.0))


def refused(r, tally):
    """A 503 is counted, and must say when to retry."""
    if r.status_code != 503:
        return False
    tally.refused += 1
    if r.headers.get("retry-after") is None:
        tally.bad.append("503 without Retry-After")
    return True


async def attempt(http, base, rng, tally, burst):
    """False when refused with 503."""
    stream = burst or rng.random() < 0.85
    disconnect_after = rng.randint(1, 6) if stream and rng.random() < 0.2 else None
    body = {
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(4, 48),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["n"] = 2
    url = base + "/v1/chat/completions"
    if not stream:
        r = await http.post(url, json=body)
        if refused(r, tally):
            return False
        if r.status_code != 200:
            tally.bad.append(f"status {r.status_code}: {r.text[:200]}")
            return True
        j = r.json()
        if any(c["finish_reason"] not in ("stop", "length") for c in j["choices"]):
            tally.bad.append(f"finish reasons {[c['finish_reason'] for c in j['choices']]}")
        tally.completed += 1
        tally.tokens += j["usage"]["completion_tokens"]
        return True
    async with http.stream("POST", url, json=body) as r:
        if refused(r, tally):
            return False
        if r.status_code != 200:
            tally.bad.append(f"status {r.status_code}")
            return True
        finishes = {}
        chunks = 0
        done = False
        usage = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                tally.bad.append(f"stream error {chunk['error']}")
                return True
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                if c.get("finish_reason"):
                    finishes.setdefault(c["index"], []).append(c["finish_reason"])
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                tally.disconnected += 1
                return True  # leaving the block closes the connection mid-stream
        n = body.get("n", 1)
        if not done or sorted(finishes) != list(range(n)) or any(len(v) != 1 for v in finishes.values()):
            tally.bad.append(f"stream ended badly: done={done} finishes={finishes}")
            return True
        tally.completed += 1
        tally.tokens += usage["completion_tokens"] if usage else 0
        return True


async def client(base, seed, deadline, tally):
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            await one_request(http, base, rng, tally)


async def bursts(base, deadline, tally, size, every):
    rng = random.Random(99)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=size)) as http:
        while time.monotonic() + every < deadline:
            await asyncio.sleep(every)
            await asyncio.gather(*(one_request(http, base, rng, tally, burst=True) for _ in range(size)))


async def sample_rss(pid, deadline, samples):
    while time.monotonic() < deadline:
        samples.append(rss_kib(pid))
        await asyncio.sleep(1)


async def run(base, pid, secs, clients, burst_size):
    tally = Tally()
    samples = []
    deadline = time.monotonic() + secs
    await asyncio.gather(
        *(client(base, i, deadline, tally) for i in range(clients)),
        bursts(base, deadline, tally, burst_size, every=max(secs / 4, 5)),
        sample_rss(pid, deadline, samples),
    )
    return tally, samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--secs", type=float, default=60)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=24)
    ap.add_argument("--burst", type=int, default=64)
    args = ap.parse_args()
    with Server("--max-seqs", str(args.max_seqs), "--max-queue", str(args.max_queue)) as server:
        start = time.monotonic()
        tally, rss = asyncio.run(run(server.base, server.pid, args.secs, args.clients, args.burst))
        wall = time.monotonic() - start
        with httpx.Client(timeout=60) as http:
            idle = wait_until(lambda: metrics(http, server.base)["nanoinfer_requests_in_flight"] == 0, 30)
            m = metrics(http, server.base)
        accepted = m["nanoinfer_requests_accepted_total"]
        finished = sum(v for k, v in m.items() if k.startswith("nanoinfer_requests_finished_total"))
        aborted = m.get('nanoinfer_requests_finished_total{reason="abort"}', 0)
        rejected = m.get('nanoinfer_requests_rejected_total{reason="queue_full"}', 0)
        half = max(len(rss) // 2, 1)
        first_peak, last_peak = max(rss[:half]), max(rss[half:] or rss[:half])
        print(f"load: {args.clients} clients + bursts of {args.burst} for {wall:.0f} s: "
              f"{tally.completed} completed, {tally.disconnected} disconnected mid-stream, "
              f"{tally.refused} refused (503); {tally.tokens / wall:.0f} completed tok/s")
        print(f"server: {accepted:.0f} accepted, {finished:.0f} finished ({aborted:.0f} aborted), "
              f"{rejected:.0f} rejected as queue full; KV used {m['nanoinfer_kv_cache_used_tokens']:.0f} tokens; "
              f"RSS first half peak {first_peak / 1024:.0f} MiB, second half peak {last_peak / 1024:.0f} MiB "
              f"(median {statistics.median(rss) / 1024:.0f} MiB)")
        failures = list(tally.bad[:10])
        if not idle:
            failures.append("requests still in flight 30 s after the load stopped")
        if accepted != finished:
            failures.append(f"accepted {accepted} != finished {finished}: a request ended twice or never")
        if m["nanoinfer_kv_cache_used_tokens"] != 0 or m["nanoinfer_requests_running"] != 0:
            failures.append("KV still held or requests still running after the load")
        if tally.refused == 0 or rejected != tally.refused:
            failures.append(f"bursts must overflow the queue: refused {tally.refused}, server counted {rejected}")
        if tally.disconnected and aborted == 0:
            failures.append("clients disconnected but no request was cancelled")
        if last_peak > first_peak * 1.10 + 32 * 1024:
            failures.append(f"memory grew: {first_peak} KiB -> {last_peak} KiB")
        if tally.completed == 0:
            failures.append("nothing completed")
        if failures:
            print("LOAD TEST FAILED:\n  " + "\n  ".join(failures))
            sys.exit(1)
        print("load test passed")


if __name__ == "__main__":
    main()
