"""Expert-parallel checkpoint worker: `torchrun --nproc_per_node 4
tests/distributed/experts_worker.py OUT DIR`.

For a grouped MoE (transformers' Mixtral: stacked expert weights) and a hand-written one (a
ModuleList of experts, torch.where dispatch): trains 2 SGD-with-momentum steps under dp 4 x ep 4,
saves, then loads into dp 4 x ep 2 with ZeRO 1 and into dp 4 (ep 1), and compares every parameter
and momentum buffer each rank holds with single-device training after 2 steps; each loaded plan
then takes step 3 and is compared again. Also the gradient norm of the first step at ep 4 (and, for
stacked experts, of sequences of 15 tokens under dp 2 x tp 2 x ep 2 with ZeRO 1), and the experts'
imbalance read at ep 4; the router's load-balancing loss over dp at dp 4 x ep 2 and at dp 2 x pp 2
x ep 2, with a forward at another shape after the step; the first step's gradients reduced in bf16
at dp 4 x ep 2 and dp 2 x pp 2 x ep 2, and with every block compiled. Rank 0 writes one JSON line
per case.
"""

from __future__ import annotations

import sys
from pathlib import Path

import harness  # tests/distributed/harness.py, beside this script
import torch
from checkpoint_worker import expected_slice, full
from parallel_worker import GLOBAL_BATCH, LR, SEED, SEQ, batch

import hyparallel as hp
from hyparallel import checkpoint
from hyparallel.runtime.parallel import token_cross_entropy
from hyparallel.tensor.init import materialize_
from hyparallel.tools.parity import small_spec

MODELS = {
    "mixtral": small_spec("hf:MixtralForCausalLM"),
    "where": "tests.tiny_lms:where_moe_lm vocab_size=256",  # parallel_worker.batch's vocabulary
}
PLANS = {
    "saved": dict(dp=4, ep=4, zero=0),
    # tp folded into stacked experts (Note [tp folded into the experts' ranks]), a ModuleList's
    # split by tp; their gradients sharded over replicas spanning tp
    "tp2-ep2-zero1": dict(dp=2, tp=2, ep=2, zero=1, micro_batch=1),
    "router-loss": dict(dp=4, ep=2, zero=0, micro_batch=1),
    # the last stage's graph gathers the router logits over dp (traced inside traced_with)
    "router-loss-pp": dict(dp=2, pp=2, ep=2, zero=0, micro_batch=2),
    "ep2-zero1": dict(dp=4, ep=2, zero=1),
    "ep1": dict(dp=4, ep=1, zero=0),
    # gradients reduced in bf16 over dp (DDP's hook; the bucketed all-reduce after a pipeline), the
    # experts' over their replicas
    "bf16-ep2": dict(dp=4, ep=2, zero=0, grad_compression="bf16"),
    "bf16-pp2-ep2": dict(dp=2, pp=2, ep=2, zero=0, grad_compression="bf16"),
    # each block compiled (the launch's HYPARALLEL_COMPILE_BACKEND), the experts' call left eager
    "compile-ep2": dict(dp=4, ep=2, zero=0, compile=True),
}


def optimizer_of(parameters):
    """SGD with momentum: its state is shaped like the parameters, as AdamW's, but it does not turn
    the rounding of a gradient that is exactly zero (a key bias's: softmax ignores a shift) into
    steps of the learning rate, as Adam's division by the root mean square does."""
    return torch.optim.SGD(parameters, lr=LR, momentum=0.9)


def reference(spec: str, steps: int, routes: list | None = None):
    """One device's model and optimizer after ``steps`` steps; ``routes``: gets each stacked
    experts call's top-k expert indices (transformers' experts(hidden, top_k_index, weights))."""
    model = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
    optimizer = optimizer_of(model.parameters())
    for name, module in model.named_modules():
        if routes is not None and name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda _, args: routes.append(args[1].clone()))
    for step in range(steps):
        inputs, targets = batch(spec, SEED + step)
        token_cross_entropy(model(inputs), targets).backward()
        if step == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            model.first_grad_norm = torch.nn.utils.get_total_norm(grads).item()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def build(spec: str, plan: str, seed: int):
    model = hp.models.load(spec).module
    planned = hp.plan(
        model,
        hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=4),
        GLOBAL_BATCH,
        SEQ,
        "fp32",
        **{"tp": 1, "pp": 1, "micro_batch": 2, **PLANS[plan]},
    )
    pmodel = hp.parallelize(model, planned, seed=seed, device="cpu")
    return model, pmodel, optimizer_of(pmodel.parameters())


def worst_error(model, pmodel, optimizer, ref_model, ref_optimizer) -> tuple[float, list[str]]:
    """Largest relative (norm) difference over every parameter and momentum buffer this rank holds
    (checkpoint_worker's), and their names; the worst's name in ``worst_error.where``."""
    ref_params = dict(ref_model.named_parameters(remove_duplicate=False))
    modules, worst, checked = dict(model.named_modules()), (0.0, ""), []
    for name, param in pmodel.named_parameters():
        owner, _, leaf = name.rpartition(".")
        pairs = [("value", param, ref_params[name])]
        pairs += [
            (k, optimizer.state[param][k], ref_optimizer.state[ref_params[name]][k])
            for k in ("momentum_buffer",)
        ]
        for what, got, want in pairs:
            want = expected_slice(modules[owner], leaf, want)
            # relative, over a floor of 1e-3: a key bias's gradient is exactly zero in exact
            # arithmetic (softmax ignores a shift), so its buffer is rounding (norm ~1e-8) whose
            # relative difference means nothing; every other tensor's norm is far above the floor
            error = ((full(got) - want).norm() / want.norm().clamp_min(1e-3)).item()
            worst = max(worst, (error, f"{name} {what}"))
        checked.append(name)
    return worst, checked


def train(spec: str, pmodel, optimizer, steps: range, norms: list | None = None) -> None:
    for step in steps:
        inputs, targets = batch(spec, SEED + step)
        pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        if norms is not None:
            norms.append(pmodel.clip_grad_norm_(float("inf")).item())
        optimizer.step()
        optimizer.zero_grad()


def run(spec: str, directory: Path) -> dict:
    """Train and save at ep 4, load at ep 2 and ep 1, train on; the errors against one device."""
    result = {"parameter_groups": harness.parameter_groups(hp.models.load(spec).module)}
    routes = []
    after = {steps: reference(spec, steps, routes if steps == 2 else None) for steps in (2, 3)}
    model, pmodel, optimizer = build(spec, "saved", SEED)
    pmodel.expert_imbalance()  # from here on
    train(spec, pmodel, optimizer, range(2), norms := [])
    # what a rank reads alone (the online fit's, on rank 0): at ep 4 = dp its one ep group's calls
    result["local_imbalance"] = pmodel.experts.local_imbalance()
    result["imbalance"] = pmodel.expert_imbalance()
    # what the run's metrics file carries to `hyparallel calibrate --from-run`: the last reading
    pmodel.metrics.close()
    result["recorded_imbalance"] = (pmodel.metrics.record() or {}).get("expert_imbalance")
    # the global gradient norm each rank reads (every expert's gradient counted once)
    result["first_grad_norm"], result["ref_grad_norm"] = norms[0], after[2][0].first_grad_norm
    if routes:  # each call at ep 4 routes the whole global batch (one micro-batch of each rank)
        experts = model.config.num_local_experts
        busiest = mean = 0.0
        for chosen in routes:
            load = torch.bincount(chosen.flatten() // (experts // 4), minlength=4).double()
            busiest, mean = busiest + load.max().item(), mean + load.mean().item()
        result["expected_imbalance"] = busiest / mean
        result["routes"] = len(routes)
    (result["saved_error"], result["saved_worst"]), result["saved_checked"] = worst_error(
        model, pmodel, optimizer, *after[2]
    )
    checkpoint.save(pmodel, optimizer, directory, step=2)
    for plan in ("ep2-zero1", "ep1"):
        model, pmodel, optimizer = build(spec, plan, SEED + 1)  # other initial weights
        checkpoint.load(pmodel, optimizer, directory)
        (result[f"{plan}_error"], result[f"{plan}_worst"]), result[f"{plan}_checked"] = worst_error(
            model, pmodel, optimizer, *after[2]
        )
        train(spec, pmodel, optimizer, range(2, 3))
        (result[f"{plan}_continued"], _), _ = worst_error(model, pmodel, optimizer, *after[3])
    if "routes" in result:  # stacked experts: tp folded in, the norm over their replicas
        # 15 tokens a sequence, one a micro-batch: tp 2 splits each call's rows unevenly
        inputs, targets = (t[:, :-1] for t in batch(spec, SEED))
        one = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
        token_cross_entropy(one(inputs), targets).backward()
        grads = [p.grad for p in one.parameters() if p.grad is not None]
        result["ref_odd_grad_norm"] = torch.nn.utils.get_total_norm(grads).item()
        _, pmodel, _ = build(spec, "tp2-ep2-zero1", SEED)
        pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
        result["odd_grad_norm"] = pmodel.clip_grad_norm_(float("inf")).item()
    return result


def first_step(plan: str) -> dict:
    """Mixtral's first step under ``plan`` (16-bit gradient reduction, compiled blocks): every
    gradient this rank holds against one device's, ||got - want|| / ||want||, the worst."""
    spec = MODELS["mixtral"]
    one = materialize_(hp.models.load(spec).module, "cpu", seed=SEED)
    inputs, targets = batch(spec, SEED)
    token_cross_entropy(one(inputs), targets).backward()
    want = dict(one.named_parameters())
    model, pmodel, _ = build(spec, plan, SEED)
    pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets))
    modules, worst, checked = dict(model.named_modules()), 0.0, []
    for name, param in pmodel.named_parameters():
        owner, _, leaf = name.rpartition(".")
        expected = expected_slice(modules[owner], leaf, want[name].grad)
        error = (full(param.grad) - expected).norm() / expected.norm().clamp_min(1e-12)
        worst = max(worst, error.item())
        checked.append(name)
    return {
        "worst_rel": worst,
        "checked": checked,
        "compressor": pmodel.data_parallel.compressor is not None,
        "parameter_groups": harness.parameter_groups(hp.models.load(spec).module),
    }


ROUTER_LOSS = MODELS["mixtral"] + " output_router_logits=true"


def router_loss(plan: str) -> dict:
    """Two micro-batches a rank (dp 4 x ep 2 of one sequence; dp 2 x pp 2 x ep 2 of two), loss_fn
    cross-entropy plus the router's load-balancing loss (Note [the router's auxiliary loss over
    dp]), one step against one device running the same two micro-batches: each the rows every dp
    rank runs at that index. At dp 4 x ep 2 the model calls a load-balancing loss of its own (one
    calling transformers'), whose inputs are gathered; at dp 2 x pp 2 x ep 2 transformers' (as
    router_loss copies it, whichever transformers is installed), whose sums are all-reduced."""
    from transformers.models.mixtral import modeling_mixtral

    from hyparallel.graph import router_loss as global_loss

    namespace, kept = modeling_mixtral.__dict__, modeling_mixtral.load_balancing_loss_func
    if plan == "router-loss":
        transformers_loss = getattr(kept, "__wrapped__", kept)

        def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
            return transformers_loss(gate_logits, num_experts, top_k, attention_mask)

        namespace["load_balancing_loss_func"] = load_balancing_loss_func
    else:
        namespace["load_balancing_loss_func"] = global_loss.transformers_load_balancing_loss
    try:
        return _router_loss(plan) | {
            "gathers": global_loss.gathers(hp.models.load(ROUTER_LOSS).module)
        }
    finally:
        namespace["load_balancing_loss_func"] = kept


def _router_loss(plan: str) -> dict:
    from tests.tiny_lms import ce_plus_router_loss

    model, pmodel, optimizer = build(ROUTER_LOSS, plan, SEED)
    inputs, targets = batch(ROUTER_LOSS, SEED)
    # no padding: the loss is a micro-batch's mean, which weighs every micro-batch alike
    targets = targets.clamp_min(0)
    loss = pmodel.train_step(pmodel.shard(inputs), pmodel.shard(targets), ce_plus_router_loss)
    optimizer.step()
    # after parallelize changed the model's load_balancing_loss_func: a plain model keeps its own
    one = materialize_(hp.models.load(ROUTER_LOSS).module, "cpu", seed=SEED)
    one_optimizer = optimizer_of(one.parameters())
    dp, micro_batch = PLANS[plan]["dp"], PLANS[plan]["micro_batch"]
    share = GLOBAL_BATCH // dp  # each dp rank's rows
    count = share // micro_batch
    losses = []
    for index in range(count):  # micro-batch `index` of every dp rank's share
        chosen = torch.cat(
            [
                torch.arange(r * share + index * micro_batch, r * share + (index + 1) * micro_batch)
                for r in range(dp)
            ]
        )
        micro = ce_plus_router_loss(one(inputs[chosen]), targets[chosen])
        (micro / count).backward()
        losses.append(micro.item())
    one_optimizer.step()
    (error, worst), checked = worst_error(model, pmodel, optimizer, one, one_optimizer)
    # a call at a shape the stages were not traced for: stages traced again, their expert calls
    # kept whole in them too (Note [a module call a trace keeps]); the same rows on every dp rank
    rows = inputs[:3, :11]
    with torch.no_grad():
        got, want = pmodel(rows), one(rows)
    forward = {
        "logits_error": ((got.logits - want.logits).norm() / want.logits.norm()).item(),
        "aux_loss": got.aux_loss.item(),
        "ref_aux_loss": want.aux_loss.item(),
    }
    return {
        **forward,
        "loss": loss.item(),
        "ref_loss": sum(losses) / count,
        "error": error,
        "worst": worst,
        "checked": checked,
        "parameter_groups": harness.parameter_groups(hp.models.load(ROUTER_LOSS).module),
    }


def main() -> None:
    out, directory = sys.argv[1], Path(sys.argv[2])
    harness.init()
    harness.run_cases(
        out,
        [
            *(
                (name, lambda spec=spec, name=name: run(spec, directory / name))
                for name, spec in MODELS.items()
            ),
            *(
                (plan, lambda plan=plan: router_loss(plan))
                for plan in ("router-loss", "router-loss-pp")
            ),
            *(
                (plan, lambda plan=plan: first_step(plan))
                for plan in ("bf16-ep2", "bf16-pp2-ep2", "compile-ep2")
            ),
        ],
    )


if __name__ == "__main__":
    main()
