"""Turns the suite's results into report.md and PNG charts (used by suite.py)."""

import os
import statistics

import misses


def fmt(x, unit=""):
    if x is None:
        return "n/a"
    if x >= 1e6:
        return f"{x / 1e6:.2f} M{unit}"
    if x >= 1e4:
        return f"{x / 1e3:.0f} K{unit}"
    if x >= 100:
        return f"{x:.0f}{unit}"
    return f"{x:.1f}{unit}"


def best_peer(points, metric, lower=False):
    peers = {k: v.get(metric) for k, v in points.items() if k in ("nbdkit", "qemu-nbd") and v.get(metric)}
    if not peers:
        return None, None
    name = (min if lower else max)(peers, key=peers.get)
    return name, peers[name]


def check(rows, what, ours, theirs, target, higher=True):
    if ours is None or theirs is None or theirs == 0:
        rows.append((what, "n/a", f"{'>=' if higher else '<='} {target}x", "not measured"))
        return
    ratio = ours / theirs
    ok = ratio >= target if higher else ratio <= target
    rows.append((what, f"{ratio:.2f}x", f"{'>=' if higher else '<='} {target}x", "met" if ok else "MISSED"))


def honesty(r):
    rows = []
    for point, got in r.get("honesty", {}).items():
        f, b = got.get("fio --ioengine=nbd", {}).get("iops"), got.get("fastsan bench nbd://", {}).get("iops")
        if f and b and "no delay" not in point:
            rows.append((f"honesty: fastsan bench vs fio on nbdkit, 4K {point}", f"{b / f:.2f}x", "within 15%",
                         "met" if abs(b / f - 1) <= 0.15 else "MISSED"))
    return rows


def honesty_detail(r):
    rows = []
    for point, got in r.get("honesty", {}).items():
        for k, v in got.items():
            rows.append([point, k, fmt(v.get("iops")), fmt(v.get("lat_mean_us")), f"{v.get('client_cpu_us_per_io') or 0:.1f}"])
    if not rows:
        return ""
    return ("\nThe check holds where nbdkit sets the pace (a 1 ms delay per request). Without the delay the "
            "clients themselves are the bottleneck and their own CPU per I/O decides the figure:\n\n"
            + table(["point", "client", "IOPS", "mean latency us", "client CPU us/IO"], rows))


def targets(r):
    """Issue 12's acceptance, point by point, as measured in this run."""
    rows = honesty(r)
    if "latency" not in r:
        return rows
    lat = r["latency"]["randread"]
    name, peer = best_peer(lat, "lat_mean_us", lower=True)
    ours = lat.get("fastsan (NBD, fio)", {}).get("lat_mean_us")
    check(rows, f"NBD QD1 4K read latency vs best peer ({name})", ours, peer, 0.8, higher=False)
    # IOPS and server CPU per I/O at every loaded point, against the best of nbdkit and qemu-nbd.
    for key, label, goal in (("qd32", "QD32, 1 connection", 1.3), ("qd8x4", "QD8 x 4 connections", 1.5)):
        for rw in ("randread", "randwrite"):
            q = r.get(key, {}).get(rw, {})
            ours = q.get("fastsan (NBD, fio)", {})
            name, peer = best_peer(q, "iops")
            check(rows, f"NBD 4K {rw} {label}: IOPS vs best peer ({name})", ours.get("iops"), peer, goal)
            name, peer = best_peer(q, "server_cpu_us_per_io", lower=True)
            check(rows, f"NBD 4K {rw} {label}: server CPU per I/O vs best peer ({name})",
                  ours.get("server_cpu_us_per_io"), peer, 0.5, higher=False)
    for rw in ("randread", "randwrite"):
        c = r["cpu"][rw]
        name, peer = best_peer(c, "server_cpu_us_per_io", lower=True)
        check(rows, f"NBD 4K {rw} QD8, same offered load: server CPU per I/O vs best peer ({name})",
              c.get("fastsan", {}).get("server_cpu_us_per_io"), peer, 0.5, higher=False)
    q = r["qd32"]["randread"]
    wf, how = q.get("wirefloor QD128, 2 conns (alternating)"), "alternating"
    if not wf:
        wf, how = r["floor"].get("wirefloor qd128 conns2"), "measured once"
    if wf:
        ours = q.get("fastsan (BRP, 128 requesters, 2 conns)", {}).get("iops")
        check(rows, f"BRP 4K randread, 128 requesters, 2 conns: share of the wirefloor (QD128, 2 conns, {how})",
              ours, wf["iops"], 0.5)
    for rw in ("read", "write"):
        cell = r["matrix"].get(f"1m {rw}", {})
        ours = cell.get("fastsan (BRP)", {}).get("mib_s")
        # iperf3 measured alternately with this point when it was; else the one run at the end.
        iperf, how = cell.get("iperf3 (alternating)", {}).get("mib_s"), "alternating"
        if iperf is None:
            iperf, how = r["floor"].get("iperf3_mib_s"), "measured once"
        check(rows, f"BRP 1M sequential {rw} vs iperf3 ({how})", ours, iperf, 0.9)
    s = r["scaling"]
    counts = sorted(s, key=int)
    curve = [s[c].get("BRP-3 (adaptive merge)", {}).get("iops") for c in counts]
    if all(curve):
        falls = [(counts[i], counts[i + 1]) for i in range(len(curve) - 1) if curve[i + 1] < 0.95 * curve[i]]
        rows.append(("BRP-3 thread scaling never falls (5% noise allowed) up to 512",
                     "falls at " + ", ".join(f"{a}->{b}" for a, b in falls) if falls else "monotone",
                     "no fall", "MISSED" if falls else "met"))
    # Adaptive merge earns its name: within 5% of the better of merge off and always, everywhere.
    for c in counts:
        a = s[c].get("BRP-3 (adaptive merge)", {}).get("iops")
        best = max(s[c].get("BRP-2 (merge off)", {}).get("iops") or 0, s[c].get("BRP-3T (always merge)", {}).get("iops") or 0)
        check(rows, f"adaptive vs the better of merge off and always, {c} requesters", a, best or None, 0.95)
    return rows


def table(headers, rows):
    out = "| " + " | ".join(headers) + " |\n|" + "---|" * len(headers) + "\n"
    for row in rows:
        out += "| " + " | ".join(str(c) for c in row) + " |\n"
    return out


def charts(r, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        made.append(name)

    fig, ax = plt.subplots(figsize=(8, 4))
    systems = list(r["latency"]["randread"].keys())
    xs = range(len(systems))
    for i, rw in enumerate(("randread", "randwrite")):
        vals = [r["latency"][rw].get(s, {}).get("lat_mean_us", 0) for s in systems]
        ax.bar([x + i * 0.4 for x in xs], vals, 0.4, label=f"4K {rw}")
    ax.set_xticks([x + 0.2 for x in xs], systems, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("mean latency (us), QD1")
    ax.set_title("Latency at queue depth 1 (lower is better)")
    ax.legend()
    save(fig, "latency.png")

    fig, axes = plt.subplots(2, 4, figsize=(14, 6))
    for ax, (cell, pts) in zip(axes.flat, r["matrix"].items()):
        names = list(pts.keys())
        key = "iops" if cell.startswith("4k") else "mib_s"
        ax.bar(range(len(names)), [pts[n].get(key, 0) for n in names], color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=7)
        ax.set_title(f"{cell}, 16 jobs ({'IOPS' if key == 'iops' else 'MiB/s'})", fontsize=9)
    save(fig, "matrix.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    counts = sorted(r["scaling"], key=int)
    variants = sorted({v for c in counts for v in r["scaling"][c]})
    for v in variants:
        ax.plot([int(c) for c in counts], [r["scaling"][c].get(v, {}).get("iops") for c in counts], marker="o", label=v)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requesters")
    ax.set_ylabel("IOPS (4K random write)")
    ax.set_title("Thread scaling (the paper's Fig. 7)")
    ax.legend(fontsize=7)
    save(fig, "scaling.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    local = {rw: r["matrix"].get(f"4k {rw}", {}).get("local tmpfs", {}).get("iops") for rw in ("randread", "randwrite")}
    names = [n for n in r["matrix"].get("4k randread", {}) if n != "local tmpfs"]
    for i, rw in enumerate(("randread", "randwrite")):
        vals = [(r["matrix"].get(f"4k {rw}", {}).get(n, {}).get("iops") or 0) / (local[rw] or 1) for n in names]
        ax.bar([x + i * 0.4 for x in range(len(names))], vals, 0.4, label=f"4K {rw}")
    ax.set_xticks([x + 0.2 for x in range(len(names))], names, rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("IOPS / local tmpfs IOPS")
    ax.set_title("Normalized throughput, 16 jobs (slide 22)")
    ax.legend()
    save(fig, "normalized.png")
    return made


def headline(r):
    """The few numbers a reader wants first: 4K at QD1 and QD32, and BRP at high concurrency."""
    rows = []
    lat, q = r["latency"]["randread"], r["qd32"]
    for name in q["randread"]:
        short = "fastsan (NBD)" if name == "fastsan (NBD, fio)" else name
        l = lat.get("fastsan (BRP)" if name.startswith("fastsan (BRP") else name, {}).get("lat_mean_us")
        rows.append([short, fmt(l) if l else "", fmt(q["randread"][name].get("iops")), fmt(q["randwrite"].get(name, {}).get("iops")),
                     f"{q['randread'][name].get('server_cpu_us_per_io') or 0:.1f}"])
    return table(["system (4K random)", "QD1 read latency us", "QD32 read IOPS", "QD32 write IOPS", "server CPU us/IO (QD32 read)"], rows)


def attach_table(r):
    """fio on attached files: IOPS for 4K, MiB/s for 1M, and fastsan attach's ratio to the best nbdfuse."""
    a = r.get("attach") or {}
    if not a:
        return "not measured\n"
    names = []
    for p in a.values():
        names += [n for n in p if n not in names]
    rows = []
    for label, p in a.items():
        metric = "iops" if label.startswith("4K") else "mib_s"
        ours = p.get("fastsan attach --fuse (BRP)", {}).get(metric)
        peers = [v.get(metric) for n, v in p.items() if n.startswith("nbdfuse") and v.get(metric)]
        ratio = f"{ours / max(peers):.2f}x" if ours and peers else "n/a"
        rows.append([f"{label} ({'IOPS' if metric == 'iops' else 'MiB/s'})"] + [fmt(p.get(n, {}).get(metric)) if n in p else "n/a" for n in names] + [ratio])
    return table(["point"] + names + ["fastsan attach vs best nbdfuse"], rows) + \
        "\nfio --ioengine=psync --direct=1 on the file (queue depth = jobs: 32 for 4K, 4 for 1M); memory volumes of 1 GiB; " \
        "fastsan attach with --threads 32 over BRP (2 connections, adaptive merge); nbdfuse with its defaults.\n"


def mirror_table(r):
    """A 2-leg mirror vs one leg: IOPS, latency, and the ratios the mirroring issue sets goals for."""
    mr = {k: v for k, v in (r.get("mirror") or {}).items() if k != "status after"}
    if not mr:
        return "not measured\n"
    rows = []
    for label, p in mr.items():
        one = p.get("one leg", {})
        for name in ("one leg", "mirror", "mirror, naive log"):
            if name not in p:
                continue
            e = p[name]
            ratio = f"{e['iops'] / one['iops']:.2f}x" if one.get("iops") and name != "one leg" else ""
            rows.append([label, name, fmt(e.get("iops")), f"{e.get('lat_mean_us', 0):.0f}", f"{e.get('lat_p99_us', 0):.0f}",
                         f"{e.get('client_cpu_us_per_io', 0):.1f}", f"{e.get('server_cpu_us_per_io', 0):.1f}", ratio])
    out = table(["point", "system", "IOPS", "mean us", "p99 us", "initiator CPU us/IO", "targets' CPU us/IO", "vs one leg"], rows)
    checks = []
    w, rd = mr.get("4K randwrite QD32", {}), mr.get("4K randread QD32", {})
    devw = next((v for k, v in mr.items() if k.startswith("4K randwrite QD64")), {})
    devr = next((v for k, v in mr.items() if k.startswith("4K randread QD64")), {})
    for what, got, goal in (("mirror 4K randwrite vs one leg (device-bound legs)", devw, 0.8),
                            ("mirror 4K randread vs one leg (device-bound legs)", devr, 1.5),
                            ("mirror 4K randwrite QD32 vs one leg (memory legs, all on 2 shared cores)", w, 0.8),
                            ("mirror 4K randread QD32 vs one leg (memory legs, all on 2 shared cores)", rd, 1.5)):
        check(checks, what, got.get("mirror", {}).get("iops"), got.get("one leg", {}).get("iops"), goal)
    out += "\n" + table(["goal", "ratio", "target", "verdict"], checks)
    return out + ("\n`fastsan bench` with 2 connections per leg, adaptive merge, 1 job; legs are memory volumes of 1 GiB on two "
                  "fastsan targets on this host; the dirty-region log is a file on the local ext4 disk. \"naive log\": "
                  "tracking=naive (an update and an fdatasync before every write and another after it; nothing shared).\n")


def tls_table(r):
    """BRP and NBD over TLS vs plaintext, and fastsan's NBD over TLS vs nbdkit's, same fio client."""
    t = r.get("tls") or {}
    if not t:
        return "not measured\n"
    names = []
    for p in t.values():
        names += [n for n in p if n not in names]
    rows = []
    for label, p in t.items():
        metric = "iops" if label.startswith("4K") else "mib_s"
        for n in names:
            e = p.get(n)
            if not e:
                continue
            rows.append([label, n, fmt(e.get(metric)) + (" MiB/s" if metric == "mib_s" else ""),
                         f"{e.get('lat_mean_us', 0):.0f}", f"{e.get('server_cpu_us_per_io', 0):.1f}"])
    out = table(["point", "system", "IOPS or MiB/s", "mean us", "server CPU us/IO"], rows)
    checks = []
    for label, p in t.items():
        metric = "iops" if label.startswith("4K") else "mib_s"
        get = lambda n: p.get(n, {}).get(metric)
        check(checks, f"{label}: BRP over TLS vs BRP plaintext", get("fastsan TLS (BRP)"), get("fastsan (BRP)"), 0.0)
        check(checks, f"{label}: NBD over TLS vs NBD plaintext (fastsan)", get("fastsan TLS (NBD, fio)"), get("fastsan (NBD, fio)"), 0.0)
        lead = (get("fastsan (NBD, fio)") or 0) >= (get("nbdkit (NBD, fio)") or 0)
        check(checks, f"{label}: fastsan NBD over TLS vs nbdkit --tls=require" + (" (plaintext leads)" if lead else " (plaintext trails)"),
              get("fastsan TLS (NBD, fio)"), get("nbdkit TLS (NBD, fio)"), 1.0 if lead else 0.0)
    out += "\n" + table(["comparison", "ratio", "target", "verdict"], checks)
    return out + ("\nfio --ioengine=nbd (libnbd, nbds://; no client certificate on either server: fio cannot pass libnbd a "
                  "certificates directory), one connection; fastsan bench for BRP (brps://, the target verified against the CA; "
                  "2 connections, adaptive merge). Memory volumes "
                  "of 1 GiB. TLS 1.3 with ECDSA P-256 certificates from certtool; fastsan's TLS is rustls (ring), nbdkit's GnuTLS. "
                  "The goal: where fastsan's plaintext NBD leads nbdkit's, its TLS leads nbdkit's TLS (target 1.0x); "
                  "the TLS-vs-plaintext rows are the cost, reported (target 0).\n")


def frontend_checks(r):
    """Issue 13's comparison: NVMe/TCP against NBD at every front-end point."""
    checks = []
    for label, p in (r.get("frontends") or {}).items():
        nv, nb = p.get("NVMe/TCP", {}), p.get("NBD", {})
        check(checks, f"{label}: NVMe/TCP vs NBD, IOPS", nv.get("iops"), nb.get("iops"), 1.0)
        check(checks, f"{label}: NVMe/TCP vs NBD, server CPU per I/O", nv.get("server_cpu_us_per_io"),
              nb.get("server_cpu_us_per_io"), 1.0, higher=False)
    return checks


# The systems of the files experiment's O_DIRECT points (bench/suite.py, direct_points).
DIRECT, DIRECT_PEER, DEVICE = "fastsan (direct)", "qemu-nbd (cache=none, io_uring)", "device (fio io_uring, O_DIRECT)"


def durability_table(r):
    """File volumes on disk, 4K random I/O and FLUSH-heavy writes: fastsan against nbdkit's file plugin."""
    t = r.get("durability") or {}
    if not t:
        return "not measured\n"
    rows = []
    for label, p in t.items():
        for n, e in p.items():
            flush = e.get("flush_lat_mean_us")
            rows.append([label, n, fmt(e.get("iops")), f"{flush:.0f}" if flush else "-",
                         f"{e['server_cpu_us_per_io']:.2f}" if "server_cpu_us_per_io" in e else "-"])
        for ours, theirs in (("fastsan", "nbdkit"), (DIRECT, DIRECT_PEER), (DIRECT, DEVICE)):
            a, b = p.get(ours, {}).get("iops"), p.get(theirs, {}).get("iops")
            if a and b:
                rows.append([label, f"{ours} / {theirs}", f"{a / b:.2f}x", "", ""])
    return table(["point", "system", "IOPS", "mean FLUSH us", "server CPU us/IO"], rows) + (
        "\nfio --ioengine=nbd, 4K at random, to a 1 GiB file on this machine's disk (not tmpfs: each flush "
        "reaches the device), written whole first, served by fastsan (`file:` volume) and by nbdkit's file "
        "plugin; the FLUSH points write with a FLUSH after every 4 writes of each job (`--fsync=4`). The "
        "O_DIRECT points bypass the page cache, as a served NVMe drive would: fastsan's `file:PATH,direct` "
        "against qemu-nbd `--cache=none --aio=io_uring`, and the device itself (fio with io_uring and "
        "O_DIRECT on a file of its own: no server, the floor). Server CPU is the target process's, per I/O.\n")


def frontend_pairs(points):
    """NVMe/TCP over NBD in each repetition of the front-end points (the two ran within seconds of
    each other on one target): {point: {"iops": [...], "cpu": [...]}}, from a run's raw points."""
    reps = {}
    for e in points:
        p = e.get("params") or {}
        if e.get("experiment") != "frontends":
            continue
        # Runs before 2026-11-28 (eleventh session) did not record the point's label.
        label = p.get("point") or (f"4K {p.get('rw')}, {p.get('connections')} x QD{p.get('qd')}"
                                   + (", pinned apart" if p.get("pinned") else ""))
        reps.setdefault(label, {}).setdefault(p.get("rep"), {})[e.get("system")] = e
    out = {}
    for label, by_rep in reps.items():
        pairs = out.setdefault(label, {"iops": [], "cpu": []})
        for rep in sorted(by_rep, key=lambda r: (r is None, r)):
            nv, nb = by_rep[rep].get("NVMe/TCP"), by_rep[rep].get("NBD")
            if not nv or not nb:
                continue
            for key, metric in (("iops", "iops"), ("cpu", "server_cpu_us_per_io")):
                if nv.get(metric) and nb.get(metric):
                    pairs[key].append(nv[metric] / nb[metric])
    return {label: p for label, p in out.items() if p["iops"] or p["cpu"]}


def pairs_text(pairs):
    """Each front-end point's ratios repetition by repetition, and the median and range of all."""
    if not pairs:
        return ""
    ratios = lambda xs: " ".join(f"{x:.2f}" for x in xs) or "-"  # noqa: E731
    rows = [[label, ratios(p["iops"]), ratios(p["cpu"])] for label, p in pairs.items()]
    out = "\nNVMe/TCP over NBD in each repetition (the two measured within seconds on the same target):\n\n"
    out += table(["point", "IOPS, each repetition", "server CPU per I/O, each repetition"], rows)
    return out + "\n" + pooled_text(pairs) + (" One pair moves by more than the few percent the goal turns on; "
                                                "the median of all of them is the steadier figure.\n")


def pooled_text(pairs):
    """The median and range of every pair's ratio, IOPS and server CPU per I/O."""
    pooled = []
    for key, what in (("iops", "IOPS"), ("cpu", "server CPU per I/O")):
        xs = [x for p in pairs.values() for x in p[key]]
        if xs:
            pooled.append(f"{what} {statistics.median(xs):.3f}x (from {min(xs):.2f}x to {max(xs):.2f}x)")
    n = sum(len(p["iops"]) for p in pairs.values())
    return f"All {n} pairs, NVMe/TCP over NBD: median " + "; ".join(pooled) + "."


def frontends_table(r):
    """The same volume through BRP, NBD and NVMe/TCP, the same client."""
    t = r.get("frontends") or {}
    if not t:
        return "not measured\n"
    rows, checks = [], frontend_checks(r)
    for label, p in t.items():
        for n, e in p.items():
            rows.append([label, n, fmt(e.get("iops")), f"{e.get('lat_mean_us', 0):.0f}",
                         f"{e['server_cpu_us_per_io']:.2f}" if "server_cpu_us_per_io" in e else "-"])
    out = table(["point", "front end", "IOPS", "mean us", "server CPU us/IO"], rows)
    out += "\n" + table(["comparison", "ratio", "target", "verdict"], checks)
    out += pairs_text(r.get("frontends_pairs") or {})
    return out + ("\nOne fastsan target, one 1 GiB memory volume, served at once over BRP, NBD and NVMe/TCP; the client "
                  "is fastsan bench for all three (one connection or I/O queue per job). BRP twice: with merging off (one "
                  "request per frame, as NBD and NVMe/TCP carry them, but also one writev per frame, where the NBD and "
                  "NVMe/TCP clients gather the frames queued together into one writev), and with its default adaptive "
                  "merge (BATCH frames). Server CPU is the target process's, per I/O. Points marked "
                  "\"pinned apart\" ran with the target on CPU 1 and the client on CPU 0 (taskset), the others with both "
                  "sharing every core.\n")


def missed_section(r):
    """Where the goals are missed: per load, the goals it misses and their gaps, what the run measured
    at each point behind them, the target's profile under that load and the next steps
    (bench/misses.py)."""
    missed = r.get("missed")
    if missed is None:
        return ""
    md = "\n## Where the goals are missed: gap, profile, next step\n\n"
    unjudged = r.get("not_measured") or []
    if unjudged:
        md += f"Not measured in this run, so not judged: {len(unjudged)} goal(s) ({'; '.join(unjudged)}).\n\n"
    if not missed:
        return md + "Every goal measured in this run was met.\n"
    profiles = r.get("profiles") or {}
    secs = r.get("profile_seconds")
    if profiles:
        md += (f"Each load below ran again after the run's systems had stopped, against a fresh fastsan target "
               f"(one 1 GiB memory volume, written whole; client and target sharing the cores), with `perf record "
               f"-F 10000 -p TARGET` for {secs} s; the profile is the target's self time by where it goes, then its "
               "hottest symbols. The gaps and the measured figures come from the run itself; of the bounds on IOPS, "
               "the target's connections is an estimate (about one core per connection). Generated by "
               "bench/misses.py.\n")
    else:
        md += "No profiles were taken in this run (perf missing); the gaps and figures come from the run itself.\n"
    blocks = {}
    for e in missed:
        key = tuple(misses.load_key(l) for l in e["loads"])
        blocks.setdefault(key, []).append(e)
    for keys, entries in blocks.items():
        md += "\n### " + (" and ".join(f"`{k}`" for k in keys) if keys else "goals with no load to profile") + "\n\n"
        md += table(["goal missed", "measured", "required", "gap"],
                    [[e["target"], e["measured"], e["required"], e.get("gap") or "n/a"] for e in entries])
        # Each point behind these goals (a load can stand for two: shared and pinned apart), once.
        wheres = {}
        for e in entries:
            w = wheres.setdefault(e.get("where") or e["target"], {"entry": e, "extra": {}})
            w["extra"].update(e.get("extra") or {})
        for where, w in wheres.items():
            e, p = w["entry"], w["entry"].get("point")
            if p:
                md += (f"\nMeasured at {where}: the target {p['server_us']:.2f} us and the client "
                       f"{p['client_us']:.2f} us of CPU per I/O")
                if e.get("bounded") and p.get("bounds"):
                    md += ("; those allow " + ", ".join(f"{fmt(v)} IOPS by {k}" for k, v in p["bounds"].items())
                           + f". The least bound is {p['bound']}: the run reached {fmt(p['iops'])}, "
                           f"{p['used'] * 100:.0f}% of it.\n")
                else:
                    md += f", at {fmt(p['iops'])} IOPS.\n"
            elif w["extra"]:
                md += f"\nMeasured at {where}:\n"
            if w["extra"]:
                md += "\n" + "".join(f"- {k}: {v}\n" for k, v in w["extra"].items())
        if any(e.get("pinned") for e in entries):
            md += "\nThe profiles below ran with client and target sharing the cores, also for the pinned-apart points.\n"
        for k in keys:
            got = profiles.get(k)
            if not got:
                md += f"\nNo profile of `{k}` (perf missing or not run).\n"
                continue
            if "error" in got:
                md += f"\nProfiling `{k}` failed: {got['error']}\n"
                continue
            md += (f"\nProfile of the target under `{got['command']}` ({fmt(got['iops'])} IOPS, mean "
                   f"{got['lat_mean_us']:.1f} us, under perf):\n\n")
            md += table(["where the target's cycles go", "share"], [[g, f"{v:.1f}%"] for g, v in got["groups"]])
            md += "\n" + table(["hottest symbols", "share"],
                                [[f"{sym[:100]} ({dso})", f"{pct:.1f}%"] for pct, dso, sym in got["top"][:8]])
        steps = []
        for e in entries:
            if e.get("next") and e["next"] not in steps:
                steps.append(e["next"])
        for step in steps:
            md += f"\n**Next:** {step} (Quoted sections: {DOCS_LINK}.)\n"
    return md


DOCS_LINK = "[docs/benchmarks.md](../../../docs/benchmarks.md)"


def idle_text(m):
    """The machine's idle policy, for the report's first line ("" when the run did not record it)."""
    idle = m.get("idle")
    if not idle or not idle.get("cpuidle"):
        return ""
    ns = idle.get("halt_poll_ns")
    if ns is None:
        return f"; idle CPUs: cpuidle {idle['cpuidle']}"
    how = f"on, {ns / 1000:g} us" if ns > 0 else "off"
    return f"; idle vCPUs: cpuidle {idle['cpuidle']}, guest halt polling {how}" + \
        (" (set for this run)" if idle.get("set_for_run") else "")


def write(r, out):
    m = r["machine"]
    for name, table_of in (("mirror", mirror_table), ("attach", attach_table), ("tls", tls_table),
                           ("frontends", frontends_table), ("durability", durability_table)):
        if "latency" not in r and name in r:  # one experiment alone
            md = f"# fastsan {name} benchmark\n\nMachine: {m['nproc']} cores, kernel {m['kernel']}{idle_text(m)}; commit {m['commit']}; " \
                 f"{m['repetitions']} repetition(s) of {m['seconds_per_point']} s per point, systems alternating; medians; " \
                 f"commands in raw.json. Total {r['elapsed_s']:.0f} s.\n\n" + table_of(r) + missed_section(r)
            with open(os.path.join(out, "report.md"), "w") as fh:
                fh.write(md)
            return
    if "latency" not in r:  # the honesty check alone
        md = "# fastsan honesty check\n\n" + table(["check", "measured", "required", "verdict"], honesty(r))
        md += honesty_detail(r)
        with open(os.path.join(out, "report.md"), "w") as fh:
            fh.write(md)
        return
    md = f"# fastsan benchmark report\n\nMachine: {m['nproc']} cores, kernel {m['kernel']}{idle_text(m)}; commit {m['commit']}; " \
         f"{'QUICK run' if m['quick'] else 'full run'}: {m['repetitions']} repetition(s) ({m.get('repetitions_matrix', m.get('repetitions_matrix_scaling', m['repetitions']))} for the matrix, {m.get('repetitions_scaling', m.get('repetitions_matrix_scaling', m['repetitions']))} for the scaling) of {m['seconds_per_point']} s " \
         f"per point after {m['ramp_seconds']} s warm-up, systems alternating; medians. Every number is in raw.json " \
         f"with the command that produced it. Total {r['elapsed_s']:.0f} s.\n\n"
    md += "## Targets (ratios measured in this run)\n\n"
    md += table(["target", "measured", "required", "verdict"], targets(r))
    if r.get("missed"):
        md += "\nFor each goal missed, the last section gives the gap, the target's profile under that load and the next step.\n"
    md += "\n## Headline\n\n" + headline(r) + "\nNBD systems measured with fio --ioengine=nbd, one connection; " \
          "fastsan (BRP) with fastsan bench, 128 requesters over 2 connections, adaptive merge.\n"
    md += "\n## 0. Honesty check\n" + honesty_detail(r)
    md += "\n## 1. Latency, 4K, queue depth 1\n\n"
    rows = []
    for s in r["latency"]["randread"]:
        rr, rw = r["latency"]["randread"].get(s, {}), r["latency"]["randwrite"].get(s, {})
        rows.append((s, fmt(rr.get("lat_mean_us")), fmt(rr.get("lat_p99_us")), fmt(rw.get("lat_mean_us")), fmt(rw.get("lat_p99_us"))))
    md += table(["system", "read mean us", "read p99 us", "write mean us", "write p99 us"], rows)
    md += "\n## 2. Throughput matrix, 16 jobs (4K: IOPS, 1M: MiB/s)\n\n"
    cells = list(r["matrix"].keys())
    names = []
    for c in cells:
        names += [n for n in r["matrix"][c] if n not in names]
    rows = []
    for n in names:
        row = [n]
        for c in cells:
            p = r["matrix"][c].get(n)
            row.append(fmt(p.get("iops") if c.startswith("4k") else p.get("mib_s")) if p else "n/a")
        rows.append(row)
    md += table(["system"] + cells, rows)
    md += "\n## 3. Thread scaling, 4K random write (IOPS)\n\n"
    counts = sorted(r["scaling"], key=int)
    variants = []
    for c in counts:
        variants += [v for v in r["scaling"][c] if v not in variants]
    md += table(["requesters"] + variants, [[c] + [fmt(r["scaling"][c].get(v, {}).get("iops")) for v in variants] for c in counts])
    md += "\nBRP variants: requesters share one session of 2 connections; BRP-1 runs against a target started " \
          "with `--serial` (one request at a time per connection) and merge off. nbdkit: fio with min(n,16) jobs. " \
          "tgt: iscsi-perf can only read, so its curve is 4K random *read*.\n"
    md += "\n## 4. Normalized throughput, 4K random, 16 jobs (system / local tmpfs)\n\n"
    loc = {rw: r["matrix"].get(f"4k {rw}", {}).get("local tmpfs", {}).get("iops") for rw in ("randread", "randwrite")}
    rows = []
    for n in names:
        if n == "local tmpfs":
            continue
        vals = []
        for rw in ("randread", "randwrite"):
            p = r["matrix"].get(f"4k {rw}", {}).get(n)
            vals.append(f"{p['iops'] / loc[rw]:.3f}" if p and loc[rw] else "n/a")
        rows.append([n] + vals)
    md += table(["system", "randread / local", "randwrite / local"], rows)
    md += "\n## 5. Server CPU per I/O at the same offered load (fio, 4K, QD8, rate-limited)\n\n"
    rows = []
    for s in r["cpu"]["randread"]:
        rows.append([s] + [f"{r['cpu'][rw].get(s, {}).get('server_cpu_us_per_io', 0):.2f}" for rw in ("randread", "randwrite")]
                    + [fmt(r["cpu"]["randread"].get(s, {}).get("iops"))])
    md += table(["server", "randread us/IO", "randwrite us/IO", "IOPS reached"], rows)
    md += "\n## 6. Queue depth 32 (NBD, one connection) and BRP at 128 requesters\n\n"
    rows = []
    for s in r["qd32"]["randread"]:
        rows.append([s] + [f"{fmt(r['qd32'][rw].get(s, {}).get('iops'))} ({r['qd32'][rw].get(s, {}).get('server_cpu_us_per_io') or 0:.1f} us CPU/IO)" for rw in ("randread", "randwrite")])
    md += table(["system", "4K randread IOPS", "4K randwrite IOPS"], rows)
    if "qd8x4" in r:
        md += "\n### Queue depth 8 on 4 connections (NBD, fio: 4 jobs, each its own connection)\n\n"
        rows = []
        for s in r["qd8x4"]["randread"]:
            rows.append([s] + [f"{fmt(r['qd8x4'][rw].get(s, {}).get('iops'))} ({r['qd8x4'][rw].get(s, {}).get('server_cpu_us_per_io') or 0:.1f} us CPU/IO)" for rw in ("randread", "randwrite")])
        md += table(["system", "4K randread IOPS", "4K randwrite IOPS"], rows)
    md += "\n## 7. The loopback floor\n\n"
    f = r["floor"]
    rows = [[k, fmt(v["iops"]), f"{v['lat_mean_us']:.1f}"] for k, v in f.items() if isinstance(v, dict)]
    md += table(["wirefloor point", "IOPS", "mean us"], rows)
    if "iperf3_mib_s" in f:
        md += f"\niperf3, 1 MiB writes: {f['iperf3_mib_s']:.0f} MiB/s (`{f['iperf3_command']}`)\n"
    md += "\n## 8. A volume as a local file: fio on fastsan attach --fuse vs nbdfuse\n\n" + attach_table(r)
    md += "\n## 9. Mirroring: a 2-leg mirror vs one leg\n\n" + mirror_table(r)
    md += "\n## 10. TLS: BRP and NBD encrypted vs plaintext, and vs nbdkit --tls=require\n\n" + tls_table(r)
    md += "\n## 11. Front ends: one volume through BRP, NBD and NVMe/TCP\n\n" + frontends_table(r)
    md += "\n## 12. File volumes on disk: random I/O and FLUSH-heavy writes, fastsan vs nbdkit\n\n" + durability_table(r)
    md += missed_section(r)
    for c in charts(r, out):
        md += f"\n![{c}]({c})\n"
    with open(os.path.join(out, "report.md"), "w") as fh:
        fh.write(md)


if __name__ == "__main__":
    # `bench/report.py --pairs RUN_DIR...`: NVMe/TCP over NBD pooled over the front-end points of
    # several runs (their raw.json), the steadier figure for issue 13's parity.
    import json
    import sys
    if len(sys.argv) < 3 or sys.argv[1] != "--pairs":
        sys.exit("usage: bench/report.py --pairs RUN_DIR... (bench/results/<run> directories)")
    pooled = {}
    for d in sys.argv[2:]:
        with open(os.path.join(d, "raw.json")) as fh:
            for label, p in frontend_pairs(json.load(fh)["points"]).items():
                got = pooled.setdefault(label, {"iops": [], "cpu": []})
                got["iops"] += p["iops"]
                got["cpu"] += p["cpu"]
    if not pooled:
        sys.exit("no front-end points in those runs")
    print(pairs_text(pooled))
