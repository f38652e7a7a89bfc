#!/usr/bin/env bash
# Runs every fuzz target (the BRP and NBD codecs, the target's and the
# initiator's handshakes) for SECONDS each (default 60).
#   fuzz/run.sh [SECONDS]
# Needs cargo-fuzz (installed here when missing). cargo-fuzz wants a nightly
# compiler; RUSTC_BOOTSTRAP=1 lets the stable one build the instrumented code.
# New inputs go to fuzz/target/corpus/ (not committed); fuzz/corpus/ holds the
# committed seeds, which the test suite replays on every run.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
for t in request reply batch handshake nbd_request nbd_option target_brp_handshake target_nbd_handshake \
         initiator_handshake nvme_pdu target_nvme; do
  mkdir -p "target/corpus/$t"
  echo "== fuzzing $t for ${secs}s"
  cargo fuzz run "$t" "target/corpus/$t" "corpus/$t" -- -max_total_time="$secs" -print_final_stats=1 2>&1 \
    | grep -E '^(stat::number_of_executed_units|stat::new_units_added|==|SUMMARY|Done)' || true
  # A crash leaves an artifact and a non-zero exit above; say so plainly.
  if ls "artifacts/$t"/crash-* >/dev/null 2>&1; then echo "CRASH in $t: see fuzz/artifacts/$t"; exit 1; fi
done
echo "all fuzz targets ran ${secs}s without a crash"
