#!/usr/bin/env python3
"""Compares two fastsan binaries side by side in one run (a change's
before and after): both serve a 1 GiB memory volume on loopback; each point
is run `--reps` times with the two systems alternating, by the same client
for NBD (fio's nbd engine) and by each binary's own `fastsan bench` for BRP
(the two may speak different BRP versions) and for NVMe/TCP; the report gives medians,
server CPU per I/O and the ratio new/old.

  bench/compare.py OLD_BINARY [NEW_BINARY] [--quick] [--reps N]
  bench/run --compare OLD_BINARY [--quick]      (the same, after a release build)

NEW_BINARY defaults to target/release/fastsan. Results (raw JSON with the
command behind every number, and report.md) land in
bench/results/<time>-compare/.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402

# The suite's fastsan points (bench/suite.py): latency, QD32, several
# connections, the 16-job matrix at 1M, BRP at high concurrency.
POINTS = [
    # (name, protocol, rw, block size, iodepth, jobs[, fio's rate in IOPS])
    ("NBD 4K randread QD1", "nbd", "randread", "4k", 1, 1),
    ("NBD 4K randread QD32", "nbd", "randread", "4k", 32, 1),
    ("NBD 4K randwrite QD32", "nbd", "randwrite", "4k", 32, 1),
    ("NBD 4K randread QD8 x 4 conns", "nbd", "randread", "4k", 8, 4),
    # The suite's CPU point: the same offered load (20 K IOPS) whatever the server.
    ("NBD 4K randread QD8 at 20K IOPS", "nbd", "randread", "4k", 8, 1, 20000),
    ("NBD 4K randwrite QD8 at 20K IOPS", "nbd", "randwrite", "4k", 8, 1, 20000),
    ("NBD 4K randwrite QD8 x 4 conns", "nbd", "randwrite", "4k", 8, 4),
    ("NBD 1M read 16 jobs", "nbd", "read", "1m", 1, 16),
    ("NBD 1M write 16 jobs", "nbd", "write", "1m", 1, 16),
    ("BRP 4K randread QD1", "brp", "randread", "4k", 1, 1),
    ("BRP 4K randread 128 requesters", "brp", "randread", "4k", 128, 1),
    ("BRP 4K randwrite 128 requesters", "brp", "randwrite", "4k", 128, 1),
    ("BRP 1M read 16 jobs", "brp", "read", "1m", 1, 16),
    ("BRP 1M write 16 jobs", "brp", "write", "1m", 1, 16),
    # NVMe/TCP, each binary's own host (fastsan bench) against its own target: the front-end
    # experiment's points (bench/suite.py, frontends_experiment), one queue per job.
    ("NVMe/TCP 4K randread QD32", "nvme", "randread", "4k", 32, 1),
    ("NVMe/TCP 4K randwrite QD32", "nvme", "randwrite", "4k", 32, 1),
    ("NVMe/TCP 4K randread QD8 x 4 queues", "nvme", "randread", "4k", 8, 4),
    ("NVMe/TCP 4K randwrite QD8 x 4 queues", "nvme", "randwrite", "4k", 8, 4),
]

NQN = "nqn.2026-11.io.fastsan:compare"


def start(name, binary):
    brp, nbd, nvme = suite.free_port(), suite.free_port(), suite.free_port()
    s = suite.System(name, "fastsan")
    s.spawn([binary, "serve", "--brp", f"127.0.0.1:{brp}", "--nbd", f"127.0.0.1:{nbd}",
             "--nvme", f"127.0.0.1:{nvme}", "--nvme-nqn", NQN, "--volume", "vol0=memory:1G"], brp)
    suite.wait_port(nbd)
    suite.wait_port(nvme)
    s.brp_url, s.url = f"brp://127.0.0.1:{brp}/vol0", f"nbd://127.0.0.1:{nbd}/vol0"
    s.nvme_url = f"nvme+tcp://127.0.0.1:{nvme}/{NQN}/1"
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=suite.FASTSAN)
    ap.add_argument("--quick", action="store_true", help="1 s per run instead of 5")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", help="only the points whose name contains this text")
    args = ap.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(suite.ROOT, "bench", "results", f"{stamp}-compare")
    os.makedirs(out, exist_ok=True)
    raw = []
    run = suite.Runner(args.quick, raw)
    binaries = {"old": args.old, "new": args.new}
    systems = {label: start(label, b) for label, b in binaries.items()}
    # As the suite does: reads measured on a fresh memory volume would read holes.
    suite.log("writing both volumes whole once")
    suite.write_whole([s.brp_url for s in systems.values()])
    rows = []
    try:
        for (name, proto, rw, bs, qd, jobs, *rate) in POINTS:
            if args.only and args.only not in name:
                continue
            suite.log(name)
            fns = {}
            for label, s in systems.items():
                if proto == "nbd":
                    fn = lambda s=s: run.fio(s.url, rw, bs, qd, jobs, rate[0] if rate else None)
                else:
                    url = s.nvme_url if proto == "nvme" else s.brp_url
                    fn = lambda url=url, b=binaries[label]: run.fastsan_bench(url, rw, bs, qd, jobs, binary=b)
                fns[label] = suite.with_cpu(fn, s.pid)
            med = suite.run_point(run, args.reps, "compare", {"point": name}, fns)
            rows.append((name, med.get("old"), med.get("new")))
    finally:
        for s in systems.values():
            s.stop()
    lines = [f"# fastsan {args.old} (old) vs {args.new} (new)", "",
             f"{args.reps} repetitions of {run.secs:g} s per point, systems alternating; medians.", "",
             "| point | old IOPS | new IOPS | new/old | old server CPU us/IO | new server CPU us/IO |",
             "|---|---|---|---|---|---|"]
    worst = None
    for name, o, n in rows:
        if not (o and n):
            lines.append(f"| {name} | failed | | | | |")
            continue
        ratio = n["iops"] / o["iops"]
        worst = ratio if worst is None else min(worst, ratio)
        lines.append(f"| {name} | {o['iops']:.0f} | {n['iops']:.0f} | {ratio:.3f} | "
                     f"{o['server_cpu_us_per_io']:.1f} | {n['server_cpu_us_per_io']:.1f} |")
    lines += ["", f"Worst ratio: {worst:.3f}" if worst else "no point completed", "",
              "Commands: raw.json (every run, with the exact command)."]
    with open(os.path.join(out, "raw.json"), "w") as f:
        json.dump(raw, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
