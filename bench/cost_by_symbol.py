#!/usr/bin/env python3
"""Two loads on one fresh target, side by side in absolute terms: nanoseconds of the target's CPU per
I/O in each symbol, not shares of a profile (a share moves when anything else does). The loads
alternate, the order turning around every repetition; each is recorded with `perf record -F 10000`
for SECONDS after 2 s (bench/profile.py's `record`), and a symbol's samples are summed over the
repetitions and divided by the I/Os done while perf ran (the load's IOPS x SECONDS).

  bench/cost_by_symbol.py "nbd-bench --rw randwrite --bs 4k --iodepth 32 --jobs 1" \\
                          "nvme --rw randwrite --bs 4k --iodepth 32 --jobs 1"
  bench/cost_by_symbol.py --client --reps 4 "LOAD A" "LOAD B"   # fastsan bench's own CPU instead

A load is bench/profile.py's PROTOCOL and its arguments: nbd (fio's NBD engine), nbd-bench, brp or
nvme (fastsan bench). Prints each load's total per I/O and the symbols whose cost differs most.
"""
import argparse
import collections
import os
import shlex
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile as P  # noqa: E402
import suite  # noqa: E402

HZ = 10000  # profile.record's sampling rate


def samples(perf_data):
    """Samples per (dso, symbol) of a recording."""
    out = collections.Counter()
    for n, dso, sym in P.symbols(perf_data, counts=True):
        out[(dso, sym)] += n
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--binary", default=suite.FASTSAN)
    ap.add_argument("-s", "--seconds", type=int, default=4)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-n", "--top", type=int, default=30, help="symbols to show (default 30)")
    ap.add_argument("--client", action="store_true", help="record the load's process, not the target")
    ap.add_argument("a", help="the first load: PROTOCOL ARGS...")
    ap.add_argument("b", help="the second load")
    args = ap.parse_args()
    loads = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    for name, load in loads.items():
        if not load or load[0] not in ("nbd", "nbd-bench", "brp", "nvme"):
            ap.error(f"load {name}: it starts with nbd, nbd-bench, brp or nvme, not {load[:1]}")
    out = tempfile.mkdtemp(prefix="fastsan-cost-")
    target = P.start_target(args.binary)
    cost = {n: collections.Counter() for n in loads}
    ios = collections.Counter()
    try:
        for rep in range(args.reps):
            for n in ("A", "B") if rep % 2 == 0 else ("B", "A"):
                proto, *load = loads[n]
                r = P.record(args.binary, target, proto, load, args.seconds, os.path.join(out, f"{n}{rep}"),
                             graph="none", client=args.client)
                cost[n] += samples(r["perf_data"])
                ios[n] += r["iops"] * args.seconds
                suite.log(f"{n} rep {rep}: {r['iops'] / 1000:.0f} K IOPS")
    finally:
        target.stop()
    ns = {n: {k: v * 1e9 / HZ / max(ios[n], 1) for k, v in cost[n].items()} for n in loads}
    who = "fastsan bench" if args.client else "the target"
    for n in loads:
        print(f"{n}: {args.a if n == 'A' else args.b}: {sum(ns[n].values()) / 1000:.3f} us of {who}'s CPU per I/O"
              f" ({ios[n] / args.seconds / args.reps / 1000:.0f} K IOPS under perf, mean of {args.reps})")
    keys = sorted(set(ns["A"]) | set(ns["B"]),
                  key=lambda k: -abs(ns["B"].get(k, 0) - ns["A"].get(k, 0)))
    print(f"\n{'B-A ns':>8} {'A ns':>8} {'B ns':>8}  symbol [dso], per I/O")
    for k in keys[:args.top]:
        a, b = ns["A"].get(k, 0), ns["B"].get(k, 0)
        print(f"{b - a:8.1f} {a:8.1f} {b:8.1f}  {k[1][:100]} [{k[0]}]")
    print(f"\nperf data: {out}")


if __name__ == "__main__":
    main()
