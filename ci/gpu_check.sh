#!/usr/bin/env bash
# fuzzshard on a machine with GPUs: install on the machine's own torch, fuzz
# every target on CUDA with NCCL (one rank per GPU: world sizes 1..min(GPUs, 4)),
# then replay every new finding in a fresh process and print one table:
# signature, session verdict, fresh verdict, same or not; then run each new
# finding's standalone script under torchrun (ci/run_scripts.py: straight-line
# or flattened, lines, exit code). Passes (exit 0) only when every new finding
# replays as itself.
#
#   ci/gpu_check.sh                      # 5 minutes of fuzzing, seed 1
#   DURATION=30m SEED=7 OUT=/scratch/gpu ci/gpu_check.sh
#   DEVICE=cpu ci/gpu_check.sh           # the same check on the CPU (gloo)
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#SBATCH/d;/^#/s/^# \{0,1\}//p;}' "$0"; exit 0 ;; esac  # the comment above
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/fuzzshard-gpu-check}
DURATION=${DURATION:-5m}
SEED=${SEED:-1}
DEVICE=${DEVICE:-cuda}
TARGETS=${TARGETS:-all}

# no package registry on a GPU node, often: keep the machine's torch and hypothesis
# (fuzzshard.strategies, not fuzzshard: from the repo root the bare package imports from the working
# tree without an install, and its strategies, installed from strategies/, are then missing)
$PY -c "import fuzzshard.strategies" 2>/dev/null || $PY -m pip install -q --no-build-isolation --no-deps -e . || exit 2
if [ "$DEVICE" = cuda ]; then
    GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
    [ "$GPUS" -ge 1 ] || { echo "gpu_check: no CUDA device here (DEVICE=cpu checks the CPU path)"; exit 2; }
    MAXW=$(( GPUS < 4 ? GPUS : 4 ))
else
    MAXW=${MAXW:-2}
fi
WORLDS=$(seq -s, 1 "$MAXW")
$PY -c "import torch, platform; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU', '|', platform.platform())"
rm -rf "$OUT"
$PY -m fuzzshard fuzz --target "$TARGETS" --device "$DEVICE" --world-sizes "$WORLDS" --duration "$DURATION" \
    --seed "$SEED" --out "$OUT" 2> "$OUT.log"
code=$?
grep -E "^\[fuzzshard\]" "$OUT.log" | tail -1
grep -E "^(FINDING|CONTAMINATED|known)" "$OUT.log" | cut -c1-160
echo "fuzz exit code: $code (0 nothing new, 1 new findings)"
[ "$code" -le 1 ] || { tail -30 "$OUT.log"; exit "$code"; }
$PY ci/replay_table.py "$OUT"
code=$?
$PY ci/run_scripts.py "$OUT"
exit "$code"
