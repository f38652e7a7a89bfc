#!/bin/sh
# /init of the throw-away guest of tests/kernel_nvme.rs: the kernel's NVMe/TCP
# host (nvme-tcp, driven by nvme-cli) against the host's target, reached at
# 10.0.2.100:4420 through qemu's user network. The kernel command line names
# the subsystem (fastsan.nqn=NQN) and the size of its namespace 1
# (fastsan.bytes=N). Prints @@PASS/@@FAIL lines for the host to check, and
# @@END before powering off.
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

# Connects to NQN (LABEL, then more options) and waits, bounded, for its namespace 1.
connect() {
  label=$1
  shift
  # shellcheck disable=SC2086
  check timeout 120 nvme connect $FABRIC -n "$NQN" --nr-io-queues 2 --ctrl-loss-tmo 30 "$@" || return 1
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
say "END"
poweroff -f
