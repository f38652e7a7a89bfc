#!/usr/bin/env bash
# Two fastsan binaries side by side under a flush-heavy load on a file volume
# on disk: fio's NBD engine, 4K random writes, 4 connections of queue depth 16,
# a FLUSH after every 4 writes (--fsync=4), 6 s per run; the binaries
# alternate (A B B A) for ROUNDS rounds. Prints IOPS and the mean FLUSH latency.
#   bench/fsync_ab.sh A_BINARY B_BINARY [ROUNDS] [DIR]   (DIR: where the 256 MiB files go, default /var/tmp)
#   JOBS=1 QD=1 bench/fsync_ab.sh ...                     (one connection at queue depth 1 instead)
set -euo pipefail
a=$1 b=$2 rounds=${3:-3} dir=${4:-/var/tmp} jobs=${JOBS:-4} qd=${QD:-16}
one() { # binary port label
  f="$dir/fastsan-fsync-ab-$2.img" out=$(mktemp)
  rm -f "$f"; truncate -s 256M "$f"
  "$1" serve --brp "127.0.0.1:$(($2 + 100))" --nbd "127.0.0.1:$2" --volume "v=file:$f" >"$out.log" 2>&1 & pid=$!
  i=0
  while ! (exec 3<>"/dev/tcp/127.0.0.1/$2") 2>/dev/null; do
    i=$((i+1)); if [ $i -ge 100 ]; then echo "$1 did not start:"; cat "$out.log"; exit 1; fi; sleep 0.05
  done
  fio --name=f --ioengine=nbd --uri="nbd://127.0.0.1:$2/v" --rw=randwrite --bs=4k --iodepth="$qd" --numjobs="$jobs" \
      --fsync=4 --size=$((256 / jobs))M --offset_increment=$((256 / jobs))M --group_reporting --time_based --runtime=6 \
      --output-format=json --output="$out" >/dev/null 2>&1
  python3 -c "import json,sys; j=json.load(open('$out'))['jobs'][0]; print('$3', round(j['write']['iops']), 'IOPS,', round(j['sync']['lat_ns']['mean']/1000), 'us per FLUSH')"
  kill $pid; wait $pid 2>/dev/null || true; pid=; rm -f "$f" "$out" "$out.log"
}
pid=
trap '[ -z "$pid" ] || kill $pid 2>/dev/null' EXIT
r=0
while [ $r -lt "$rounds" ]; do
  one "$a" 10941 A; one "$b" 10942 B; one "$b" 10943 B; one "$a" 10944 A
  r=$((r+1))
done
