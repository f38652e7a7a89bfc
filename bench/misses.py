"""Where a goal is missed: the measured gap, a profile taken in the same run, and the next step.

Issue 12 asks the report to show, for every goal a run misses, how far off it is, the profile
that says where the time goes, and what to do next. `plan` reads the verdicts of a run
(`report.targets`, the front-end comparisons) and gives one entry per missed goal: the gap, what
the run measured at that point (both sides' CPU per I/O, and what they allow on this many cores),
the load to profile and the next step. `profile_all` then profiles every distinct load once,
against a fresh target (`bench/profile.py`'s), after the run's systems are stopped. report.py
renders the result.
"""

import importlib.util
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))


def _profile_module():
    # bench/profile.py, by path: the name `profile` is also a module of Python's own library.
    spec = importlib.util.spec_from_file_location("fastsan_profile", os.path.join(HERE, "profile.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The next step for each kind of goal, from what the profiles and side-by-side measurements of
# docs/benchmarks.md found (the section named in each). A run's own figures come first in the
# report; these say what they have meant so far and what to try next.
NEXT = {
    "qd1": "At QD1 the latency is both sides' CPU per request plus the wake-ups between them, and what a "
           "wake-up costs is the machine's idle policy (the report's first line): where a VM's idle vCPUs halt "
           "at once, each wake-up goes through the hypervisor (fio QD1 reads on 2026-11-28: fastsan 76-99 us, "
           "nbdkit 63-73), and where they poll 200 us first it is cheap (20-23 and 26-32 us; \"Wake-ups are "
           "the machine's idle policy\"). Next: with polling off, keep the reply's wake-up on fio's CPU (a QD1 "
           "connection served by a thread that blocks in recv on that CPU); with it on, fastsan's own CPU per "
           "request (receive, decode, the copy, one writev), profiled.",
    "qd32-iops": "One fio connection at QD32: fio issues and completes every I/O on one thread, so its own CPU "
                 "per I/O bounds the IOPS (the bounds above; libnbd reads each reply with its own recv calls), "
                 "and the cores it shares with the target bound it again (\"What bounds QD32 on one "
                 "connection\"). The target helps only by making the client's reads cheaper (replies that "
                 "arrive together: \"Reply coalescing\") and by costing less. Next: coalescing rounds that end "
                 "when enough requests have come, then re-measure fio's CPU per I/O.",
    "qd32-cpu": "The target's CPU per I/O at QD32 on one connection: the TCP work of its writev (on loopback it "
                "also runs the client's receive), the copy of each 4K read out of a cold 1 GiB volume, and the "
                "sleeps of reply coalescing's linger rounds (\"Reply coalescing\"). Next: rounds that end when "
                "enough requests have come instead of after a timer (fewer parks per I/O), then re-measure.",
    "qd8x4": "Four connections at QD8: measured met in the last full runs; a miss here is new. Next: profile side "
             "by side with the last binary that met it (bench/ab.py OLD NEW 6 fio:RW:4x8).",
    "rate": "A paced client sends each request alone, so the target sleeps and is woken once per request; "
            "nbdkit pays the same wake-up (\"What the rate-limited points cost\"), whose price is the machine's "
            "idle policy (\"Wake-ups are the machine's idle policy\"). Next: only a cheaper wake-up (idle vCPUs "
            "that poll) or fewer of them (not possible while each request arrives alone) moves this.",
    "brp128": "BRP at 128 requesters: client and target share the cores, so the ceiling is the cores over "
              "both sides' CPU per I/O (above). The target's largest share is the kernel's copy of each 4K read "
              "out of the volume into the socket: the volume is 1 GiB and cold, wirefloor's buffer is hot "
              "(\"BRP 4K reads vs the wirefloor\"). Next: fewer sleeps on both sides (each costs a wake-up across "
              "CPUs), then the client's CPU per I/O.",
    "1m": "1 MiB sequential against iperf3: iperf3's receiver throws its bytes away, a store copies them into "
          "the volume (\"Large writes copied around the cache\"). Next: take a whole-chunk write's received "
          "buffer as the chunk itself.",
    "scaling": "The scaling curve and the adaptive-merge ratios move 10-20% between runs (\"Thread scaling, "
               "run to run\"); at 256 requesters and more fastsan bench's one thread is what binds, so the mode "
               "that costs the client least per I/O (the most requests per frame) wins. Next: confirm side by "
               "side on one target (bench/merge_compare.py, more repetitions) before changing the merge rule.",
    "honesty": "fastsan bench and fio disagree on nbdkit where the server sets the pace: the two clients do "
               "not measure the same thing (section 0). Next: compare their commands and their own CPU per "
               "I/O before reading any fastsan bench figure of this run.",
    "frontends": "NVMe/TCP's codec costs the target ~20 ns per 4K I/O more than NBD's (decode and encode, of "
                 "~2.5 us; bench/cost_by_symbol.py: \"A request's own cost\"), the shared credit operations "
                 "~25 ns more (gone with one runtime thread), and the ratio of the two moves 10-20% between runs "
                 "with the host (section 11); writes are at parity since 6a433db, reads not. Next: why NVMe/TCP's "
                 "host reads its replies in smaller pieces than NBD's at the same receive room (more wake-ups, "
                 "which the target's writev pays for), then an adaptive receive room, each with bench/ab.py and "
                 "enough rounds to tell a change from the spread.",
}


def _num(text):
    m = re.search(r"[\d.]+", text or "")
    return float(m.group()) if m else None


def _pct(x):
    """A share as a whole percent, never a misleading 0%."""
    return "under 1%" if 0 < x < 0.5 else f"{x:.0f}%"


def gap(measured, required):
    """How far a ratio is from its goal, in words: ('1.22x', '>= 1.3x') -> '6% short of 1.3x'. The
    ratio comes rounded to two decimals (as the verdict table prints it)."""
    got, goal = _num(measured), _num(required)
    if got is None or goal is None:
        return None
    if required.strip().startswith("within"):
        return f"{_pct(abs(got - 1) * 100)} off, {goal:g}% allowed"
    if required.strip().startswith(">="):
        return f"{_pct((1 - got / goal) * 100)} short of {goal:g}x"
    return f"{_pct((got / goal - 1) * 100)} over {goal:g}x"


def _threads(point, key, flag):
    """A point's client threads or connections: from its JSON (fastsan bench) or its command (fio)."""
    if point.get(key):
        return int(point[key])
    m = re.search(flag + r"=?(\d+)", point.get("command") or "")
    return int(m.group(1)) if m else 1


def _sides(point, ncpu, pinned):
    """(client threads, target connections) that can run at once."""
    cores = 1 if pinned else ncpu
    return (min(cores, _threads(point, "client_threads", "--numjobs")),
            min(cores, _threads(point, "connections", "--numjobs")))


def ceiling(point, ncpu, pinned=False):
    """What the run measured at one point: both sides' CPU per I/O and the IOPS those costs allow,
    the least of three bounds: the machine's cores shared by both sides; the client's threads (a fio
    job or a fastsan bench thread issues and completes its I/Os on one thread); the target's
    connections (an estimate: a connection is decoded and mostly answered by one task, so about one
    core at a time, though replies finished elsewhere are written by a second task). None when the
    point lacks either CPU figure. `pinned`: the client ran on one core and the target on another
    (the front ends' "pinned apart" points), so nothing is shared and each side has one core."""
    if not point:
        return None
    s, c, iops = point.get("server_cpu_us_per_io"), point.get("client_cpu_us_per_io"), point.get("iops")
    if not s or not c or not iops:
        return None
    client_threads, conns = _sides(point, ncpu, pinned)
    if pinned:
        bounds = {"the client's one core": 1e6 / c, "the target's one core": 1e6 / s}
    else:
        bounds = {"the cores, shared": ncpu * 1e6 / (s + c),
                  f"the client's {client_threads} thread{'s' if client_threads > 1 else ''}": client_threads * 1e6 / c,
                  f"the target's {conns} connection{'s' if conns > 1 else ''}": conns * 1e6 / s}
    bound = min(bounds, key=bounds.get)
    return {"server_us": s, "client_us": c, "iops": iops, "bounds": bounds, "bound": bound,
            "ceiling": bounds[bound], "used": iops / bounds[bound]}


def _goal_iops(p, ncpu, goal):
    """What the client's threads and the target's CPU per I/O must allow for `goal` IOPS, in words."""
    s, c = p.get("server_cpu_us_per_io"), p.get("client_cpu_us_per_io")
    if not c or not goal:
        return {}
    client_threads, conns = _sides(p, ncpu, False)
    client = client_threads * 1e6 / c
    if client < goal:
        return {"the goal against what the client allows": (
            f"{goal / 1e3:.0f} K IOPS needed; at its measured {c:.1f} us per I/O the client's "
            f"{client_threads} thread{'s' if client_threads > 1 else ''} allow{'' if client_threads > 1 else 's'} "
            f"{client / 1e3:.0f} K, whatever the target costs: only a client that spends less per I/O (fewer, "
            "larger reads of its socket) gets there")}
    # The most the target may spend per I/O: the cores it shares with the client, and its connections.
    need = min(ncpu * 1e6 / goal - c, conns * 1e6 / goal)
    text = f"{need:.1f} us for {goal / 1e3:.0f} K IOPS"
    if s and s <= need:
        text += (f"; the target spent {s:.1f}: what is missing is time both sides spent waiting for each other, "
                 "not the target's CPU")
    elif s:
        text += f"; the target spent {s:.1f}"
    return {"the target's CPU per I/O the goal allows": text}


def _rate(point, quick):
    m = re.search(r"--rate_iops=(\d+)", (point or {}).get("command") or "")
    return int(m.group(1)) if m else (10000 if quick else 20000)


def _row_spec(r, what, measured, required, quick, ncpu):
    """(kind, where, point measured, loads to profile, extra figures) for one missed goal; None for a
    goal this module does not know."""
    if what.startswith("honesty:"):
        return "honesty", what.split(",")[0][len("honesty: "):], None, [], {}
    m = re.match(r"NBD QD1 4K read latency", what)
    if m:
        p = r["latency"]["randread"].get("fastsan (NBD, fio)")
        return "qd1", "fio, 4K random read at QD1", p, ("nbd", ["--rw=randread", "--bs=4k", "--iodepth=1"]), {}
    m = re.match(r"NBD 4K (\w+) QD32, 1 connection: (IOPS|server CPU)", what)
    if m:
        rw, which = m.groups()
        q = r["qd32"][rw]
        p = q.get("fastsan (NBD, fio)")
        extra = {}
        if which == "IOPS" and p:
            peer = max((v.get("iops") or 0 for k, v in q.items() if k in ("nbdkit", "qemu-nbd")), default=0)
            extra = _goal_iops(p, ncpu, (_num(required) or 0) * peer)
        kind = "qd32-iops" if which == "IOPS" else "qd32-cpu"
        return kind, f"fio, 4K {rw} at QD32 on one connection", p, \
            ("nbd", [f"--rw={rw}", "--bs=4k", "--iodepth=32"]), extra
    m = re.match(r"NBD 4K (\w+) QD8 x 4 connections", what)
    if m:
        rw = m.group(1)
        return "qd8x4", f"fio, 4K {rw} at QD8 on 4 connections", r["qd8x4"][rw].get("fastsan (NBD, fio)"), \
            ("nbd", [f"--rw={rw}", "--bs=4k", "--iodepth=8", "--numjobs=4", "--group_reporting"]), {}
    m = re.match(r"NBD 4K (\w+) QD8, same offered load", what)
    if m:
        rw = m.group(1)
        p = r["cpu"][rw].get("fastsan")
        rate = _rate(p, quick)
        return "rate", f"fio, 4K {rw} at QD8 paced to {rate} IOPS", p, \
            ("nbd", [f"--rw={rw}", "--bs=4k", "--iodepth=8", f"--rate_iops={rate}"]), {}
    m = re.match(r"BRP 4K randread, 128 requesters", what)
    if m:
        return "brp128", "fastsan bench, BRP 4K random read, 128 requesters on 2 connections", \
            r["qd32"]["randread"].get("fastsan (BRP, 128 requesters, 2 conns)"), \
            ("brp", ["--rw", "randread", "--bs", "4k", "--iodepth", "128", "--connections", "2"]), {}
    m = re.match(r"BRP 1M sequential (\w+)", what)
    if m:
        rw = m.group(1)
        return "1m", f"fastsan bench, BRP 1 MiB {rw}, 16 jobs", r["matrix"].get(f"1m {rw}", {}).get("fastsan (BRP)"), \
            ("brp", ["--rw", rw, "--bs", "1m", "--jobs", "16", "--connections", "2"]), {}
    m = re.match(r"BRP-3 thread scaling", what)
    if m:
        falls = re.findall(r"(\d+)->(\d+)", measured)
        n = falls[0][1] if falls else "128"
        return "scaling", f"fastsan bench, BRP 4K random write, {n} requesters", _merge_point(r, n), \
            _merge_load(n), _merge_extra(r, n)
    m = re.match(r"adaptive vs the better of merge off and always, (\d+) requesters", what)
    if m:
        n = m.group(1)
        return "scaling", f"fastsan bench, BRP 4K random write, {n} requesters", _merge_point(r, n), \
            _merge_load(n), _merge_extra(r, n)
    m = re.match(r"4K (\w+), (\d+) x QD(\d+)(, pinned apart)?: NVMe/TCP vs NBD", what)
    if m:
        rw, conns, qd, _ = m.groups()
        label = what.split(":")[0]
        p = (r.get("frontends") or {}).get(label, {})
        load = ["--rw", rw, "--bs", "4k", "--iodepth", qd, "--jobs", conns]
        extra = {}
        for name in ("NVMe/TCP", "NBD"):
            e = p.get(name) or {}
            if e.get("iops"):
                extra[name] = f"{e['iops'] / 1e3:.0f} K IOPS, server {e.get('server_cpu_us_per_io', 0):.2f} us per I/O"
        return "frontends", f"fastsan bench, {label}", p.get("NVMe/TCP"), [("nvme", load), ("nbd-bench", load)], extra
    return None


def _scaling_point(r, n):
    s = r.get("scaling", {})
    return s.get(n) or s.get(str(n)) or (s.get(int(n)) if str(n).isdigit() else None) or {}


def _merge_point(r, n):
    return _scaling_point(r, n).get("BRP-3 (adaptive merge)")


def _merge_load(n):
    return ("brp", ["--rw", "randwrite", "--bs", "4k", "--iodepth", str(n), "--connections", "2",
                    "--merge", "adaptive"])


def _merge_extra(r, n):
    point = _scaling_point(r, n)
    extra = {}
    for name in ("BRP-2 (merge off)", "BRP-3 (adaptive merge)", "BRP-3T (always merge)"):
        e = point.get(name) or {}
        if e.get("iops"):
            # `frames` counts from the client's start, warm-up included, as `ios_total` does.
            frames, ios = e.get("frames") or 0, e.get("ios_total") or e.get("ios")
            per = f", about {ios / frames:.1f} requests per frame" if frames and ios else ""
            extra[name] = f"{e['iops'] / 1e3:.0f} K IOPS{per}"
    return extra


def _fall(r, measured):
    """'falls at 128->256' as how far the adaptive curve fell there."""
    words = []
    for a, b in re.findall(r"(\d+)->(\d+)", measured):
        ia, ib = (_merge_point(r, a) or {}).get("iops"), (_merge_point(r, b) or {}).get("iops")
        if ia and ib:
            words.append(f"{_pct((1 - ib / ia) * 100)} lower at {b} requesters than at {a} (5% allowed)")
    return "; ".join(words) or None


def not_measured(rows):
    """The goals of `rows` a run could not judge (a peer or a figure missing)."""
    return [what for what, _, _, verdict in rows if verdict == "not measured"]


def plan(r, rows):
    """One entry per missed goal in `rows` ((target, measured, required, verdict) as report.py makes
    them): its gap, where it was measured and what the run measured there, the loads to profile and
    the next step."""
    quick = (r.get("machine") or {}).get("quick", False)
    ncpu = (r.get("machine") or {}).get("nproc") or os.cpu_count() or 1
    out = []
    for what, measured, required, verdict in rows:
        if verdict != "MISSED":
            continue
        how_far = gap(measured, required)
        spec = _row_spec(r, what, measured, required, quick, ncpu)
        if spec is None:
            out.append({"target": what, "measured": measured, "required": required, "gap": how_far,
                        "kind": None, "where": what, "point": None, "bounded": False, "pinned": False,
                        "extra": {}, "loads": [], "next": None})
            continue
        kind, where, point, loads, extra = spec
        loads = loads if isinstance(loads, list) else [loads]
        if what.startswith("BRP-3 thread scaling"):
            how_far = _fall(r, measured)
        pinned = "pinned apart" in what
        out.append({"target": what, "measured": measured, "required": required, "gap": how_far,
                    "kind": kind, "where": where, "point": ceiling(point, ncpu, pinned=pinned),
                    # At QD1 and under a paced client neither side runs flat out: no ceiling, only costs.
                    "bounded": kind not in ("qd1", "rate"), "pinned": pinned, "extra": extra,
                    "loads": [{"protocol": p, "load": list(a)} for p, a in loads], "next": NEXT[kind]})
    return out


def load_key(load):
    return f"{load['protocol']} {' '.join(load['load'])}"


def profile_all(entries, binary, out_dir, seconds, log=print):
    """Profiles every distinct load of `entries` once against one fresh target; returns
    {load key: {command, iops, lat_mean_us, top, groups}} (or {error} where it failed)."""
    prof = _profile_module()
    loads = {}
    for e in entries:
        for load in e["loads"]:
            loads.setdefault(load_key(load), load)
    if not loads:
        return {}
    got = {}
    try:
        target = prof.start_target(binary)
    except Exception as ex:
        return {key: {"error": f"the target for profiling did not start: {ex}"} for key in loads}
    try:
        for i, (key, load) in enumerate(loads.items()):
            log(f"profiling a missed goal's load ({i + 1}/{len(loads)}): {key}")
            try:
                rec = prof.record(binary, target, load["protocol"], load["load"], seconds,
                                  os.path.join(out_dir, f"profile-{i + 1}"), graph="none")
                rows = prof.symbols(rec["perf_data"])
                os.unlink(rec["perf_data"])  # the table is kept; perf.data is large and host-specific
                got[key] = {"command": rec["command"], "iops": rec["iops"], "lat_mean_us": rec["lat_mean_us"],
                            "top": rows[:12], "groups": prof.groups(rows)}
            except Exception as ex:  # one load that fails is reported, not fatal
                got[key] = {"error": str(ex)}
    finally:
        target.stop()
    return got
