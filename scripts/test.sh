#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what it needs when
# missing, then checks formatting, lints, and runs every test of the workspace
# (unit, property, fuzz-corpus replay, end-to-end over 127.0.0.1, CLI) and the
# benchmark report's Python tests.
#   scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# Tools like losetup and mkfs.ext4 live in sbin, which a CI shell may not have on PATH.
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

say() { printf '\n== %s\n' "$*"; }

if ! command -v cargo >/dev/null; then
  echo "cargo is missing: install Rust (https://rustup.rs) first" >&2
  exit 1
fi

# Debian packages the tests use: the real NBD clients for the interop tests
# (qemu-img, qemu-io, nbdinfo, nbdcopy, nbdfuse, fio), the reference nbd-server
# as a mirror leg, and certtool for their TLS certificates, and what the nbdfuse
# test stacks on top (loop device, ext4, fusermount3), and kill for signals;
# qemu-system-x86 and busybox-static boot the throw-away guest whose kernel
# runs the kernel-client tests (scripts/guest-image.sh fetches the kernel),
# with nvme-cli copied into it for the kernel's NVMe/TCP host, and ss (iproute2)
# for what a guest check that stalls reports.
# Two passes: installing one package can remove another (qemu-system-x86
# from Debian removes a newer qemu-utils from backports, and with it
# qemu-img); the second pass installs what the first one took away.
missing_apt() {
  need_apt=()
  for tool in kill:procps qemu-img:qemu-utils qemu-io:qemu-utils nbdinfo:libnbd-bin nbdcopy:libnbd-bin \
              nbdfuse:libnbd-bin fio:fio fusermount3:fuse3 mkfs.ext4:e2fsprogs fsck.ext4:e2fsprogs mkfs.xfs:xfsprogs \
              losetup:mount mount:mount unshare:util-linux qemu-system-x86_64:qemu-system-x86 \
              busybox:busybox-static certtool:gnutls-bin tmux:tmux nvme:nvme-cli ss:iproute2 nbd-server:nbd-server; do
    command -v "${tool%%:*}" >/dev/null || need_apt+=("${tool##*:}")
  done
  mapfile -t need_apt < <(printf '%s\n' "${need_apt[@]}" | sort -u | grep -v '^$' || true)
}
for pass in 1 2; do
  missing_apt
  [ ${#need_apt[@]} -eq 0 ] && break
  say "installing ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if [ "$pass" = 1 ]; then apt-get update -qq; fi
  apt-get install -y -qq "${need_apt[@]}"
done
missing_apt
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "still missing after installing: ${need_apt[*]}" >&2
  exit 1
fi
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt || true

say "formatting"
cargo fmt --all -- --check

say "lints"
cargo clippy --workspace --all-targets --quiet -- -D warnings

say "docs"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --lib --quiet

# No test may write into the source tree: compare the tree before and after.
tree_state() { git status --porcelain --untracked-files=all 2>/dev/null || true; }
before=$(tree_state)

say "tests"
if command -v cargo-nextest >/dev/null; then
  cargo nextest run --workspace --no-fail-fast
  cargo test --workspace --doc --quiet
else
  cargo test --workspace --no-fail-fast
fi

say "benchmark report (bench/*.py)"
PYTHONDONTWRITEBYTECODE=1 python3 -m unittest discover -s bench -p 'test_*.py'

after=$(tree_state)
if [ "$before" != "$after" ]; then
  echo "the tests changed the source tree:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
