#!/usr/bin/env bash
# Two fastsan binaries side by side as a mirror's initiator: two `fastsan serve`
# targets (binary B) with 256 MiB memory legs, `fastsan bench mirror:...` 4K random
# writes at queue depth 32 for 4 s, the client binary alternating (A then B) for
# ROUNDS rounds. Prints IOPS per run.
#   bench/mirror_ab.sh A_BINARY B_BINARY [ROUNDS]
set -euo pipefail
a=$1 b=$2 rounds=${3:-5}
dir=$(mktemp -d)
"$b" serve --brp 127.0.0.1:19001 --no-nbd --volume v=memory:256M >"$dir/a.log" 2>&1 & pa=$!
"$b" serve --brp 127.0.0.1:19002 --no-nbd --volume v=memory:256M >"$dir/b.log" 2>&1 & pb=$!
trap 'kill $pa $pb; rm -rf "$dir"' EXIT
for port in 19001 19002; do
  i=0
  while ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; do
    i=$((i+1)); if [ $i -ge 100 ]; then echo "a target did not start:"; cat "$dir"/*.log; exit 1; fi; sleep 0.05
  done
done
spec="mirror:brp://127.0.0.1:19001/v,brp://127.0.0.1:19002/v,log=$dir/m.log"
"$b" mirror create --assume-clean "$spec" >/dev/null
for round in $(seq "$rounds"); do
  for which in A B; do
    bin=$a; [ $which = B ] && bin=$b
    iops=$("$bin" bench "$spec" --rw randwrite --bs 4k --iodepth 32 --runtime 4 --json 2>/dev/null |
      python3 -c 'import json,sys; print(round(json.load(sys.stdin)["iops"]))')
    echo "round $round $which $iops"
  done
done
