"""Your own training loop under any plan: `torchrun --nproc_per_node 4 examples/train_loop.py --plan
PLAN.yaml`.

Byte-level language modelling of examples/data/corpus.txt with a Dataset and DataLoader of your own,
a label-smoothed loss, warm-up, gradient accumulation, periodic evaluation, TensorBoard, checkpoints
that resume (data position included) under another plan, pretrained weights in (--init-from a
Hugging Face folder), and a greedy sample at the end. The numbers it prints are one device's under
any plan (docs/training-loop.md).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import Progress
from torch.utils.data import DataLoader, Dataset

import hyparallel as hp

CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--plan", help="plan YAML (default: planned for this launch, the cpu preset)"
    )
    parser.add_argument(
        "--model",
        default="gpt-tiny",
        help="zoo name or hf:ARCH key=value... (256-token vocabulary)",
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--accumulate", type=int, default=1, help="batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--warmup", type=int, default=10, help="steps of linear learning-rate warm-up"
    )
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument(
        "--checkpoint-dir", help="save here every --checkpoint-every steps; resume from the newest"
    )
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--tensorboard", help="rank 0 writes TensorBoard events here")
    parser.add_argument(
        "--init-from", help="a Hugging Face folder (save_pretrained) to fine-tune from"
    )
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile each block (without --plan)"
    )
    return parser.parse_args()


class Windows(Dataset):
    """Consecutive windows of ``length + 1`` bytes: (inputs, targets) shifted by one token."""

    def __init__(self, data: torch.Tensor, length: int):
        self.data, self.length = data, length

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[index * self.length : (index + 1) * self.length + 1].long()
        return chunk[:-1], chunk[1:]


def smoothed(output, targets):
    """Label-smoothed cross-entropy as (total, count): its mean is one device's under any plan (Note
    [the loss a user reads] in hyparallel/runtime/loss.py); a mean-reduced loss would weigh
    micro-batches equally instead."""
    logits = (output.logits if hasattr(output, "logits") else output).flatten(0, -2).float()
    total = F.cross_entropy(
        logits, targets.flatten(), ignore_index=-100, label_smoothing=0.1, reduction="sum"
    )
    return total, (targets != -100).sum()


def main() -> None:
    args = parse_args()
    model = hp.models.load(args.model).module  # meta device: each rank materialises only its share
    if args.plan:
        plan = hp.Plan.load(args.plan)
    else:  # every rank derives the same plan for this launch
        cluster = hp.ClusterSpec.preset(
            "cpu", num_nodes=1, gpus_per_node=int(os.environ.get("WORLD_SIZE", 1))
        )
        plan = hp.plan(
            model, cluster, global_batch=16, seq_len=64, dtype="fp32", compile=args.compile
        )
    pmodel = hp.parallelize(model, plan, compile_backend="aot_eager" if args.compile else None)
    if args.init_from:  # each rank reads only its own slices of the safetensors files
        hp.checkpoint.load_pretrained(pmodel, args.init_from)
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / args.warmup)
    )
    corpus = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    split = corpus.numel() * 9 // 10
    train, held_out = (
        Windows(corpus[:split], plan.training.seq_len),
        Windows(corpus[split:], plan.training.seq_len),
    )
    # each dp rank's rows of the same global batches under any plan
    sampler = pmodel.sampler(train, seed=0)
    loader = DataLoader(train, batch_size=sampler.share, sampler=sampler)
    eval_sampler = pmodel.sampler(held_out, shuffle=False, train=False)
    eval_loader = DataLoader(held_out, batch_size=eval_sampler.share, sampler=eval_sampler)
    step = 0
    if args.checkpoint_dir and (
        info := hp.checkpoint.load(pmodel, optimizer, args.checkpoint_dir, missing_ok=True)
    ):
        # weights, optimizer, loss scale and data position, resharded for this plan
        step = info["step"]
        scheduler.load_state_dict(info["extra"]["scheduler"])
    tracker = hp.tracking.Tracker(pmodel, tensorboard_dir=args.tensorboard)
    rank0 = pmodel.env.rank == 0
    with Progress(disable=not rank0) as progress:
        task = progress.add_task("training", total=args.steps, completed=step)
        while step < args.steps:
            for index, (inputs, targets) in enumerate(loader):
                loss = pmodel.train_step(inputs, targets, smoothed, accumulate=args.accumulate)
                if (index + 1) % args.accumulate:
                    continue  # gradients add up: the optimizer steps after --accumulate batches
                pmodel.clip_grad_norm_(1.0)  # the single device's global norm
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
                step += 1
                tracker.log(step, loss=loss, lr=scheduler.get_last_lr()[0])
                progress.update(task, advance=1, description=f"loss {loss.item():.4f}")
                if step % args.eval_every == 0 or step == args.steps:
                    pmodel.eval()
                    losses = [pmodel.eval_step(x, y, smoothed) for x, y in eval_loader]
                    pmodel.train()
                    # the same global batches under any plan
                    held = torch.stack(losses).mean().item()
                    tracker.log(step, eval_loss=held)
                    if rank0:
                        progress.console.print(
                            f"step {step:4d}  loss {loss.item():.6f}  eval loss {held:.6f}"
                        )
                if args.checkpoint_dir and step % args.checkpoint_every == 0:
                    extra = {"scheduler": scheduler.state_dict()}
                    hp.checkpoint.save(pmodel, optimizer, args.checkpoint_dir, step, extra=extra)
                if step == args.steps:
                    break
    tracker.close()
    # this dp rank's rows: here the same prompt
    prompt = torch.tensor([list(b"Pipeline ")] * sampler.share)
    text = bytes(pmodel.generate(prompt, max_new_tokens=24)[0].tolist()).decode(errors="replace")
    if rank0:
        print(f"sample: {text!r}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
