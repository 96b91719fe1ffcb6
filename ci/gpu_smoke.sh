#!/usr/bin/env bash
# Prove the CUDA path on a machine with one GPU: NCCL at world size 1, and
# multi-rank CUDA tensors over gloo (NCCL refuses two ranks on one device).
# On a multi-GPU node, drop --backend gloo and widen --world-sizes.
set -euo pipefail
OUT=${OUT:-/tmp/fuzzshard-gpu}
fuzzshard fuzz --target dtensor --device cuda --world-sizes 1 --max-examples ${N:-40} --seed 1 --out "$OUT/nccl"
fuzzshard fuzz --target dtensor --device cuda --backend gloo --world-sizes 1,2 --max-examples ${N:-40} --seed 1 --out "$OUT/gloo"
