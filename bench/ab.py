#!/usr/bin/env python3
"""Two fastsan binaries side by side, each whole: each serves its own 1 GiB memory volume (BRP,
NBD and NVMe/TCP on loopback, written whole first) and each drives it with its own client, so that
a change on either side (target or initiator) shows. The points alternate A and B, and the order
turns around every round. Each run is 4 s of I/O, 4K unless the point says.

  bench/ab.py A_BINARY B_BINARY ROUNDS POINTS [OUT.json]
  bench/ab.py /tmp/fastsan-old target/release/fastsan 6 brp:randread:128,fio:randwrite:1x32

A point is KIND:RW:LOAD[:BS] (BS: the block size, 4k by default; 1m, say, for large frames):
  brp:RW:N        fastsan bench over BRP, N requesters on 2 connections, adaptive merge
  nbd:RW:JxQ      fastsan bench's NBD client, J connections of queue depth Q
  nvme:RW:JxQ     fastsan bench's NVMe/TCP host, J queues of depth Q
  fio:RW:JxQ      fio --ioengine=nbd (the same for both: only the target differs), J jobs of depth Q

Prints per point the kIOPS of every round, B/A of the medians, and the medians of the server's
CPU per I/O (the target process's CPU time over the run) and the client's (fastsan bench's own
figure; fio's is not counted). OUT.json keeps every run.

AB_FILE_DIR=DIR serves a 1 GiB file volume in DIR (a sparse file, removed at the end) instead
of the memory volume: the I/O pool's path (written whole first, so mostly the page cache).
AB_DIRECT=1 with it serves the file with O_DIRECT (`file:PATH,direct`): every I/O goes to the
disk, through the volume's io_uring where it has one. DIR must be on a disk filesystem.
AB_BLOCK=1 with them serves a block device instead: a loop device (`losetup --direct-io=on`, so
that it passes each I/O to the disk) over the file; the ring's block-device path (writes without
RWF_NOWAIT, which a block device's writes never need). Needs root and loop devices.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402

NQN = "nqn.2026-11.io.fastsan:ab"


def start(binary):
    brp, nbd, nvme = suite.free_port(), suite.free_port(), suite.free_port()
    t = suite.System(os.path.basename(binary), "fastsan")
    volume, image = "memory:1G", None
    if os.environ.get("AB_FILE_DIR"):
        image = os.path.join(os.environ["AB_FILE_DIR"], f"fastsan-ab-{nbd}.img")
        with open(image, "wb") as f:
            f.truncate(1 << 30)
        path = image
        if os.environ.get("AB_BLOCK"):
            path = subprocess.run(["losetup", "--find", "--show", "--direct-io=on", image],
                                  capture_output=True, text=True, check=True).stdout.strip()
        volume = f"file:{path}" + (",direct" if os.environ.get("AB_DIRECT") else "")
    t.spawn([binary, "serve", "--brp", f"127.0.0.1:{brp}", "--nbd", f"127.0.0.1:{nbd}", "--nvme",
             f"127.0.0.1:{nvme}", "--nvme-nqn", NQN, "--volume", f"vol0={volume}"], nbd)
    suite.wait_port(nvme)
    suite.write_whole([f"brp://127.0.0.1:{brp}/vol0"])
    return {"target": t, "binary": binary, "brp": brp, "nbd": nbd, "nvme": nvme, "image": image,
            "loop": path if image and path != image else None}


def run(s, point, fio_json):
    kind, rw, load, bs = (point.split(":") + ["4k"])[:4]
    c0 = suite.cpu_ticks(s["target"].pid)
    if kind == "fio":
        jobs, qd = load.split("x")
        cmd = ["fio", "--name=ab", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{s['nbd']}/vol0", f"--rw={rw}",
               f"--bs={bs}", f"--iodepth={qd}", f"--numjobs={jobs}", "--group_reporting", "--time_based",
               "--runtime=4", "--output-format=json", f"--output={fio_json}"]
        subprocess.run(cmd, capture_output=True, check=True)
        d = json.load(open(fio_json))["jobs"][0]
        d = d["read"] if d["read"]["total_ios"] else d["write"]
        iops, ios, client = d["iops"], d["total_ios"], None
    else:
        if kind == "brp":
            target = [f"brp://127.0.0.1:{s['brp']}/vol0", "--iodepth", load, "--connections", "2",
                      "--merge", "adaptive"]
        else:
            url = {"nbd": f"nbd://127.0.0.1:{s['nbd']}/vol0",
                   "nvme": f"nvme+tcp://127.0.0.1:{s['nvme']}/{NQN}/1"}[kind]
            jobs, qd = load.split("x")
            target = [url, "--jobs", jobs, "--iodepth", qd]
        cmd = [s["binary"], "bench", *target, "--rw", rw, "--bs", bs, "--runtime", "4", "--json"]
        j = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
        iops, ios, client = j["iops"], j["ios"], j["client_cpu_us_per_io"]
    server = (suite.cpu_ticks(s["target"].pid) - c0) / 100 / max(ios, 1) * 1e6
    return {"point": point, "command": " ".join(cmd), "iops": iops, "server_us_per_io": server,
            "client_us_per_io": client}


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    a, b, rounds, points = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
    out = sys.argv[5] if len(sys.argv) > 5 else None
    fio_json = os.path.join(tempfile.mkdtemp(prefix="fastsan-ab."), "fio.json")
    systems = {"A": start(a), "B": start(b)}
    res = {}
    try:
        for r in range(rounds):
            for p in points:
                for k in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    res.setdefault((p, k), []).append(run(systems[k], p, fio_json))
    finally:
        for s in systems.values():
            s["target"].stop()
            if s["loop"]:
                subprocess.run(["losetup", "--detach", s["loop"]], check=False)
            if s["image"]:
                os.unlink(s["image"])
    med = lambda runs, key: statistics.median(x[key] for x in runs)  # noqa: E731
    for p in points:
        ra, rb = res[(p, "A")], res[(p, "B")]
        k = lambda runs: [float(f"{x['iops'] / 1e3:.3g}") for x in runs]  # noqa: E731
        line = (f"{p:20} A {k(ra)} B {k(rb)} "
                f"B/A {med(rb, 'iops') / med(ra, 'iops'):.3f} | server us/IO A {med(ra, 'server_us_per_io'):.2f} "
                f"B {med(rb, 'server_us_per_io'):.2f}")
        if ra[0]["client_us_per_io"] is not None:
            line += f" | client us/IO A {med(ra, 'client_us_per_io'):.2f} B {med(rb, 'client_us_per_io'):.2f}"
        print(line, flush=True)
    if out:
        json.dump({"a": a, "b": b, "runs": {f"{p} {k}": v for (p, k), v in res.items()}}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
