#!/usr/bin/env python3
"""Profiles a fastsan target (or the client) under one load, the way docs/benchmarks.md's profiles
were taken: a fresh target serving a 1 GiB memory volume over BRP, NBD and NVMe/TCP, the volume
written whole first (suite.write_whole), the load started, then `perf record` of the target alone
(or with --client, of the load's process) for SECONDS (after 2 s). Prints the load's IOPS and the
hottest symbols; OUT (default: a new directory under /tmp) keeps perf.data and the load's JSON.

  bench/profile.py [-b BINARY] [-s SECONDS] [-g fp|dwarf] [-o OUT] [--client] nbd FIO_ARGS...
  bench/profile.py [-b BINARY] [-s SECONDS] [-g fp|dwarf] [-o OUT] [--client] brp|nbd-bench|nvme BENCH_ARGS...

  bench/profile.py nbd --rw=randread --bs=4k --iodepth=32      # fio --ioengine=nbd, 1 connection
  bench/profile.py brp --rw randwrite --bs 4k --iodepth 256 --connections 2   # fastsan bench over BRP
  bench/profile.py --client nvme --rw randwrite --bs 4k --iodepth 32   # fastsan bench's NVMe/TCP host
  bench/profile.py --client nbd-bench --rw randwrite --bs 4k --iodepth 32   # fastsan bench's NBD client
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--binary", default=suite.FASTSAN)
    ap.add_argument("-s", "--seconds", type=int, default=4)
    ap.add_argument("-g", "--graph", choices=["fp", "dwarf"], default="fp")
    ap.add_argument("-o", "--out")
    ap.add_argument("--client", action="store_true", help="record the load's process, not the target")
    ap.add_argument("protocol", choices=["nbd", "brp", "nbd-bench", "nvme"],
                    help="nbd: fio's NBD client; brp, nbd-bench, nvme: fastsan bench over BRP, NBD, NVMe/TCP")
    ap.add_argument("load", nargs=argparse.REMAINDER, help="fio's (nbd) or fastsan bench's arguments")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="fastsan-profile.")
    os.makedirs(out, exist_ok=True)
    brp, nbd, nvme = suite.free_port(), suite.free_port(), suite.free_port()
    nqn = "nqn.2026-11.io.fastsan:profile"
    target = suite.System("target", "fastsan")
    target.spawn([a.binary, "serve", "--brp", f"127.0.0.1:{brp}", "--nbd", f"127.0.0.1:{nbd}",
                  "--nvme", f"127.0.0.1:{nvme}", "--nvme-nqn", nqn, "--volume", "vol0=memory:1G"], nbd)
    suite.wait_port(nvme)
    urls = {"brp": f"brp://127.0.0.1:{brp}/vol0", "nbd-bench": f"nbd://127.0.0.1:{nbd}/vol0",
            "nvme": f"nvme+tcp://127.0.0.1:{nvme}/{nqn}/1"}
    load_json = os.path.join(out, "load.json")
    run = a.seconds + 4
    try:
        suite.write_whole([f"brp://127.0.0.1:{brp}/vol0"])
        if a.protocol == "nbd":
            cmd = ["fio", "--name=p", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{nbd}/vol0", "--time_based",
                   f"--runtime={run}", "--output-format=json", f"--output={load_json}"] + a.load
            load = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        else:
            cmd = [a.binary, "bench", urls[a.protocol], "--runtime", str(run), "--json"] + a.load
            load = subprocess.Popen(cmd, stdout=open(load_json, "w"))
        time.sleep(2)
        graph = ["-g"] if a.graph == "fp" else ["--call-graph=dwarf,16384"]
        subprocess.run(["perf", "record", "-F", "10000", *graph, "-o", os.path.join(out, "perf.data"),
                        "-p", str(load.pid if a.client else target.pid), "--", "sleep", str(a.seconds)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if load.wait() != 0:
            sys.exit(f"the load failed: {' '.join(cmd)}")
    finally:
        target.stop()
    j = json.load(open(load_json))
    if isinstance(j.get("jobs"), list):
        d = j["jobs"][0]
        d = d["read"] if d["read"]["total_ios"] else d["write"]
        print(f"load: {d['iops'] / 1e3:.1f} K IOPS, mean latency {d['lat_ns']['mean'] / 1e3:.1f} us")
    else:
        print(f"load: {j['iops'] / 1e3:.1f} K IOPS, mean latency {j['lat_mean_us']:.1f} us")
    print(f"load command: {' '.join(cmd)}")
    report = subprocess.run(["perf", "report", "-i", os.path.join(out, "perf.data"), "--no-children",
                             "--sort", "dso,sym", "--stdio", "-g", "none"],
                            capture_output=True, text=True).stdout
    print("\n".join([l for l in report.splitlines() if "%" in l and not l.startswith("#")][:25]))
    print(f"perf.data and the load's JSON: {out}")


if __name__ == "__main__":
    main()
