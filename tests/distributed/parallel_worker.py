"""parallelize parity worker: `torchrun --nproc_per_node N tests/distributed/parallel_worker.py OUT CASE...`.

Each case plans gpt-tiny (4 layers) for the launch with the given degrees fixed, parallelizes a meta-device
copy, and trains 3 AdamW steps on the same global batches as a single-device model materialised from the
same seed. Every parameter slice this rank holds (gathered over dp under ZeRO 3, where FSDP shards it) is
then compared with the matching slice of the single-device parameter. Rank 0 writes one JSON line per case.

Tolerance: fp32, rtol 1e-5 / atol 1e-6 after 3 steps. Gradients differ from the single device's by float
rounding only (sums over micro-batches, ranks and tensor-parallel partial products in another order);
AdamW's update m / (sqrt(v) + eps) maps them to parameter differences of the same relative size.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback

import torch
import torch.distributed as dist

import hyparallel as hp
from hyparallel.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_

logging.getLogger("transformers").setLevel(logging.ERROR)
RTOL, ATOL, STEPS, LR = 1e-5, 1e-5, 3, 1e-3
MODEL, SEQ, GLOBAL_BATCH, SEED = "gpt-tiny num_layers=4 bias=false", 16, 8, 17
CASES = {  # name -> plan constraints
    "dp2-tp2-pp2-1f1b": dict(dp=2, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0),
    "dp4": dict(dp=4, tp=1, pp=1, micro_batch=1, zero=0),
    "tp2-pp2": dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0),
    "dp2-tp2-zero1": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=1),
    "dp2-tp2-zero3": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=3),
    "dp2-pp2-zero1-gpipe": dict(dp=2, tp=1, pp=2, schedule="gpipe", micro_batch=1, zero=1),
    "dp2-tp2-recompute": dict(dp=2, tp=2, pp=1, micro_batch=2, zero=0, recompute="full"),
    "tp2-pp2-recompute": dict(dp=1, tp=2, pp=2, schedule="1f1b", micro_batch=2, zero=0, recompute="full"),
}


def batches():
    generator = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=generator)
        yield tokens[:, :-1], tokens[:, 1:]


def held_out() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(SEED + 1))
    return tokens[:, :-1], tokens[:, 1:]


def reference_training() -> tuple[dict[str, torch.Tensor], list[float]]:
    """Single-device training; the last entry of the losses is the held-out batch's loss after training."""
    model = materialize_(hp.models.load(MODEL).module, "cpu", seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches():
        loss = token_cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        losses.append(token_cross_entropy(model(held_out()[0]), held_out()[1]).item())
    return {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, losses


def expected_slice(module: torch.nn.Module, leaf: str, full: torch.Tensor) -> torch.Tensor:
    """The part of the single-device parameter ``full`` a tensor-parallel module holds (padding rows zero)."""
    layout = module.shard_layout(leaf) if callable(getattr(module, "shard_layout", None)) else None
    if layout is None:
        return full
    source = full.t() if layout.transposed else full
    rows = layout.rows or ((0, layout.full_shape[0]),)
    pieces = [torch.cat([source[a:min(b, source.size(0))], source.new_zeros(max(0, b - max(a, source.size(0))),
                                                                           *source.shape[1:])]) for a, b in rows]
    out = torch.cat(pieces)
    return out[:, layout.cols[0]:layout.cols[1]] if layout.cols else out


def run_case(name: str, reference: dict[str, torch.Tensor], ref_losses: list[float]) -> dict:
    constraints = CASES[name]
    model = hp.models.load(MODEL).module
    world = dist.get_world_size()
    plan = hp.plan(model, hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=world), GLOBAL_BATCH, SEQ, "fp32",
                   **constraints)
    pmodel = hp.parallelize(model, plan, seed=SEED)
    calls = []  # forward calls of the first block's qkv: twice per micro-batch when the block is recomputed
    model.get_submodule("layers.0.attn.qkv").register_forward_hook(lambda *_: calls.append(1))
    optimizer = torch.optim.AdamW(pmodel.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches():
        losses.append(pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets)).item())
        optimizer.step()
        optimizer.zero_grad()
    train_calls = len(calls)
    inputs, targets = held_out()
    losses.append(pmodel.eval_step(pmodel.shard(inputs), pmodel.shard(targets)).item())  # forward only, no gradients
    assert all(p.grad is None for p in pmodel.parameters())
    worst, worst_elem, checked = 0.0, 0.0, 0
    modules = dict(model.named_modules())
    for pname, param in pmodel.named_parameters():
        local = param.full_tensor() if hasattr(param, "full_tensor") else param  # ZeRO >= 1: FSDP's dp shards
        owner, _, leaf = pname.rpartition(".")
        expected = expected_slice(modules[owner], leaf, reference[pname])
        relative = ((local.detach() - expected).norm() / expected.norm()).item()
        worst = max(worst, relative)
        worst_elem = max(worst_elem, (local.detach() - expected).abs().max().item())
        assert relative <= RTOL, f"{pname}: relative error {relative:.2e} > {RTOL}"
        torch.testing.assert_close(local.detach(), expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{pname}: {m}")
        checked += 1
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= RTOL * abs(want), (losses, ref_losses)
    return {"case": name, "rank": dist.get_rank(), "losses": losses, "ref_losses": ref_losses, "checked": checked,
            "worst_rel": worst, "worst_abs": worst_elem, "qkv_calls_per_microbatch": train_calls / (STEPS * plan.num_microbatches),
            "plan": plan.parallel.model_dump(), "pipeline": pmodel.pipeline is not None, "tp": pmodel.tp_info is not None}


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    dist.init_process_group("gloo")
    reference, ref_losses = reference_training()
    rows = []
    for name in names:
        try:
            result = run_case(name, reference, ref_losses)
        except Exception as exc:  # noqa: BLE001 -- reported to the test; the launch stops (peers may be mid-collective)
            result = {"case": name, "rank": dist.get_rank(), "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-3000:]}
            with open(f"{out_path}.rank{dist.get_rank()}", "w") as f:
                f.write(json.dumps([result]) + "\n")
            raise
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        rows.append(gathered)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.barrier()  # every rank done with every collective before the groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
