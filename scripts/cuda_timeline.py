#!/usr/bin/env python3
"""Where a decode step's time goes on the GPU, from a scripts/cuda_trace.c CSV.

Steps are split at their first kernel (`rope_table`); the first third of them
(warm-up, graph capture) is skipped. Per kernel role: launches per step, median
duration, median gap to the previous kernel's end (negative: the kernel was
launched programmatically and started while the previous one drained) and the
sum per step. Projection kernels are named by their place in the layer (qkv,
o, gate/up, down). Then the idle time inside and between steps, and with
--events the raw records (memcpy and memset included) around one step start.

    python3 scripts/cuda_timeline.py trace.csv [--events]
"""
import argparse
import csv
import statistics as st


def load(path):
    with open(path) as f:
        return sorted((int(r["Start"]), int(r["Duration"]), r["Name"]) for r in csv.DictReader(f))


def gap(a, b):
    """Start of record b minus the end of record a (start, duration, name)."""
    return b[0] - a[0] - a[1]


def is_kernel(name):
    return not name.startswith(("memcpy", "memset"))


def role(name, prev):
    """A projection kernel's place in the layer, from the kernel before it."""
    if not name.startswith(("w4_mm", "gemv")):
        return name
    if prev.startswith("attention"):
        return f"{name} [o]"
    if prev.startswith(("w4_mm_t2_n1_w2", "gemv_swiglu")):
        return f"{name} [down]"
    if "_w2" in name or name.startswith("gemv_swiglu"):
        return f"{name} [gate/up]"
    if name.startswith(("w4_mm_t2", "gemv_qkv")):
        return f"{name} [qkv]"
    if prev == "add_rms_norm":
        return f"{name} [LM head]"
    return f"{name} [after {prev}]"


def steps_of(events):
    steps, cur, prev = [], [], ""
    for s, d, n in events:
        if not is_kernel(n):
            continue
        if n == "rope_table" and cur:
            steps.append(cur)
            cur = []
        cur.append((s, d, role(n, prev)))
        prev = n
    return steps[len(steps) // 3:]


def summary(steps):
    per = {}
    for step in steps:
        for i, e in enumerate(step):
            per.setdefault(e[2], []).append((e[1], gap(step[i - 1], e) if i else 0))
    n = len(steps)
    span = st.median(s[-1][0] + s[-1][1] - s[0][0] for s in steps)
    print(f"{n} steps, {len(steps[0])} kernels each, median span {span / 1e3:.1f} us")
    print(f"{'role':40s} {'n/step':>6s} {'dur us':>8s} {'gap us':>8s} {'us/step':>9s}")
    for r, v in sorted(per.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        print(f"{r:40s} {len(v) / n:6.0f} {st.median(d for d, _ in v) / 1e3:8.2f} "
              f"{st.median(g for _, g in v) / 1e3:8.2f} {sum(d for d, _ in v) / n / 1e3:9.1f}")
    idle = [sum(max(0, gap(a, b)) for a, b in zip(step, step[1:])) for step in steps]
    between = [gap(a[-1], b[0]) for a, b in zip(steps, steps[1:])]
    period = [b[0][0] - a[0][0] for a, b in zip(steps, steps[1:])]
    print(f"idle inside a step {st.median(idle) / 1e3:.1f} us; between steps "
          f"{st.median(between) / 1e3:.1f} us; step period {st.median(period) / 1e3:.1f} us")


def events_around_a_step(events):
    starts = [i for i, e in enumerate(events) if e[2] == "rope_table"]
    i1 = starts[len(starts) * 2 // 3]
    t0 = events[i1][0]
    for j in range(max(1, i1 - 6), min(len(events), i1 + 6)):
        s, d, n = events[j]
        print(f"{n:28s} start {(s - t0) / 1e3:9.2f} dur {d / 1e3:8.2f} "
              f"gap {gap(events[j - 1], events[j]) / 1e3:8.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--events", action="store_true", help="also print the records around one step start")
    args = ap.parse_args()
    events = load(args.csv)
    summary(steps_of(events))
    if args.events:
        events_around_a_step(events)


if __name__ == "__main__":
    main()
