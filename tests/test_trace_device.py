"""A meta model is exported for the device it will run on (Note [exported for the device it runs
on], hyparallel/graph/tracer.py): code that branches on its tensors' device takes the run device's
branch, and tensor constants the forward creates come out real and reach the pipeline stage that
reads them.

Before, the export saw ``device.type == "meta"``: transformers' MoE took its int ``histc`` branch
and failed on the CPU ("histogram_cpu" not implemented for 'Int'; Mixtral, Qwen-MoE, OLMoE at pp 2),
and Falcon's ``torch.tensor`` constants were refused ("a meta-device trace cannot give its value").
"""

from __future__ import annotations

import torch

import hyparallel as hp
from hyparallel.graph.tracer import tracing_device
from hyparallel.pipeline import split_model
from hyparallel.tensor.init import materialize_

from .conftest import assert_every_parameter_compared
from .distributed.harness import parameter_groups

SPEC = "tests.tiny_lms:device_branch_lm"


def histc_inputs(graph) -> list[torch.dtype]:
    nodes = [n for n in graph.traced.gm.graph.nodes if "histc" in str(n.target)]
    return [n.args[0].meta["val"].dtype for n in nodes]


def test_the_export_takes_the_branch_of_the_device_it_runs_on():
    model = hp.models.load(SPEC).module
    example = torch.zeros(2, 16, dtype=torch.long, device="meta")
    graph = hp.trace(model, example)
    assert graph.method == "export"  # torch.fx cannot branch on a Proxy's device
    assert histc_inputs(graph) == [torch.float32]  # the CPU's branch, not meta's int one
    # what a plain meta export bakes in: the branch that fails on the CPU
    with tracing_device("meta"):
        assert histc_inputs(hp.trace(model, example)) == [torch.int32]


def test_a_pipeline_of_a_device_branching_model_with_forward_constants_equals_the_model():
    model = hp.models.load(SPEC).module
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    stages = [["embed", "layers.0"], ["layers.1", "norm", "head"]]
    split = split_model(model, stages, inputs.to("meta"))
    materialize_(model, "cpu", seed=3, only=split.state_names(range(2)))
    flat, received = split.flatten_inputs(inputs), ()
    for k in range(2):
        received = split.stage_module(k)(flat, received)
    loss = torch.nn.functional.cross_entropy(received.flatten(0, 1), targets.flatten())
    loss.backward()
    ref = materialize_(hp.models.load(SPEC).module, "cpu", seed=3)
    ref_loss = torch.nn.functional.cross_entropy(ref(inputs).flatten(0, 1), targets.flatten())
    ref_loss.backward()
    # The same ops on the same values through an exported graph: fp32 rounding at most (rtol 1e-5 /
    # atol 1e-6).
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads, compared = dict(ref.named_parameters()), set()
    for k in range(2):
        for name, param in split.stage_module(k).body.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6)
            compared.add(name)
    assert_every_parameter_compared(parameter_groups(ref), {"the stages": compared})
