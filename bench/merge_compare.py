#!/usr/bin/env python3
"""Adaptive merge, two clients side by side: one target (OLD serves a 1 GiB memory volume over
BRP, written whole first), and four clients alternating at each requester count, the order turning
around every repetition: OLD and NEW with --merge adaptive, OLD with --merge off and --merge always.
4K random writes, `fastsan bench --jobs 1 --connections 2`, 4 s per run.

  bench/merge_compare.py OLD_BINARY NEW_BINARY OUT_DIR [COUNTS [REPS]]
  bench/merge_compare.py /tmp/fastsan-old target/release/fastsan /tmp/out 4,8,16,64,128 3

Prints kIOPS per repetition for each count; OUT_DIR/raw.json has every run with its command.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    old, new, out = sys.argv[1:4]
    counts = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "4,8,16,64,128").split(",")]
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 3
    raw = []
    run = suite.Runner(False, raw)
    run.secs = 4.0
    port = suite.free_port()
    target = suite.System("target", "fastsan")
    target.spawn([old, "serve", "--brp", f"127.0.0.1:{port}", "--no-nbd", "--volume", "vol0=memory:1G"], port)
    url = f"brp://127.0.0.1:{port}/vol0"
    try:
        suite.write_whole([url])
        for n in counts:
            def client(binary, mode, n=n):
                return suite.with_cpu(lambda: run.fastsan_bench(url, "randwrite", "4k", n, 1, mode, binary=binary),
                                      target.pid)
            fns = {"old adaptive": client(old, "adaptive"), "new adaptive": client(new, "adaptive"),
                   "merge off": client(old, "off"), "always": client(old, "always")}
            suite.run_point(run, reps, "merge", {"requesters": n}, fns)
            got = {k: [round(e["iops"] / 1000) for e in raw if e["params"]["requesters"] == n and e["system"] == k]
                   for k in fns}
            print(n, got, flush=True)
    finally:
        target.stop()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "raw.json"), "w") as f:
        json.dump(raw, f, indent=1, default=str)


if __name__ == "__main__":
    main()
