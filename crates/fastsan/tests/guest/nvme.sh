#!/bin/sh
# /init of the throw-away guest of tests/kernel_nvme.rs: the kernel's NVMe/TCP
# host (nvme-tcp, driven by nvme-cli) against the host's target, reached at
# 10.0.2.100:4420 through qemu's user network. The kernel command line names
# the subsystem (fastsan.nqn=NQN) and the size of its namespace 1
# (fastsan.bytes=N). Prints @@PASS/@@FAIL lines for the host to check,
# @@RESTART when the host should kill the target and start it again, @@LOG
# lines (the kernel's account of the restart) and @@END before powering off.
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mount -t tmpfs tmp /tmp
mount -t tmpfs run /run
ip link set lo up
say() { echo "@@$*"; }
# On failure: the command's last words and the kernel's (nvme-tcp reports there).
check() {
  if "$@" >/tmp/check.out 2>&1; then say "PASS $*"; return 0; fi
  say "FAIL $*: $(tail -3 /tmp/check.out | tr '\n' ' ') | dmesg: $(dmesg | tail -3 | tr '\n' ' ')"
  return 1
}
for w in $(cat /proc/cmdline); do
  case $w in
    fastsan.nqn=*) NQN=${w#*=} ;;
    fastsan.bytes=*) BYTES=${w#*=} ;;
  esac
done

for m in $(cat /lib/modules/order); do
  insmod /lib/modules/$m.ko || say "FAIL insmod $m"
done
if [ -c /dev/nvme-fabrics ]; then say "PASS modules loaded: $(cut -d' ' -f1 /proc/modules | grep nvme | tr '\n' ' ')"
else say "FAIL no /dev/nvme-fabrics after loading $(cat /lib/modules/order | tr '\n' ' ')"; fi
ip link set eth0 up
ip addr add 10.0.2.15/24 dev eth0

# A host identity of our own: nvme-cli would derive one from the SMBIOS UUID,
# which is all zeros in qemu.
HOSTID=$(cat /proc/sys/kernel/random/uuid)
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:$HOSTID
mkdir -p /etc/nvme
echo "$HOSTNQN" >/etc/nvme/hostnqn
echo "$HOSTID" >/etc/nvme/hostid
FABRIC="-t tcp -a 10.0.2.100 -s 4420 --hostnqn $HOSTNQN --hostid $HOSTID"
DEV=

# Connects to NQN (LABEL, then more options) and waits, bounded, for its
# namespace 1. The host gives a lost controller LOSS_TMO seconds to come back.
LOSS_TMO=30
connect() {
  label=$1
  shift
  # shellcheck disable=SC2086
  check timeout 120 nvme connect $FABRIC -n "$NQN" --nr-io-queues 2 --ctrl-loss-tmo $LOSS_TMO "$@" || return 1
  for i in $(seq 1 300); do
    for d in /dev/nvme*n1; do
      case $d in */nvme*c*n1 | '/dev/nvme*n1') ;; *) [ -b "$d" ] && DEV=$d ;; esac
    done
    [ -n "$DEV" ] && break
    sleep 0.1
  done
  if [ -z "$DEV" ]; then
    say "FAIL no /dev/nvme*n1 30 s after connecting $label: $(dmesg | tail -5 | tr '\n' ' ')"
    return 1
  fi
  ctrl=$(ls /sys/class/nvme | head -1)
  say "PASS connected $label as $DEV ($ctrl)"
  size=$(blockdev --getsize64 "$DEV")
  if [ "$size" = "$BYTES" ]; then say "PASS namespace 1 has $BYTES bytes"
  else say "FAIL namespace 1 has $size bytes, not $BYTES"; fi
  # The admin queue and the 2 I/O queues: 3 connections through the forward.
  queues=$(cat /sys/class/nvme/"$ctrl"/queue_count 2>/dev/null)
  if [ "$queues" = 3 ]; then say "PASS 2 I/O queues"
  else say "FAIL queue_count $queues (wanted the admin queue and 2 I/O queues)"; fi
  return 0
}
# Disconnects and waits, bounded, for the device and the controller to go.
disconnect() {
  check timeout 60 nvme disconnect -n "$NQN"
  for i in $(seq 1 300); do
    [ -e "$DEV" ] || [ -n "$(ls /sys/class/nvme)" ] || break
    sleep 0.1
  done
  if [ -e "$DEV" ] || [ -n "$(ls /sys/class/nvme)" ]; then say "FAIL $DEV still there 30 s after disconnect"
  else say "PASS $DEV gone after disconnect"; fi
  DEV=
}
fill() {
  for f in "$@"; do check dd if=/dev/urandom of=/mnt/"$f" bs=1M count=16; done
}
verify() { cd /mnt && check sha256sum -c /tmp/sums; cd /; }
# Unmounts, drops every cached page, and mounts again: what follows reads the target.
fresh_mount() {
  check umount /mnt
  echo 3 >/proc/sys/vm/drop_caches
  check mount "$DEV" /mnt
}

# The discovery controller (on the same port) lists the subsystem.
# shellcheck disable=SC2086
timeout 120 nvme discover $FABRIC >/tmp/discover 2>&1
if awk -v nqn="$NQN" '$1 == "subnqn:" && $2 == nqn { found = 1 } END { exit !found }' /tmp/discover; then
  say "PASS nvme discover lists $NQN"
else
  say "FAIL nvme discover: $(tr '\n' ' ' </tmp/discover) | dmesg: $(dmesg | tail -3 | tr '\n' ' ')"
fi
[ -z "$(ls /sys/class/nvme)" ] || say "FAIL the discovery controller stays: $(ls /sys/class/nvme)"

# 1. Connect, ext4, 64 MiB in 4 files, remount, verify, fsck clean, disconnect.
if connect "without digests"; then
  check mkfs.ext4 -q -F "$DEV"
  check mount "$DEV" /mnt
  fill a b c d
  (cd /mnt && sha256sum a b c d >/tmp/sums)
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn "$DEV"
  disconnect
fi

# 2. Again with header and data digests (the kernel refuses a connection
# whose ICResp does not turn on both): the data is still there, and more.
if connect "with digests" --hdr-digest --data-digest; then
  check mount "$DEV" /mnt
  verify
  fill e f
  (cd /mnt && sha256sum a b c d e f >/tmp/sums)
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn "$DEV"
  disconnect
fi
# Nothing went wrong on the way that the kernel noticed (a refused command,
# a timeout, a reset, a digest error), even where the tools carried on.
dmesg | grep -iE 'nvme|ext4|blk_|dev nvme' | grep -iE 'error|fail|timeout|reset|invalid|digest' >/tmp/kerr
if [ -s /tmp/kerr ]; then say "FAIL the kernel reported: $(tail -5 /tmp/kerr | tr '\n' ' ')"
else say "PASS nothing amiss in the kernel log"; fi

# 3. The target goes away (SIGKILL) during writes and comes back 5 s later on
# the same port with the same volume: the host keeps retrying (a reconnect
# every second, for up to 120 s), reconnects to what it takes for the same
# controller's namespace, and sends again what was in flight. Nothing
# acknowledged is lost, nothing read back is wrong. The writer: 4 files of
# 12 MiB of known content, two with direct writes, two through the page
# cache and fsync.
dmesg | wc -l >/tmp/klines
LOSS_TMO=120
for n in 1 2 3 4; do dd if=/dev/urandom of=/tmp/w$n bs=1M count=12 2>/dev/null; done
(cd /tmp && sha256sum w1 w2 w3 w4 >/tmp/wsums)
if connect "for the restart" --reconnect-delay 1; then
  check mount "$DEV" /mnt
  verify
  ctrl=$(ls /sys/class/nvme | head -1)
  # Sectors (512 bytes) per logical block, to match a logged LBA with a sector.
  per_lba=$(($(cat /sys/block/"${DEV#/dev/}"/queue/logical_block_size) / 512))
  timeout 150 sh -c '
    dd if=/tmp/w1 of=/mnt/w1 bs=1M oflag=direct &&
    dd if=/tmp/w2 of=/mnt/w2 bs=256k oflag=direct &&
    dd if=/tmp/w3 of=/mnt/w3 bs=1M conv=fsync &&
    dd if=/tmp/w4 of=/mnt/w4 bs=64k conv=fsync' >/tmp/writer.out 2>&1 &
  writer=$!
  # Seconds since boot, as the kernel log counts them.
  start=$(cut -d' ' -f1 /proc/uptime)
  say "RESTART"
  wait $writer
  rc=$?
  end=$(cut -d' ' -f1 /proc/uptime)
  took=$(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.1f", b - a }')
  if [ $rc = 0 ]; then say "PASS the writer finished across the restart in $took s"
  else say "FAIL the writer exited $rc after $took s: $(tail -3 /tmp/writer.out | tr '\n' ' ') | dmesg: $(dmesg | tail -5 | tr '\n' ' ')"; fi
  # The whole outage, from the connection lost to the reconnect, came while
  # the writer ran (and the kernel held back I/O for want of a path).
  dmesg >/tmp/kall
  lost=$(grep 'nvme.*starting error recovery' /tmp/kall | tail -1 | sed 's/^\[ *\([0-9.]*\)\].*/\1/')
  back=$(grep 'nvme.*Successfully reconnected' /tmp/kall | tail -1 | sed 's/^\[ *\([0-9.]*\)\].*/\1/')
  if [ -n "$lost" ] && [ -n "$back" ] && grep -q 'requeuing I/O' /tmp/kall &&
    awk -v s="$start" -v l="$lost" -v b="$back" -v e="$end" 'BEGIN { exit !(s < l && l < b && b < e) }'; then
    say "PASS the outage came during the writes (writer $start..$end s, lost at $lost, back at $back)"
  else say "FAIL the outage missed the writes: writer $start..$end s, lost at ${lost:-?}, back at ${back:-?}"; fi
  state=$(cat /sys/class/nvme/"$ctrl"/state)
  queues=$(cat /sys/class/nvme/"$ctrl"/queue_count)
  if [ "$state" = live ] && [ "$queues" = 3 ]; then say "PASS $ctrl live again with 2 I/O queues"
  else say "FAIL $ctrl is $state with queue_count $queues after the restart"; fi
  check sync
  cat /tmp/wsums >>/tmp/sums
  verify
  fresh_mount
  verify
  check umount /mnt
  check e2fsck -fn "$DEV"
  # (What the kernel says from here on is about the disconnect.)
  dmesg | tail -n +$(($(cat /tmp/klines) + 1)) >/tmp/k3
  disconnect
fi
# The kernel's account of it: the connection lost, failed attempts while the
# target was away, then a reconnect; no I/O error, no namespace changed or
# removed, nothing from ext4.
[ -e /tmp/k3 ] || dmesg | tail -n +$(($(cat /tmp/klines) + 1)) >/tmp/k3
# (While the target is away, each attempt meets the text of the forward's
# `nc` that cannot connect instead of an ICResp: "bad type returned 110".)
grep -iE 'nvme' /tmp/k3 | tail -25 | while read -r line; do say "LOG $line"; done
if grep -qE 'nvme[0-9]+: Successfully reconnected' /tmp/k3; then say "PASS the kernel reconnected: $(grep -E 'Successfully reconnected' /tmp/k3 | tail -1)"
else say "FAIL the kernel logged no reconnect"; fi
# Two things the kernel logs when a target is lost under I/O are not
# errors that reach anyone, and are told, not failed, when they fall in the
# outage (between the connection lost and the reconnect):
# - a readahead in flight: the host aborts it ("I/O Cmd(0x2) @ LBA n ...
#   (sct 0x3 / sc 0x71)", aborted by the host) and, as readahead is failfast
#   (REQ_RAHEAD, bit 19 of the request's flags), completes it in error
#   instead of requeuing it ("I/O error, dev D, sector s op 0x0:(READ) flags
#   F"); whoever then wants those blocks reads them again (ext4's metadata
#   readahead met this, under load, 2026-11-27). Only the two lines of one
#   such request together (same disk, LBA and sector) are told;
# - the admin queue's keep-alive in flight, if the host's teardown (which
#   would cancel it) takes longer than the keep-alive timeout (5 s): Debian's
#   6.1 kernel under TCG, on a loaded host, took 5 s to tear its I/O queues
#   down (the keep-alive's timeout came 1 s after).
# Any other error, these outside the outage, or errors the kernel stopped
# logging ("callbacks suppressed": one could hide among them) fail.
grep -iE 'I/O error|blk_update|critical|identifiers changed|removing|EXT4-fs (error|warning)|Buffer I/O|digest|invalid|aborted|timeout|lost|callbacks suppressed' /tmp/k3 |
  awk -v l="${lost:-}" -v b="${back:-}" -v per="${per_lba:-1}" '
    function bit(x, n) { x = x + 0; while (n-- > 0) x = int(x / 2); return x % 2 }
    function outage(line,  t) {
      if (l == "" || b == "") return 0
      t = line; sub(/^\[ */, "", t); sub(/\].*/, "", t); return t + 0 > l + 0 && t + 0 < b + 0
    }
    function after(line, word) { return substr(line, index(line, word) + length(word)) }
    /I\/O Cmd\(0x2\) @ LBA [0-9]+, .*\(sct 0x3 \/ sc 0x71\)/ && outage($0) {
      t = $0; sub(/^\[[^]]*\] */, "", t)
      abort[substr(t, 1, index(t, ":") - 1) ":" (after(t, "@ LBA ") + 0) * per] = $0; next
    }
    /I\/O error, dev [^,]+, sector [0-9]+ op 0x0:\(READ\) flags 0x/ && outage($0) && bit(after($0, "flags "), 19) {
      t = after($0, "dev "); ahead[substr(t, 1, index(t, ",") - 1) ":" (after($0, "sector ") + 0)] = $0; next
    }
    /nvme[0-9]+: queue 0: timeout/ && outage($0) { print > "/tmp/kbenign"; next }
    { print }
    END {
      for (k in abort) if (k in ahead) { print abort[k] > "/tmp/kbenign"; print ahead[k] > "/tmp/kbenign" } else print abort[k]
      for (k in ahead) if (!(k in abort)) print ahead[k]
    }' >/tmp/kerr || echo "the check of the log itself failed (awk)" >>/tmp/kerr
if [ -s /tmp/kerr ]; then say "FAIL the kernel reported around the restart: $(tail -5 /tmp/kerr | tr '\n' ' ')"
elif [ -s /tmp/kbenign ]; then say "PASS no I/O error around the restart (in the outage, a readahead or keep-alive in flight failed: $(tr '\n' ' ' </tmp/kbenign))"
else say "PASS no I/O error around the restart"; fi
say "END"
poweroff -f
