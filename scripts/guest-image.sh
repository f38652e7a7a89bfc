#!/usr/bin/env bash
# Builds a throw-away guest for the kernel-client tests: Debian's kernel (from
# the package linux-image-amd64, fetched once into a cache) and an initramfs
# holding busybox, the given programs with their libraries, the kernel
# modules the tests need, and the given init script.
#   scripts/guest-image.sh OUT_DIR INIT_SCRIPT PROGRAM...
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

# Modules in load order: each one's dependencies first (read from the module).
loaded=()
add_module() {
  local path dep
  path=$(find "$moddir" -name "$1.ko" | head -1)
  [ -n "$path" ] || { echo "guest-image: no module $1 in $kver" >&2; exit 1; }
  for dep in $(strings "$path" | sed -n 's/^depends=//p' | tr ',' ' '); do
    add_module "$dep"
  done
  case " ${loaded[*]-} " in *" $1 "*) return ;; esac
  cp "$path" "$root/lib/modules/"
  loaded+=("$1")
}
for m in nbd e1000 ext4 crc32c_generic; do add_module "$m"; done
printf '%s\n' "${loaded[@]}" >"$root/lib/modules/order"

cp "$init" "$root/init"
chmod +x "$root/init"
cpio=(busybox cpio)
command -v cpio >/dev/null && cpio=(cpio --quiet)
(cd "$root" && find . | "${cpio[@]}" -o -H newc) | gzip -1 >"$out/initrd.gz"
rm -rf "$root"
