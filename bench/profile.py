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
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite  # noqa: E402


NQN = "nqn.2026-11.io.fastsan:profile"

# What a flat profile's symbols are spent on, in this order (the first match wins): a symbol's
# self time goes to one group, so that a report can say "half of the target's cycles are the
# TCP stack" without a reader adding up fifty lines.
GROUPS = [
    ("copying data between the process and the kernel", "k",
     r"^(_copy_from_iter|_copy_to_iter|_?copy_(to|from)_user|copy_user|rep_movs|memcpy|__memcpy|memmove|"
     r"__check_object_size|check_heap_object|__skb_datagram_iter|skb_copy_datagram|simple_copy_to_iter|"
     r"copy_page_(to|from)_iter)"),
    ("the TCP/IP stack and socket buffers", "k",
     r"(tcp|inet|ipv4|ip4|skb|sock|netif|loopback|napi|csum|qdisc|softirq|bbr|backlog|eth_type|validate_xmit|"
     r"__sys_recv|__sys_send|raw_local|(^|_)(ip|sk|net|dev|dst|nf)_)"),
    ("sleeping and waking (scheduler, timers, locks)", "k",
     r"(finish_task_switch|schedule|try_to_wake_up|ttwu|enqueue|dequeue|select_task_rq|update_curr|"
     r"update_load|psi_|pick_next|_raw_spin|queued_spin|pv_queued|hrtimer|timerfd|__switch_to|switch_mm|"
     r"wake_up|futex|idle|read_tsc|ktime_get|sched|cpuacct|irq)"),
    ("system calls and polling", "k",
     r"(syscall|entry_SYSCALL|__x64_sys|epoll|(^|_)ep_|fdget|fget|fput|do_writev|do_readv|vfs_|rw_verify|"
     r"import_iovec|iovec|security_|apparmor|rcu_)"),
    ("memory management (faults, page allocation)", "k",
     r"(page|folio|alloc|kmem|slab|kmalloc|kfree|mm_|rmqueue|memcg|lru|pte|pmd|tlb|madvise|mmap)"),
    ("the kernel, other", "k", r""),
    ("the async runtime (tokio)", "u", r"(^|[<\s(])(tokio|mio)::"),
    ("the volume (backends: memory, stats, file...)", "u", r"fastsan_target::backend::"),
    ("libc, the vDSO (clock reads), the loader", "lib", r""),
    ("fastsan, the rest", "u", r""),
]


def is_kernel(dso):
    """The kernel and its modules (perf shows both in brackets), not the vDSO."""
    return dso.startswith("[") and dso not in ("[vdso]", "[unknown]", "[vsyscall]")


def is_lib(dso):
    return dso in ("[vdso]", "[vsyscall]") or dso.startswith(("libc", "ld-linux", "libm", "libpthread"))


def start_target(binary):
    """A fresh target serving one 1 GiB memory volume over BRP, NBD and NVMe/TCP, written whole."""
    brp, nbd, nvme = suite.free_port(), suite.free_port(), suite.free_port()
    target = suite.System("target", "fastsan")
    target.spawn([binary, "serve", "--brp", f"127.0.0.1:{brp}", "--nbd", f"127.0.0.1:{nbd}",
                  "--nvme", f"127.0.0.1:{nvme}", "--nvme-nqn", NQN, "--volume", "vol0=memory:1G"], nbd)
    try:
        suite.wait_port(nvme)
        suite.write_whole([f"brp://127.0.0.1:{brp}/vol0"])
    except BaseException:
        target.stop()
        raise
    target.urls = {"brp": f"brp://127.0.0.1:{brp}/vol0", "nbd-bench": f"nbd://127.0.0.1:{nbd}/vol0",
                   "nbd": f"nbd://127.0.0.1:{nbd}/vol0", "nvme": f"nvme+tcp://127.0.0.1:{nvme}/{NQN}/1"}
    return target


def record(binary, target, protocol, load, seconds, out, graph="fp", client=False):
    """Runs one load against `target` (fio's NBD client for "nbd", else fastsan bench) and records
    the target (or, with `client`, the load) with perf for `seconds`, after 2 s. Returns the load's
    command, IOPS and mean latency, and the path of perf.data."""
    os.makedirs(out, exist_ok=True)
    load_json = os.path.join(out, "load.json")
    run = seconds + 4
    errors = open(os.path.join(out, "load.stderr"), "w+")
    if protocol == "nbd":
        cmd = ["fio", "--name=p", "--ioengine=nbd", f"--uri={target.urls['nbd']}", "--time_based",
               f"--runtime={run}", "--output-format=json", f"--output={load_json}"] + list(load)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors)
    else:
        cmd = [binary, "bench", target.urls[protocol], "--runtime", str(run), "--json"] + list(load)
        proc = subprocess.Popen(cmd, stdout=open(load_json, "w"), stderr=errors)
    try:
        time.sleep(2)
        data = os.path.join(out, "perf.data")
        graph_args = {"fp": ["-g"], "dwarf": ["--call-graph=dwarf,16384"], "none": []}[graph]
        p = subprocess.run(["perf", "record", "-F", "10000", *graph_args, "-o", data,
                            "-p", str(proc.pid if client else target.pid), "--", "sleep", str(seconds)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=seconds + 60)
        if p.returncode != 0:
            raise RuntimeError(f"perf record failed: {p.stderr.strip()[-300:]}")
        if proc.wait(timeout=run + 60) != 0:
            errors.seek(0)
            raise RuntimeError(f"the load failed: {' '.join(cmd)}: {errors.read().strip()[-300:]}")
    finally:
        errors.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if os.path.getsize(errors.name) == 0:
        os.unlink(errors.name)
    j = json.load(open(load_json))
    if isinstance(j.get("jobs"), list):
        d = j["jobs"][0]
        d = d["read"] if d["read"]["total_ios"] else d["write"]
        iops, lat = d["iops"], d["lat_ns"]["mean"] / 1e3
    else:
        iops, lat = j["iops"], j["lat_mean_us"]
    return {"command": " ".join(cmd), "iops": iops, "lat_mean_us": lat, "perf_data": data}


def symbols(perf_data, counts=False):
    """The flat profile: (percent of samples, dso, symbol), hottest first; with `counts`, the number
    of samples instead of the percentage (bench/cost_by_symbol.py turns them into ns per I/O)."""
    out = subprocess.run(["perf", "report", "-i", perf_data, "--no-children", "--sort", "dso,sym", "--stdio",
                          "-g", "none"] + (["-n"] if counts else []), capture_output=True, text=True,
                         timeout=300).stdout
    return parse_symbols(out, counts)


def parse_symbols(text, counts=False):
    """perf report's lines "  12.34%  dso  [k] symbol", or with -n "  12.34%  5678  dso  [k] symbol"."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(?:(\d+)\s+)?(\S+)\s+\[[.k]\]\s+(.*\S)", line)
        if m and (m.group(2) is not None) == counts:
            rows.append((int(m.group(2)) if counts else float(m.group(1)), m.group(3), m.group(4)))
    return rows


def group_of(dso, sym):
    kernel, lib = is_kernel(dso), is_lib(dso)
    for name, where, pattern in GROUPS:
        if where == "k" and not kernel or where == "lib" and not lib or where == "u" and (kernel or lib):
            continue
        if re.search(pattern, sym):
            return name
    return "other"


def groups(rows):
    """Each group's share of the samples, largest first."""
    share = {}
    for pct, dso, sym in rows:
        g = group_of(dso, sym)
        share[g] = share.get(g, 0.0) + pct
    return sorted(share.items(), key=lambda kv: -kv[1])


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
    target = start_target(a.binary)
    try:
        got = record(a.binary, target, a.protocol, a.load, a.seconds, out, a.graph, a.client)
    except RuntimeError as e:
        sys.exit(str(e))
    finally:
        target.stop()
    print(f"load: {got['iops'] / 1e3:.1f} K IOPS, mean latency {got['lat_mean_us']:.1f} us")
    print(f"load command: {got['command']}")
    rows = symbols(got["perf_data"])
    for pct, dso, sym in rows[:25]:
        print(f"{pct:8.2f}%  {dso:<18} {sym}")
    print("by group: " + ", ".join(f"{g} {p:.1f}%" for g, p in groups(rows)))
    print(f"perf.data and the load's JSON: {out}")


if __name__ == "__main__":
    main()
