#!/usr/bin/env bash
# Elastic examples/train_gpt.py under torchrun: run this on every node (1 to 2 of them by default), each with
# RDZV_ENDPOINT set to the same host:port (one of the nodes). A failed or hung worker stops the group; torchrun
# restarts it up to MAX_RESTARTS times with the nodes still there, and each start re-plans for its WORLD_SIZE and
# resumes from the newest complete checkpoint in CKPT (on storage every node sees). Arguments are passed on to
# train_gpt.py (--steps 1000, --model gpt-small, ...). See docs/elastic.md.
set -euo pipefail

NNODES="${NNODES:-1:2}"                            # MIN:MAX nodes, or one number
NPROC="${NPROC:-4}"                                # worker processes per node (GPUs per node on GPU nodes)
MAX_RESTARTS="${MAX_RESTARTS:-3}"                  # restarts of the whole group before torchrun gives up
RDZV_ENDPOINT="${RDZV_ENDPOINT:-localhost:29400}"  # host:port of the c10d rendezvous, the same on every node
RDZV_ID="${RDZV_ID:-hyparallel-gpt}"               # the job's name in the rendezvous, the same on every node
CKPT="${CKPT:-ckpt}"                               # checkpoint directory (relative paths: to the repository root)
CKPT_EVERY="${CKPT_EVERY:-100}"                    # steps between checkpoints

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID" \
    examples/train_gpt.py --checkpoint-dir "$CKPT" --checkpoint-every "$CKPT_EVERY" "$@"
