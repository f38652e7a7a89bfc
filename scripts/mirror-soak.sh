#!/usr/bin/env bash
# The mirror's long fault run (not in the suite; its result is in docs/mirror.md):
#   scripts/mirror-soak.sh [ROUNDS]          (default 100)
# Two targets on file volumes, one `fastsan bench --verify` (random reads and
# writes) through a 2-leg mirror for the whole run; every round kills one
# target with kill -9 (alternating), lets the mirror degrade its leg, starts it
# again on the same address and waits until both legs are in sync. At the end
# the bench must report 0 errors and 0 mismatches, and the legs' data must be
# byte-identical (cmp). Uses target/release/fastsan (or $FASTSAN).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-100}
F=${FASTSAN:-target/release/fastsan}
[ -x "$F" ] || cargo build --release --quiet -p fastsan
dir=$(mktemp -d /var/tmp/fastsan-soak-XXXXXX)
pids=("" "")
bench=""
cleanup() {
  for p in "${pids[@]}" $bench; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
truncate -s 256M "$dir/a.img" "$dir/b.img"
files=("$dir/a.img" "$dir/b.img")
addrs=("127.0.0.1:0" "127.0.0.1:0")

# serve LEG: starts leg's target on its address; learns the address from its first line.
serve() {
  local i=$1 out="$dir/serve$1.out"
  : > "$out"
  "$F" serve --brp "${addrs[$i]}" --no-nbd --volume "v=file:${files[$i]}" > "$out" 2>> "$dir/serve$i.log" &
  pids[$i]=$!
  for _ in $(seq 100); do
    grep -q "serving BRP on" "$out" && break
    sleep 0.05
  done
  addrs[$i]=$(sed -n 's/.*serving BRP on \([^ ]*\).*/\1/p' "$out" | head -1)
}
field() { python3 -c "import json,sys; s=json.load(sys.stdin); print(eval(sys.argv[1]))" "$1"; }

serve 0
serve 1
spec="mirror:brp://${addrs[0]}/v,brp://${addrs[1]}/v,log=$dir/m.log,failover=0.5"
"$F" mirror create --assume-clean "$spec" > /dev/null 2>&1
"$F" bench "$spec" --rw randrw --bs 4k --iodepth 16 --size 64M --verify --json \
  --runtime $((ROUNDS * 4 + 10)) > "$dir/bench.json" 2> "$dir/bench.log" &
bench=$!
sleep 2
start=$(date +%s)
for r in $(seq "$ROUNDS"); do
  i=$((r % 2))
  kill -9 "${pids[$i]}"
  wait "${pids[$i]}" 2>/dev/null || true
  sleep 1.2   # past the failover time: the leg is degraded, I/O goes on
  serve "$i"
  t0=$(date +%s.%N)
  for _ in $(seq 300); do
    s=$("$F" mirror status --json "$spec")
    [ "$(echo "$s" | field 'all(l["state"] == "insync" for l in s["legs"])')" = True ] && break
    sleep 0.1
  done
  echo "round $r/$ROUNDS: leg $i killed, back and in sync after $(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')") s; $(echo "$s" | field '"{} regions resynced so far, {} degrades, legs {}".format(s["resynced_regions"], s["degraded_events"], ", ".join(l["state"] for l in s["legs"]))')"
done
elapsed=$(( $(date +%s) - start ))
echo "$ROUNDS rounds in $elapsed s; waiting for the bench to end"
# The load must have lasted through every round.
[ "$elapsed" -lt $((ROUNDS * 4 + 5)) ] || { echo "the rounds outlasted the bench: raise its runtime"; exit 1; }
wait "$bench" || { echo "bench FAILED:"; tail -5 "$dir/bench.log"; cat "$dir/bench.json"; exit 1; }
python3 - "$dir/bench.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"bench: {r['reads']} reads, {r['writes']} writes, {r['errors']} errors, {r['verify_mismatches']} mismatches, "
      f"IOPS {r['iops']:.0f}")
assert r["errors"] == 0 and r["verify_mismatches"] == 0
EOF
s=$("$F" mirror status --json "$spec")
size=$(echo "$s" | field 's["size"]')
echo "$s" | field '"after: {} degrades, {} regions ({} MiB) resynced, {} dirty".format(s["degraded_events"], s["resynced_regions"], s["resynced_bytes"] >> 20, s["dirty"])'
cmp -n "$size" "${files[@]}"
echo "legs identical ($size bytes compared)"
