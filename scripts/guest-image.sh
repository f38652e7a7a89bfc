#!/usr/bin/env bash
# Builds a throw-away guest for the kernel-client tests: Debian's kernel (from
# the package linux-image-amd64, fetched once into a cache) and an initramfs
# holding busybox, the given programs with their libraries, the kernel
# modules the tests need, and the given init script.
#   [GUEST_MODULES="MODULE..."] scripts/guest-image.sh OUT_DIR INIT_SCRIPT PROGRAM...
# Every guest has the modules nbd, e1000, ext4 and crc32c_generic (and what
# they depend on); GUEST_MODULES adds more (with their dependencies), all
# listed in load order in the initramfs's /lib/modules/order.
# Writes OUT_DIR/vmlinuz and OUT_DIR/initrd.gz. The cache is
# ${FASTSAN_GUEST_CACHE:-/var/tmp/fastsan-guest}; nothing is written into the
# source tree.
set -euo pipefail
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

out=$1 init=$2
shift 2
cache=${FASTSAN_GUEST_CACHE:-/var/tmp/fastsan-guest}
mkdir -p "$cache" "$out"

# The kernel, once per machine (several tests may ask at the same time).
exec 9>"$cache/.lock"
flock 9
if [ ! -e "$cache/ready" ]; then
  tmp=$(mktemp -d "$cache/fetch.XXXXXX")
  (
    cd "$tmp"
    # apt-get download drops privileges to _apt, which cannot write here.
    chmod 777 .
    apt-get download linux-image-amd64 >/dev/null 2>&1 || {
      apt-get update -qq && apt-get download linux-image-amd64 >/dev/null
    }
    pkg=$(dpkg-deb -f linux-image-amd64_*.deb Depends | sed 's/ (.*//; s/,.*//; s/ |.*//')
    apt-get download "$pkg" >/dev/null
    dpkg-deb -x "$pkg"_*.deb root
  )
  rm -rf "$cache/root"
  mv "$tmp/root" "$cache/root"
  rm -rf "$tmp"
  touch "$cache/ready"
fi
flock -u 9
kver=$(ls "$cache/root/lib/modules" | head -1)
moddir="$cache/root/lib/modules/$kver/kernel"
cp "$cache/root/boot/vmlinuz-$kver" "$out/vmlinuz"

# The initramfs.
root=$(mktemp -d "$out/initramfs.XXXXXX")
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,run,mnt,lib/modules,etc}
cp "$(command -v busybox)" "$root/bin/busybox"
for applet in $("$root/bin/busybox" --list); do
  [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
done
copy_with_libs() {
  # Not through a busybox applet's link, which would overwrite busybox.
  rm -f "$root/bin/$(basename "$1")"
  cp "$1" "$root/bin/"
  ldd "$1" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
}
for prog in "$@" mkfs.ext4 e2fsck; do
  copy_with_libs "$(command -v "$prog" || echo "$prog")"
done
# Debug symbols only make the image slower to build and boot.
for prog in "$@"; do
  strip --strip-debug "$root/bin/$(basename "$prog")" 2>/dev/null || true
done

# Modules in load order: each one's dependencies first (read from the module),
# written to lib/modules/order by file name (for insmod /lib/modules/NAME.ko).
# A name may be spelt with '-' or '_' (the kernel takes them as one: the file
# nvme-tcp.ko, a depends= naming nvme_tcp); compressed modules (.ko.xz,
# .ko.zst, .ko.gz, as newer Debian kernels ship them) go in uncompressed, for
# busybox's insmod.
seen=() loaded=()
add_module() {
  local key pat path file dep
  key=$(printf %s "$1" | tr - _)
  case " ${seen[*]-} " in *" $key "*) return ;; esac
  pat=$(printf %s "$1" | sed 's/[-_]/[-_]/g')
  path=$(find "$moddir" \( -name "$pat.ko" -o -name "$pat.ko.xz" -o -name "$pat.ko.zst" -o -name "$pat.ko.gz" \) | head -1)
  [ -n "$path" ] || { echo "guest-image: no module $1 in $kver" >&2; exit 1; }
  file=$(basename "$path")
  file=${file%%.ko*}
  case $path in
    *.xz) xz -dc "$path" ;;
    *.zst) zstd -qdc "$path" ;;
    *.gz) gzip -dc "$path" ;;
    *) cat "$path" ;;
  esac >"$root/lib/modules/$file.ko"
  for dep in $(strings "$root/lib/modules/$file.ko" | sed -n 's/^depends=//p' | tr ',' ' '); do
    add_module "$dep"
  done
  # Dependencies are acyclic, so nothing below added this one meanwhile.
  seen+=("$key")
  loaded+=("$file")
}
# The modules every guest has, then the caller's: GUEST_MODULES="nvme-tcp ...".
for m in nbd e1000 ext4 crc32c_generic ${GUEST_MODULES-}; do add_module "$m"; done
printf '%s\n' "${loaded[@]}" >"$root/lib/modules/order"

cp "$init" "$root/init"
chmod +x "$root/init"
cpio=(busybox cpio)
command -v cpio >/dev/null && cpio=(cpio --quiet)
(cd "$root" && find . | "${cpio[@]}" -o -H newc) | gzip -1 >"$out/initrd.gz"
rm -rf "$root"
