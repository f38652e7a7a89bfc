#!/bin/bash
# old vs new client, BRP 4 x QD8 (4 jobs, 4 connections, adaptive), one target, alternating
OLD=$1; NEW=$2; REPS=${3:-3}
P=$((20000 + RANDOM % 5000))
$OLD serve --brp 127.0.0.1:$P --no-nbd --volume vol0=memory:1G >/dev/null 2>&1 &
S=$!; sleep 1
f=$(mktemp /dev/shm/fill.XXXX); yes fastsan | head -c $((1<<30)) > $f; $OLD cp $f brp://127.0.0.1:$P/vol0 >/dev/null; rm -f $f
for r in $(seq $REPS); do
  for rw in randread randwrite; do
    order="old new"; [ $((r % 2)) = 0 ] && order="new old"
    for w in $order; do
      B=$OLD; [ $w = new ] && B=$NEW
      $B bench brp://127.0.0.1:$P/vol0 --rw=$rw --bs=4k --iodepth=8 --jobs=4 --runtime=4 --ramp=0.5 --merge=adaptive --connections=4 --json > /tmp/q.json 2>/dev/null
      python3 -c "import json;j=json.load(open('/tmp/q.json'));print('$rw','$w',round(j['iops']/1e3,1),'K req/frame',round(j['ios_total']/max(j['frames'],1),1) if 'ios_total' in j else round((j['reads']+j['writes'])/max(j['frames'],1),1))"
    done
  done
done
kill $S
