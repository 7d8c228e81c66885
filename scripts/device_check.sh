#!/usr/bin/env bash
# Every part of eagle3_jax/device_check.py on the accelerator, each in its own process with a time limit,
# its results in OUT_DIR/PART.json and everything printed in OUT_DIR/log.txt.  Runs from the
# source tree (no install): the package layout pyproject.toml declares is assembled under /tmp.
# DEVICE_CHECK_SMOKE=1: the tiny CPU versions (see eagle3_jax/device_check.py).
#   scripts/device_check.sh OUT_DIR [PART ...]     (default: every part, at most ~10.5 minutes:
#   longer than one device call may run (10 minutes), so on a lent machine make two: "kernels bench llama8b",
#   then "builtin step")
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR [PART ...]}
shift
parts=("${@:-kernels bench llama8b builtin step}")
read -r -a parts <<< "${parts[*]}"
# seconds per part; a part cut short keeps what it printed in log.txt.  On the H200 (first run):
# kernels ~2 s a case, bench ~7 s a row, llama8b ~160 s, builtin and step >100 s / >30 s (compiles)
declare -A limit=([kernels]=90 [bench]=110 [llama8b]=170 [builtin]=200 [step]=50)
root=$(cd "$(dirname "$0")/.." && pwd)
src=$(mktemp -d)
cp -r "$root/eagle3_jax" "$src/"
for sub in train serve pallas_kernels; do cp -r "$root/$sub" "$src/eagle3_jax/$sub"; done
export PYTHONPATH="$src" PYTHONUNBUFFERED=1
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$src"  # python -m puts the working directory first on sys.path: not the unassembled tree
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null
  for part in "${parts[@]}"; do
    echo "=== $part (limit ${limit[$part]:-120} s)"
    timeout -s INT -k 10 "${limit[$part]:-120}" python3 -m eagle3_jax.device_check "$part" --out "$out" \
      ${DEVICE_CHECK_SMOKE:+--smoke}
    echo "=== $part: exit $?"
  done
  date -u
} 2>&1 | tee "$out/log.txt"
