"""Host memory while loading pretrained weights: ``hp.checkpoint.load_pretrained`` against reading
the whole files.

Run: torchrun --nproc_per_node 4 benchmarks/pretrained_memory.py [--folder DIR] [--tp 2 --pp 2]
[--json FILE] (gloo on the CPU; torchrun sets OMP_NUM_THREADS=1.)

Rank 0 writes a Hugging Face folder of a Llama-shaped model (8 layers of width 512, a 16,000-token
vocabulary: 152 MiB of fp32 weights in 50 MB shards) to ``--folder`` unless one is there. Every rank
builds the model on the meta device, parallelizes it under tp x pp x dp (dp: the rest of the world;
only its share is allocated), then loads the folder with ``hp.checkpoint.load_pretrained`` and
measures its resident set's growth while loading: the peak (VmHWM, reset through
/proc/self/clear_refs just before) less the resident set before. The peer reads every shard whole
into memory (``safetensors.torch.load_file``, each tensor copied), as a loader that materialises the
model on each rank does, measured the same way. Rank 0 prints each rank's growth, the bytes it read
and held, and the growth over the model's bytes (target: well under 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.runtime.checkpoint import state_entries

logging.getLogger("transformers").setLevel(logging.ERROR)
MODEL = (
    "hf:LlamaForCausalLM num_hidden_layers=8 hidden_size=512 num_attention_heads=8"
    " num_key_value_heads=4 intermediate_size=1408 vocab_size=16000 max_position_embeddings=128"
    " bos_token_id=0 eos_token_id=0"
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--folder", help="the Hugging Face folder (written if missing; default: a temporary one)"
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--json", help="rank 0 writes the figures here")
    return parser.parse_args()


def status_kib(field: str) -> int:
    """A figure of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its peak)."""
    return int(
        re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)
    )


def growth_bytes(load) -> tuple[int, object]:
    """The resident set's growth while ``load()`` runs (its peak less the start), and what it
    returned."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the resident set now
    start = status_kib("VmRSS")
    result = load()
    return (status_kib("VmHWM") - start) * 1024, result


def read_whole(folder: Path) -> dict[str, torch.Tensor]:
    """The peer: every tensor of every shard in memory, as building the whole model and
    ``load_state_dict`` has it (``load_file`` maps the file and reads nothing until touched; the
    copy reads it)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update({name: tensor.clone() for name, tensor in load_file(file).items()})
    return state


def write_folder(spec: str, folder: Path) -> None:
    torch.manual_seed(0)
    hp.models.load(spec, device="cpu").module.save_pretrained(folder, max_shard_size="50MB")


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    scratch = tempfile.mkdtemp() if args.folder is None and rank == 0 else None
    folders = [args.folder or scratch]
    dist.broadcast_object_list(folders)  # rank 0's temporary folder (one machine)
    folder = Path(folders[0])
    if rank == 0 and not (folder / "config.json").is_file():
        write_folder(args.model, folder)
    dist.barrier()
    model = hp.models.load(args.model).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world)
    dp = world // (args.tp * args.pp)
    plan = hp.plan(
        model, cluster, 2 * dp, 16, "fp32", dp=dp, tp=args.tp, pp=args.pp, micro_batch=1, zero=0
    )
    pmodel = hp.parallelize(model, plan, device="cpu")
    model_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    grown, loaded = growth_bytes(lambda: hp.checkpoint.load_pretrained(pmodel, folder))
    held = sum(
        p.view.numel() * p.view.element_size()
        for e in state_entries(pmodel, None).values()
        for p in e.pieces
    )
    peer, _ = growth_bytes(lambda: read_whole(folder))
    row = {
        "rank": rank,
        "growth_bytes": grown,
        "read_bytes": loaded.bytes_read,
        "held_bytes": held,
        "peer": peer,
    }
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        mib = 2**20
        print(
            f"{args.model}\n{model_bytes / mib:.1f} MiB of weights; dp {dp} x tp {args.tp} x pp"
            f" {args.pp}"
        )
        print("rank  growth MiB  read MiB  held MiB  growth/model  load_file growth/model")
        for r in rows:
            print(
                f"{r['rank']:4d}  {r['growth_bytes'] / mib:10.1f}  {r['read_bytes'] / mib:8.1f}  "
                f"{r['held_bytes'] / mib:8.1f}  {r['growth_bytes'] / model_bytes:12.3f}  "
                f"{r['peer'] / model_bytes:21.3f}"
            )
        worst = max(r["growth_bytes"] for r in rows) / model_bytes
        print(
            f"largest growth while loading: {worst:.3f} of the model (reading the files whole: "
            f"{max(r['peer'] for r in rows) / model_bytes:.3f})"
        )
        if args.json:
            Path(args.json).write_text(
                json.dumps({"model_bytes": model_bytes, "ranks": rows, "ratio": worst})
            )
    dist.barrier()
    dist.destroy_process_group()
    if scratch is not None:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
