"""Pipeline parity worker: run under `torchrun --nproc_per_node 4` (gloo); one process group for all
cases.

pp = 2 runs on ranks {0, 1} and {2, 3} at once (two pipelines, the same case), pp = 4 on all four.
Each case plans the stage map with the planner (the plan's `stages`), splits a meta-device model,
materialises only this rank's stages, runs one train_step and compares the mean loss and every local
gradient with the single-device model built from the same seed on the full batch. Rank 0 writes one
JSON line per case.

Tolerance: fp32, rtol 1e-5 with atol 1e-6: the pipeline sums per-micro-batch gradients where the
single device reduces over the whole batch at once, so results differ by float rounding only.
"""

from __future__ import annotations

import copy
import functools
import logging
import sys

import harness  # tests/distributed/harness.py, beside this script
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hyparallel as hp
from hyparallel.pipeline import lower, schedule, simulate, split_model
from hyparallel.pipeline.executor import PipelineRuntime
from hyparallel.planner import inflight
from hyparallel.tensor.init import materialize_

logging.getLogger("transformers").setLevel(logging.ERROR)
RTOL, ATOL = 1e-5, 1e-6
BATCH, SEQ, MICROBATCHES = 8, 16, 4
MODELS = {
    "gpt": "gpt-tiny num_layers=8",
    "hf-gpt2": (
        "hf:GPT2LMHeadModel n_layer=4 n_embd=64 n_head=4 vocab_size=128 n_positions=64"
        " bos_token_id=0 eos_token_id=0 resid_pdrop=0 embd_pdrop=0 attn_pdrop=0"
    ),
}
# Grouped-query attention, rotary tables (a buffer materialised on the first stage only), an untied
# head.
LLAMA = (
    "hf:LlamaForCausalLM num_hidden_layers=2 hidden_size=64 num_attention_heads=4"
    " num_key_value_heads=2 intermediate_size=128 vocab_size=128 max_position_embeddings=64"
    " bos_token_id=0 eos_token_id=0"
)
# pp 4 for the torch.fx stages only (suite time)
PIPELINE_DEGREES = {"gpt": (2, 4), "hf-gpt2": (2,)}
VOCAB = {"gpt": 256, "hf-gpt2": 128, "hf-llama": 128}
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output


def loss_fn(output, targets):
    logits = logits_of(output)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Awkward(nn.Module):
    """What real models do between stages, in one small model (fx-traced).

    A leaf module returning a tuple of tensors, a skip connection from stage 0 to stage 2, an int
    taken from a shape in stage 0 and used in stage 2, a user mask read by the last stage, a scale
    parameter read by stages 1 and 2, and an embedding tied to the head (stages 0 and 2).
    """

    class Pair(nn.Module):  # no child modules: traced as one call returning a tuple
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8) / 3)

        def forward(self, x):
            return x @ self.weight, torch.tanh(x)

    class Join(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = nn.Linear(8, 8)

        def forward(self, pair, scale):
            return self.l1(pair[0] + pair[1]) * scale

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.pair = Awkward.Pair()  # a leaf module returning (a, b): the tuple crosses to stage 1
        self.join = Awkward.Join()
        self.l2 = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens, mask):
        e = self.emb(tokens)
        length = tokens.size(1)
        h = self.join(self.pair(e), self.scale)
        h = torch.tanh(self.l2(h) * self.scale) + e
        return (self.head(h) * mask.unsqueeze(-1)).reshape(-1, length, 16)


AWKWARD_STAGES = [["emb", "pair"], ["join"], ["l2", "head"]]


def run_awkward(kind: str, group) -> dict:
    """pp = 3, two train_steps without zero_grad: gradients accumulate to twice the reference's."""
    torch.manual_seed(3)
    model = Awkward()
    reference = copy.deepcopy(model)
    tokens, targets = torch.randint(0, 16, (8, 6)), torch.randint(0, 16, (8, 6))
    mask = (torch.rand(8, 6) > 0.3).float()
    split = split_model(model, AWKWARD_STAGES, (tokens[:2], mask[:2]))
    rank = dist.get_rank(group)
    runtime = PipelineRuntime(
        split,
        {rank: split.stage_module(rank)},
        group,
        schedule_kind=kind,
        num_microbatches=MICROBATCHES,
    )
    losses = [runtime.train_step((tokens, mask), targets, loss_fn).item() for _ in range(2)]
    for _ in range(2):
        ref_loss = loss_fn(reference(tokens, mask), targets)
        ref_loss.backward()
    ref_grads = dict(reference.named_parameters(remove_duplicate=False))
    worst_abs, checked = 0.0, []
    for pname, param in runtime.named_parameters():
        torch.testing.assert_close(
            param.grad,
            ref_grads[pname].grad,
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, pname=pname: f"{pname}: {m}",
        )
        worst_abs = max(worst_abs, (param.grad - ref_grads[pname].grad).abs().max().item())
        checked.append(pname)
    torch.testing.assert_close(torch.tensor(losses[-1]), ref_loss.detach(), rtol=RTOL, atol=0)
    return {
        "rank": rank,
        "loss": losses[-1],
        "ref_loss": ref_loss.item(),
        "parameter_groups": harness.parameter_groups(reference),
        "worst_abs": worst_abs,
        "params_checked": checked,
        "tied": sorted(runtime._tied),
        "boundaries": [list(io.outputs) for io in split.io],
        "order": runtime.last_order,
    }


def make_plan(spec: str, pp: int, kind: str, v: int) -> hp.Plan:
    model = hp.models.load(spec).module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=pp)
    return hp.plan(
        model,
        cluster,
        global_batch=BATCH,
        seq_len=SEQ,
        dtype="fp32",
        pp=pp,
        tp=1,
        dp=1,
        schedule=kind,
        virtual_stages=v,
        micro_batch=BATCH // MICROBATCHES,
    )


def run_case(name: str, pp: int, kind: str, v: int, group, seed: int) -> dict:
    spec = MODELS[name] if name in MODELS else LLAMA
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB[name], (BATCH, SEQ + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    reference = materialize_(hp.models.load(spec).module, "cpu", seed=seed)
    ref_loss = loss_fn(reference(inputs), targets)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}

    model = hp.models.load(spec).module  # meta
    plan = make_plan(spec, pp, kind, v)
    assert plan.num_microbatches == MICROBATCHES
    stages = [stage.modules for stage in plan.stages]
    # token ids of micro_batch x seq_len traced
    runtime = PipelineRuntime.from_plan(model, plan, group, seed=seed)
    rank = dist.get_rank(group)
    loss = runtime.train_step(inputs, targets, loss_fn)

    worst_abs, checked = 0.0, []
    for pname, param in runtime.named_parameters():
        torch.testing.assert_close(
            param.grad,
            ref_grads[pname],
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, pname=pname: f"{pname}: {m}",
        )
        worst_abs = max(worst_abs, (param.grad - ref_grads[pname]).abs().max().item())
        checked.append(pname)
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=RTOL, atol=0)
    materialized = [n for n, p in model.named_parameters() if not p.is_meta]
    lowered = lower(schedule(kind, pp, MICROBATCHES, v), pp, v)
    sim = simulate(lowered, pp, v)
    return {
        "rank": rank,
        "loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "parameter_groups": harness.parameter_groups(reference),
        "worst_abs": worst_abs,
        "params_checked": checked,
        "stages": stages,
        "materialized": len(materialized),
        "model_params": len(list(model.parameters())),
        "order_matches_simulator": runtime.last_order == sim.order[rank],
        "order": runtime.last_order,
        "peak_inflight": runtime.peak_inflight,
        "simulated_peak": sim.peak_inflight[rank],
        "cost_model_peak": inflight.inflight_microbatches(kind, pp, MICROBATCHES, rank, v),
        "peak_backward_sends": runtime.peak_backward_sends,
        "backward_sends_bound": inflight.backward_sends_held(kind, pp, MICROBATCHES, rank, v),
        "backward_sends_sent": MICROBATCHES * (v - (1 if rank == 0 else 0)),
        "tied": sorted(runtime._tied),
    }


def main() -> None:
    harness.init()
    world = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    groups = {2: pairs[world // 2], 4: dist.group.WORLD}
    cases = [
        (name, pp, kind, v)
        for name in MODELS
        for pp in PIPELINE_DEGREES[name]
        for kind, v in SCHEDULES
    ]
    cases.append(("hf-llama", 2, "1f1b", 1))
    listed = [
        (
            f"{name}-pp{pp}-{kind}",
            functools.partial(run_case, name, pp, kind, v, groups[pp], seed=7),
        )
        for name, pp, kind, v in cases
    ]
    for kind in ("gpipe", "1f1b"):  # ranks 0-2; rank 3 reports nothing
        listed.append(
            (
                f"awkward-pp3-{kind}",
                functools.partial(run_awkward, kind, triple) if world < 3 else dict,
            )
        )
    wanted = sys.argv[2:]  # the cases named, else every one
    harness.run_cases(sys.argv[1], [(n, c) for n, c in listed if not wanted or n in wanted])


if __name__ == "__main__":
    main()
