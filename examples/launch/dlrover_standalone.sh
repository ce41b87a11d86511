#!/usr/bin/env bash
# Elastic examples/train_gpt.py on one machine under DLRover's agent with its local master (--standalone).
# hyparallel-dlrover-run is dlrover-run with the one fix DLRover 0.6.1 needs to start its local master under
# torch >= 2.10; install both with `pip install -e ".[elastic]"`. A failed or hung worker stops the group and the
# agent restarts it up to MAX_RESTARTS times, resuming from the newest complete checkpoint in CKPT. Arguments are
# passed on to train_gpt.py. See docs/elastic.md.
set -euo pipefail

NPROC="${NPROC:-2}"                # worker processes
MAX_RESTARTS="${MAX_RESTARTS:-2}"  # restarts of the group before the agent gives up
CKPT="${CKPT:-ckpt}"               # checkpoint directory (relative paths: to the repository root)
CKPT_EVERY="${CKPT_EVERY:-10}"     # steps between checkpoints

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec hyparallel-dlrover-run --standalone --nproc_per_node "$NPROC" --max-restarts "$MAX_RESTARTS" \
    examples/train_gpt.py --checkpoint-dir "$CKPT" --checkpoint-every "$CKPT_EVERY" "$@"
