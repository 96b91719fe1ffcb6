#!/usr/bin/env bash
# A soak on one or more nodes under torchrun. Run the same line on every node
# (c10d rendezvous: no node ranks to set; ENDPOINT is one of the nodes).
#
# Knobs (environment):
#   NNODES      nodes taking part                       (default 1)
#   NPROC       torchrun processes per node             (default 1)
#   WORKERS     ranks each process soaks with            (default: GPUs / NPROC on cuda, else 4)
#   ENDPOINT    host:port of the c10d rendezvous         (default 127.0.0.1:29400)
#   DURATION    how long, e.g. 90s, 30m, 8h              (default 1h)
#   OUT         the run's folder, on a filesystem every node sees (default ./soak-out)
#   TARGETS     target names or all                      (default all)
#   DEVICE      cpu or cuda                              (default: cuda if a GPU is visible)
#   RESTARTS    torchrun --max-restarts: a lost process comes back and resumes (default 3)
#   EXTRA       more fuzzshard soak flags, e.g. "--epoch 20m --world-sizes 1,2,4"
# The same command after an interruption resumes from OUT; `fuzzshard report $OUT` reads it.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/{/^#SBATCH/d;/^#/s/^# \{0,1\}//p;}' "$0"; exit 0 ;; esac  # the comment above
set -euo pipefail
NNODES=${NNODES:-1}
NPROC=${NPROC:-1}
ENDPOINT=${ENDPOINT:-127.0.0.1:29400}
DURATION=${DURATION:-1h}
OUT=${OUT:-./soak-out}
TARGETS=${TARGETS:-all}
RESTARTS=${RESTARTS:-3}
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
DEVICE=${DEVICE:-$([ "$GPUS" -gt 0 ] && echo cuda || echo cpu)}
if [ "$DEVICE" = cuda ]; then WORKERS=${WORKERS:-$((GPUS / NPROC))}; else WORKERS=${WORKERS:-4}; fi
exec python -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "$RESTARTS" \
    --rdzv-backend c10d --rdzv-endpoint "$ENDPOINT" --rdzv-id "fuzzshard-$(basename "$OUT")" \
    -m fuzzshard soak --duration "$DURATION" --out "$OUT" --target "$TARGETS" --workers "$WORKERS" \
    --device "$DEVICE" ${EXTRA:-}
