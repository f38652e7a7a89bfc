#!/usr/bin/env bash
# Two fastsan binaries on fresh sparse O_DIRECT volumes: each round, each binary serves a new
# 4 GiB sparse file (`file:PATH,direct`) and fio writes 4K at random into it for a few seconds,
# so that most writes allocate (the case a volume meets while it fills). Alternating, the order
# turning around every round. Prints per run the IOPS and the server's CPU per I/O.
#
#   bench/sparse_ab.sh A_BINARY B_BINARY ROUNDS [DIR] [JOBSxQD] [SECONDS]
#   bench/sparse_ab.sh /tmp/fastsan-old target/release/fastsan 3 /var/tmp 1x32 3
set -euo pipefail
a=$1 b=$2 rounds=$3 dir=${4:-/var/tmp} load=${5:-1x32} secs=${6:-3}
jobs=${load%x*} qd=${load#*x}
tick=$(getconf CLK_TCK)
run() {
  local bin=$1 img port pid c0 c1 iops
  img=$(mktemp -p "$dir" fastsan-sparse-XXXXXX.img)
  truncate -s 4G "$img"
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  "$bin" serve --brp 127.0.0.1:0 --nbd "127.0.0.1:$port" --volume "v=file:$img,direct" >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
  c0=$(awk '{print $14+$15}' "/proc/$pid/stat")
  fio --name=s --ioengine=nbd --uri="nbd://127.0.0.1:$port/v" --rw=randwrite --bs=4k \
    --iodepth="$qd" --numjobs="$jobs" --group_reporting --time_based --runtime="$secs" \
    --output-format=json --output="$img.json" >/dev/null 2>&1
  iops=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"]))' "$img.json")
  c1=$(awk '{print $14+$15}' "/proc/$pid/stat")
  kill "$pid"; wait "$pid" 2>/dev/null || true
  rm -f "$img" "$img.json"
  python3 -c "print(f'{\"$(basename "$bin")\":>16} {$iops:>8} IOPS  server {($c1-$c0)/$tick*1e6/max($iops*$secs,1):6.1f} us/IO')"
}
for r in $(seq "$rounds"); do
  if (( r % 2 )); then run "$a"; run "$b"; else run "$b"; run "$a"; fi
done
