#!/bin/sh
# /init of the throw-away guest of tests/kernel_attach.rs: the kernel's NBD
# client on `fastsan attach`, against the host's target (reached at
# 10.0.2.100:10810 through qemu's user network). Prints @@PASS/@@FAIL lines
# for the host to check, @@RESTART when the host should restart the target,
# and @@END before powering off.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
ip link set lo up
URL=brp://10.0.2.100:10810/v
# The kernel's NBD tracepoints (each request handed to a socket, its header
# sent, each reply's header received) and the block layer's issues and
# requeues, kept in a ring buffer for the stall report: they tell a request
# the kernel never sent from one the bridge read and did not answer.
# (Turned on once nbd.ko is loaded: its events come with it.)
T=/sys/kernel/tracing
trace_on() {
  mount -t tracefs tracefs $T 2>/dev/null
  echo 8192 >$T/buffer_size_kb
  echo 1 >$T/events/nbd/enable
  echo 1 >$T/events/block/block_rq_issue/enable
  echo 1 >$T/events/block/block_rq_requeue/enable
}
say() { echo "@@$*"; }
# What the kernel and attach are doing, for a check that takes too long:
# the device's requests in flight (reads, writes) as the kernel counts them;
# the attach registry (its own count of requests in flight); the bytes
# queued unread in each end of the socket pairs (a request the bridge has
# not read, a reply the kernel has not); where each of attach's threads and
# the kernel's NBD workers are; and the stacks of the tasks blocked (sysrq w;
# a task waiting in submit_bio_wait, as a flush or discard does, is not
# reported by the hung-task check).
stalled() {
  secs=$1; shift
  echo "stall: '$*' is still running after $secs s"
  echo "stall: /sys/block/nbd0/inflight: $(cat /sys/block/nbd0/inflight 2>&1)"
  for f in /run/fastsan/attach/*.json; do echo "stall: $f: $(cat "$f" 2>&1)"; done
  ss -xpn 2>&1 | sed 's/^/stall: ss: /'
  for t in /proc/$pid/task/*; do
    echo "stall: attach thread $(basename "$t") $(cat "$t/comm") $(cut -d' ' -f3 "$t/stat")"
    sed 's/^/stall:   /' "$t/stack" 2>&1
  done
  # The kernel's own side: its workers for the device (a receiver per
  # queue, "kworker/...+nbd0-recv", each reading its socket's replies, or
  # the workqueue's rescuer "nbd0-recv" running one; a queue without one
  # reads no replies), where each is, and the block layer's requests in
  # flight per queue (busy: sent to the driver; dispatch: waiting for it).
  for p in /proc/[0-9]*; do
    case $(cat "$p/comm" 2>/dev/null) in
      *nbd0-recv*) echo "stall: kernel task $(basename "$p") $(cat "$p/comm") $(cut -d' ' -f3 "$p/stat")"
             sed 's/^/stall:   /' "$p/stack" 2>&1 ;;
    esac
  done
  [ -d /sys/kernel/debug/block ] || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null
  for f in /sys/kernel/debug/block/nbd0/hctx*/busy /sys/kernel/debug/block/nbd0/hctx*/dispatch \
           /sys/kernel/debug/block/nbd0/requeue_list; do
    sed "s|^|stall: $f: |" "$f" 2>/dev/null
  done
  echo w >/proc/sysrq-trigger
  # The last requests through the device, as the kernel traced them.
  tail -n 120 $T/trace 2>/dev/null | sed 's/^/stall: trace: /'
}
# Runs a check; one that takes more than 25 s (and again at 180 s) is
# reported with what it waits for: before the device's timeout (30 s)
# sends a stuck request again. (The watchdog leaves the working directory
# at once: it must not hold /mnt busy.)
check() {
  ( cd /; sleep 25; stalled 25 "$@"; sleep 155; stalled 180 "$@" ) &
  dog=$!
  if "$@" >/tmp/check.out 2>&1; then say "PASS $*"; else say "FAIL $*: $(tail -3 /tmp/check.out)"; fi
  kill $dog 2>/dev/null
}
fails_with() {
  want=$1; shift
  if "$@" >/tmp/check.out 2>&1; then say "FAIL $* succeeded"
  elif grep -q "$want" /tmp/check.out; then say "PASS $* fails with '$want'"
  else say "FAIL $*: $(cat /tmp/check.out)"; fi
}
# Starts `fastsan attach` in the background and waits for its device. The
# output files are emptied here, before the background job starts: its own
# redirection truncates them only once it runs, and until then the previous
# attach's "attached as" would pass for this one's (the mount that followed
# then opened an unconfigured /dev/nbd0 and failed).
attach() {
  : >/tmp/attach.out
  : >/tmp/attach.log
  fastsan attach "$URL" --reconnect-timeout 120 "$@" >/tmp/attach.out 2>/tmp/attach.log &
  pid=$!
  for i in $(seq 1 300); do
    grep -q "attached as" /tmp/attach.out && return 0
    kill -0 $pid 2>/dev/null || break
    sleep 0.1
  done
  say "FAIL attach $*: $(cat /tmp/attach.log)"
  return 1
}
# Detaches with `fastsan detach` and checks that attach ended well. What attach
# warned about goes to the console, which the host shows when a check fails.
detach() {
  check timeout 120 fastsan detach /dev/nbd0
  wait $pid
  rc=$?
  grep -E "WARN|ERROR|panicked" /tmp/attach.log | head -20 | sed 's/^/attach.log: /'
  if [ $rc = 0 ] && grep -q detached /tmp/attach.log; then say "PASS attach exited cleanly"
  else say "FAIL attach exited $rc: $(tail -5 /tmp/attach.log)"; fi
}
verify() { cd /mnt && check sha256sum -c /tmp/sums; cd /; }
fresh_mount() {
  umount /mnt 2>/dev/null
  echo 3 >/proc/sys/vm/drop_caches
  check mount /dev/nbd0 /mnt
}

for m in $(cat /lib/modules/order); do
  [ $m = nbd ] || insmod /lib/modules/$m.ko || say "FAIL insmod $m"
done
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0
# Before the driver is loaded: a clear error.
fails_with "no NBD driver" timeout 60 fastsan attach "$URL"
insmod /lib/modules/nbd.ko || say "FAIL insmod nbd"
trace_on || echo "no kernel tracing: the stall report will lack the trace"

# 1. attach, ext4, 64 MiB, remount, verify, fsck clean, detach.
if attach --device /dev/nbd0 --queues 2; then
  say "PASS attached"
  check mkfs.ext4 -q -F /dev/nbd0
  check mount /dev/nbd0 /mnt
  check dd if=/dev/urandom of=/mnt/a bs=1M count=64
  (cd /mnt && sha256sum a >/tmp/sums)
  check sync
  timeout 30 fastsan attach --list >/tmp/list 2>&1
  if grep -q "/dev/nbd0 .*nbd .*attached .*$URL" /tmp/list; then say "PASS attach --list"; else say "FAIL attach --list: $(cat /tmp/list)"; fi
  fails_with "busy" timeout 60 fastsan attach "$URL" --device /dev/nbd0
  fails_with "in use" timeout 60 fastsan detach /dev/nbd0
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn /dev/nbd0
  detach
  fails_with "is not attached" timeout 60 fastsan detach /dev/nbd0
fi

# 2. Again, with the target restarted by the host during 64 MiB of direct writes.
if attach --device /dev/nbd0; then
  check mount /dev/nbd0 /mnt
  verify
  say "RESTART"
  check dd if=/dev/urandom of=/mnt/b bs=1M count=64 oflag=direct
  (cd /mnt && sha256sum a b >/tmp/sums)
  check sync
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn /dev/nbd0
  if grep -q "connection re-established" /tmp/attach.log; then say "PASS reconnected"; else say "FAIL no reconnect: $(tail -5 /tmp/attach.log)"; fi
  detach
fi

# 3. The ioctl interface, and the first free device chosen by the kernel.
if attach --interface ioctl; then
  dev=$(sed -n 's/.*attached as //p' /tmp/attach.out)
  check mount "$dev" /mnt
  verify
  check umount /mnt
  kill -TERM $pid
  wait $pid && say "PASS SIGTERM detaches ($dev)" || say "FAIL SIGTERM: $(tail -5 /tmp/attach.log)"
fi
# 4. A device timeout (3 s) shorter than the target's absence (the host stops
# it for 10 s during direct writes): the kernel gives up on the queues'
# sockets, sends their requests again on another or waits for a new one;
# attach gives it new sockets at once, and nothing is lost.
if attach --device /dev/nbd0 --device-timeout 3; then
  check mount /dev/nbd0 /mnt
  verify
  say "STOP"
  check dd if=/dev/urandom of=/mnt/c bs=1M count=16 oflag=direct
  (cd /mnt && sha256sum a b c >/tmp/sums)
  check sync
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn /dev/nbd0
  if grep -q "gave the kernel a new socket" /tmp/attach.log; then say "PASS queues renewed"
  else say "FAIL no new socket: $(tail -5 /tmp/attach.log)"; fi
  detach
fi
# 5. An attach killed with SIGKILL leaves its device configured, its sockets
# dead: detach says the kernel's cached data cannot be written and how to
# let go anyway; --force disconnects it (nothing else but nbd-client -d
# could, before), and the device is free for the next attach.
if attach --device /dev/nbd0; then
  kill -KILL $pid
  wait $pid 2>/dev/null
  fails_with "detach --force" timeout 90 fastsan detach /dev/nbd0
  check timeout 90 fastsan detach --force /dev/nbd0
  if [ -e /sys/block/nbd0/pid ]; then say "FAIL still attached after detach --force"
  else say "PASS detach --force frees a killed attach's device"; fi
fi
# 6. A memory volume whose target the host restarts (@@REPLACE) with data
# written and not flushed: the volume is another now, nothing can be made
# durable, and detach disconnects with that error (it stayed attached,
# refusing every detach, before).
URL=brp://10.0.2.100:10810/m
if attach --device /dev/nbd0; then
  check dd if=/dev/urandom of=/dev/nbd0 bs=1M count=4
  say "REPLACE"
  sleep 5
  fails_with "writes may be lost" timeout 90 fastsan detach /dev/nbd0
  if [ -e /sys/block/nbd0/pid ]; then say "FAIL still attached after its volume was replaced"
  else say "PASS a replaced volume's device is detached"; fi
  if wait $pid; then say "FAIL attach exited 0 after losing writes"; else say "PASS attach reports the loss"; fi
fi
# The tracing the stall report relies on worked (requests in the ring buffer).
echo "trace: $(grep -c nbd_header_sent $T/trace 2>/dev/null) NBD headers sent in the ring buffer"
say "END"
poweroff -f
