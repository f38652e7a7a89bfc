#!/usr/bin/env bash
# Profiles a fastsan target under one load, the way docs/benchmarks.md's profiles were taken:
# a fresh target serving a 1 GiB memory volume over BRP and NBD, the volume written whole
# first, the load started, then `perf record` of the target alone for SECONDS (after 2 s).
#
#   bench/profile.sh [-b BINARY] [-s SECONDS] [-g fp|dwarf] [-o OUT] nbd FIO_ARGS...
#   bench/profile.sh [-b BINARY] [-s SECONDS] [-g fp|dwarf] [-o OUT] brp BENCH_ARGS...
#
#   bench/profile.sh nbd --rw=randread --bs=4k --iodepth=32      # fio --ioengine=nbd, 1 connection
#   bench/profile.sh brp --rw randwrite --bs 4k --iodepth 256 --connections 2   # fastsan bench
#
# Prints the load's IOPS and the target's hottest symbols; OUT (default: a new directory
# under /tmp) keeps perf.data, the load's JSON and the target's log.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=target/release/fastsan secs=4 graph=fp out=""
while getopts "b:s:g:o:" o; do
  case $o in
    b) bin=$OPTARG ;;
    s) secs=$OPTARG ;;
    g) graph=$OPTARG ;;
    o) out=$OPTARG ;;
    *) sed -n '2,14p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
proto=${1:-}
[ "$proto" = nbd ] || [ "$proto" = brp ] || { sed -n '2,14p' "$0"; exit 2; }
shift
command -v perf >/dev/null || { echo "perf is missing (apt-get install linux-perf)" >&2; exit 1; }
[ "$proto" = brp ] || command -v fio >/dev/null || { echo "fio is missing (apt-get install fio)" >&2; exit 1; }
[ -x "$bin" ] || cargo build --release --quiet -p fastsan
out=${out:-$(mktemp -d /tmp/fastsan-profile.XXXXXX)}
mkdir -p "$out"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
brp=$(port) nbd=$(port)
"$bin" serve --brp "127.0.0.1:$brp" --nbd "127.0.0.1:$nbd" --volume vol0=memory:1G >"$out/target.log" 2>&1 &
target=$!
trap 'kill $target 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$nbd") 2>/dev/null && break
  sleep 0.1
done
# Reads of a fresh memory volume would read holes: write it whole first.
fill=$(mktemp /dev/shm/fastsan-profile-fill.XXXXXX)
yes fastsan | head -c $((1 << 30)) >"$fill" || true
"$bin" cp "$fill" "brp://127.0.0.1:$brp/vol0" >/dev/null
rm -f "$fill"
run=$((secs + 4))
if [ "$proto" = nbd ]; then
  fio --name=p --ioengine=nbd --uri="nbd://127.0.0.1:$nbd/vol0" --time_based --runtime="$run" \
    --output-format=json --output="$out/load.json" "$@" >/dev/null &
else
  "$bin" bench "brp://127.0.0.1:$brp/vol0" --runtime "$run" --json "$@" >"$out/load.json" &
fi
load=$!
sleep 2
callgraph=-g
[ "$graph" = dwarf ] && callgraph="--call-graph=dwarf,16384"
perf record -F 10000 $callgraph -o "$out/perf.data" -p "$target" -- sleep "$secs" >/dev/null 2>&1
wait $load
python3 - "$out/load.json" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
if isinstance(j.get("jobs"), list):
    d = j["jobs"][0]
    d = d["read"] if d["read"]["total_ios"] else d["write"]
    print(f"load: {d['iops'] / 1e3:.1f} K IOPS, mean latency {d['lat_ns']['mean'] / 1e3:.1f} us")
else:
    print(f"load: {j['iops'] / 1e3:.1f} K IOPS, mean latency {j['lat_mean_us']:.1f} us")
EOF
perf report -i "$out/perf.data" --no-children --sort dso,sym --stdio -g none 2>/dev/null | grep '%' | head -25
echo "perf.data, the load's JSON and the target's log: $out"
