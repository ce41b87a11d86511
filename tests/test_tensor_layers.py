"""Tensor-parallel modules in a world of one process: exact torch equivalents, and no-op
collectives."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyparallel.tensor import collectives
from hyparallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)


@pytest.fixture(scope="module")
def group():
    # A world of one in this process, torn down after the module so nothing else sees a process
    # group.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_collectives_are_no_ops_for_a_group_of_one(group):
    x = torch.randn(2, 4, 3, requires_grad=True)
    for fn in (collectives.copy_to_tp, collectives.reduce_from_tp):
        assert fn(x, group) is x
    for fn in (
        collectives.scatter_to_tp,
        collectives.gather_from_tp,
        collectives.all_gather_seq,
        collectives.reduce_scatter_seq,
    ):
        assert fn(x, 1, group) is x


def test_vocab_parallel_embedding_keeps_the_padding_row_frozen(group):
    torch.manual_seed(0)
    reference = nn.Embedding(10, 4, padding_idx=3)
    parallel = VocabParallelEmbedding(10, 4, (0, 10), group, padding_idx=3)
    parallel.weight.data.copy_(reference.weight.data)
    ids = torch.tensor([[1, 3, 9, 3]])
    torch.testing.assert_close(parallel(ids), reference(ids))
    parallel(ids).sum().backward()
    reference(ids).sum().backward()
    torch.testing.assert_close(parallel.weight.grad, reference.weight.grad)
    assert torch.count_nonzero(parallel.weight.grad[3]) == 0


def test_linears_match_nn_linear(group):
    torch.manual_seed(0)
    reference = nn.Linear(6, 8)
    x = torch.randn(2, 5, 6)
    column = ColumnParallelLinear(6, 8, [(0, 8)], True, group)
    row = RowParallelLinear(6, 8, (0, 6), True, group)
    for module in (column, row):
        module.weight.data.copy_(reference.weight.data)
        module.bias.data.copy_(reference.bias.data)
        torch.testing.assert_close(module(x), reference(x))
    column.activation = "gelu_tanh"  # the activation epilogue (torch fallback on the CPU)
    torch.testing.assert_close(column(x), F.gelu(reference(x), approximate="tanh"))


def test_vocab_parallel_cross_entropy_matches_torch(group):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 0] = -100  # ignored, as in F.cross_entropy
    ours = vocab_parallel_cross_entropy(logits, targets, group, 0, 11)
    torch.testing.assert_close(ours, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_vocab_parallel_function_in_place_gives_torchs_loss_and_gradient(group, dtype):
    # The autograd function itself on a group of one (its all-reduces the identity): padded columns
    # past the vocabulary, an ignored target; its in-place steps (Note [the vocab-parallel loss's
    # memory]) leave the logits as they were and give F.cross_entropy's gradient, in the logits'
    # dtype.
    from hyparallel.tensor.layers import _VocabParallelCrossEntropy

    torch.manual_seed(0)
    # vocabulary 11, one padding column
    logits = torch.randn(2, 5, 12, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 3] = -100
    before = logits.detach().clone()
    ours = _VocabParallelCrossEntropy.apply(logits, targets, 0, 11, group, -100)
    (grad,) = torch.autograd.grad(ours, logits)
    # exact: no kernel ran on the logits themselves, they are compared with a copy of the very same
    # values
    assert torch.equal(logits.detach(), before) and grad.dtype == dtype
    reference = logits.detach()[..., :11].float().requires_grad_()
    expected = F.cross_entropy(reference.flatten(0, 1), targets.flatten())
    expected.backward()
    torch.testing.assert_close(ours.float(), expected)
    # the gradient rounded to bf16
    tolerance = {} if dtype == torch.float32 else {"rtol": 0, "atol": 2**-9}
    torch.testing.assert_close(grad[..., :11].float(), reference.grad, **tolerance)
    assert torch.all(grad[..., 11] == 0)  # the padding column's logit gets no gradient
    twice = _VocabParallelCrossEntropy.apply(logits, targets, 0, 11, group, -100)
    twice.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        twice.backward()


@pytest.mark.parametrize(
    ("styles", "message"),
    [
        ({"layers.*.attn.qkv": "column"}, "layers.0.attn.proj must be split too"),
        (
            {"layers.*.attn_norm": "column"},
            "cannot split layers.0.attn_norm (column; the dataflow allows replicate)",
        ),
        (
            {"layers.*.attn.qkv": "row", "layers.*.attn.proj": "row"},
            "cannot split layers.0.attn.qkv (row; the dataflow allows column)",
        ),
        ({"blocks.*.fc": "column"}, "'blocks.*.fc' matches no module of GPT"),
    ],
)
def test_a_plan_that_does_not_fit_the_model_is_refused(group, styles, message):
    import hyparallel as hp
    from hyparallel.spec.errors import ConfigError
    from hyparallel.tensor import apply_tensor_parallel

    model = hp.models.build("gpt-tiny", device="cpu")
    graph = hp.trace(model, model.example_inputs(1, 8))
    with pytest.raises(ConfigError, match=re.escape(message)):
        apply_tensor_parallel(model, styles, group, graph)
