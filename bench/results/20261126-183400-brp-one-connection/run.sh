#!/bin/bash
B=$1; P=$((20000 + RANDOM % 5000)); N=$((P+1))
$B serve --brp 127.0.0.1:$P --nbd 127.0.0.1:$N --volume vol0=memory:1G >/dev/null 2>&1 &
S=$!; sleep 1
f=$(mktemp /dev/shm/fill.XXXX); yes fastsan | head -c $((1<<30)) > $f; $B cp $f brp://127.0.0.1:$P/vol0 >/dev/null; rm -f $f
for r in 1 2; do
 for u in "brp://127.0.0.1:$P/vol0 --merge=adaptive --connections=1" "brp://127.0.0.1:$P/vol0 --merge=always --connections=1" "nbd://127.0.0.1:$N/vol0"; do
  $B bench $u --rw=randwrite --bs=4k --iodepth=32 --jobs=1 --runtime=3 --json > /tmp/q.json 2>/dev/null
  python3 -c "import json;j=json.load(open('/tmp/q.json'));print('${u:0:3} ${u##*--merge=}',round(j['iops']/1e3,1),'K frames',j.get('frames'),'batched',j.get('batched_requests'),'cli',round(j['client_cpu_us_per_io'],2), 'p50', j['lat_p50_us'])"
 done
done
kill $S
