"""Models built on meta come out exactly as a CPU build makes them: buffers computed in ``__init__``
(Note [parameters on meta, buffers real]), parameters of any rank (Note [any rank]), or a one-line
refusal."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hyparallel as hp
from hyparallel.spec.errors import ConfigError
from hyparallel.tensor.init import CHUNK_ROWS, ShardLayout, _seed, fill_, materialize_

VOCAB, HIDDEN, SEQ = 32, 16, 8
HF_GEMMA_TINY = (
    "hf:GemmaForCausalLM num_hidden_layers=1 hidden_size=64 num_attention_heads=4"
    " num_key_value_heads=2 head_dim=16 intermediate_size=128 vocab_size=128"
    " max_position_embeddings=64 bos_token_id=0 eos_token_id=0 pad_token_id=0"
)
CPU1 = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose output is scaled by a buffer computed in ``__init__`` (Gemma's shape)."""

    def __init__(self, num: int, dim: int):
        super().__init__(num, dim)
        self.register_buffer("scale", torch.tensor(dim**0.5) / 3, persistent=False)
        # filled in place, as rotary tables
        self.register_buffer("table", torch.empty(SEQ, dim), persistent=False)
        self.table.copy_(torch.sin(torch.arange(SEQ * dim, dtype=torch.float32).view(SEQ, dim) / 7))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.scale + self.table[: idx.size(1)]


class ScaledLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ScaledEmbedding(VOCAB, HIDDEN)
        # a causal mask
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)), persistent=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        t = idx.size(1)
        # causal mean of the prefix
        mixed = (self.mask[:t, :t] / self.mask[:t, :t].sum(-1, keepdim=True)) @ x
        return self.head(mixed)

    def example_inputs(self, batch_size: int, seq_len: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)


def make_scaled() -> ScaledLM:
    """The factory ``tests.test_meta_build:make_scaled``."""
    return ScaledLM()


def _reference_step(reference: nn.Module, trained: nn.Module, inputs, targets, loss_fn):
    """Load ``trained``'s weights into the CPU-built ``reference`` (its buffers its own), one
    forward and backward."""
    reference.load_state_dict({n: p.detach() for n, p in trained.named_parameters()}, strict=False)
    loss = loss_fn(reference(inputs), targets)
    loss.backward()
    return loss


def _assert_same_step(
    model: nn.Module, reference: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor
) -> None:
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    grads = dict(model.named_parameters())
    assert set(grads) == {n for n, _ in reference.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, param.grad, rtol=1e-5, atol=1e-7, msg=name)


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def test_buffers_computed_in_init_come_out_as_a_cpu_build_makes_them():
    model = hp.models.load("tests.test_meta_build:make_scaled").module
    cpu = hp.models.load("tests.test_meta_build:make_scaled", device="cpu").module
    assert all(p.is_meta for p in model.parameters())
    materialize_(model, "cpu")
    for name, buf in cpu.named_buffers():
        # the same code computed both: bitwise
        assert torch.equal(model.get_buffer(name), buf), name
    assert model.emb.scale.item() == pytest.approx(HIDDEN**0.5 / 3)


def test_empty_init_builds_a_users_model_the_same_way():
    with hp.models.empty_init():
        model = ScaledLM()
    assert all(p.is_meta for p in model.parameters()) and isinstance(
        model.head.weight, nn.Parameter
    )
    # the same __init__ code, CPU kernels, same values: bitwise
    for name, buf in ScaledLM().named_buffers():
        assert torch.equal(model.get_buffer(name), buf), name
    assert torch.empty(2).device.type == "cpu"  # nothing of it outlives the block


def test_a_world_of_one_with_scaled_embedding_equals_the_cpu_build(world_of_one):
    spec = "tests.test_meta_build:make_scaled"
    model = hp.models.load(spec).module
    plan = hp.plan(model, CPU1, 4, SEQ, "fp32", dp=1, tp=1, pp=1, micro_batch=4)
    pmodel = hp.parallelize(model, plan, seed=5, device="cpu")
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loss = pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
    reference = hp.models.load(spec, device="cpu").module
    ref_loss = _reference_step(reference, model, tokens[:, :-1], tokens[:, 1:], _token_loss)
    _assert_same_step(model, reference, loss, ref_loss)


def test_gemma_embed_scale_and_loss_equal_a_cpu_build(world_of_one):
    model = hp.models.load(HF_GEMMA_TINY).module
    reference = hp.models.load(HF_GEMMA_TINY, device="cpu").module
    plan = hp.plan(model, CPU1, 2, SEQ, "fp32", dp=1, tp=1, pp=1, micro_batch=2)
    pmodel = hp.parallelize(model, plan, seed=1, device="cpu")
    # Gemma's embed_scale is torch.tensor(hidden ** 0.5) made from a Python float: no kernel, so
    # bitwise.
    assert torch.equal(model.model.embed_tokens.embed_scale, torch.tensor(64**0.5))
    assert torch.equal(
        model.model.embed_tokens.embed_scale, reference.model.embed_tokens.embed_scale
    )
    tokens = torch.randint(1, 128, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    loss = pmodel.train_step(tokens[:, :-1], tokens[:, 1:])
    ref_loss = _reference_step(
        reference, model, tokens[:, :-1], tokens[:, 1:], lambda out, t: _token_loss(out.logits, t)
    )
    _assert_same_step(model, reference, loss, ref_loss)


def test_a_meta_buffer_of_a_module_with_parameters_is_refused_by_name(world_of_one):
    with torch.device("meta"):  # the user's own meta build: the buffers have no value
        model = ScaledLM()
    plan = hp.plan(model, CPU1, 4, SEQ, "fp32", dp=1, tp=1, pp=1, micro_batch=4)
    with pytest.raises(
        ConfigError, match=r"^materialize: buffer 'mask' of ScaledLM is on the meta device"
    ) as e:
        hp.parallelize(model, plan, device="cpu")
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()  # refused before the first collective
    with pytest.raises(
        ConfigError, match=r"^materialize: buffer 'scale' of ScaledEmbedding is on the meta device"
    ):
        materialize_(model.emb, "cpu")  # a module with parameters: nothing recomputes its buffer


def test_rotary_tables_of_a_users_meta_build_are_still_recomputed():
    with torch.device("meta"):
        model = hp.models.Llama(hp.models.config("llama-tiny"))
    materialize_(model, "cpu")
    torch.testing.assert_close(
        model.rope.cos, hp.models.build("llama-tiny", device="cpu").rope.cos, rtol=0, atol=0
    )


class _Unwritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("x", torch.empty(3))

    def reset_parameters(self) -> None:  # recomputes nothing
        pass


def test_a_recomputation_that_leaves_a_buffer_unwritten_is_refused():
    model = hp.models.load("tests.test_meta_build:_Unwritten").module
    # never written in __init__: it holds no value (Note [parameters on meta, buffers real])
    assert model.x.is_meta
    with pytest.raises(ConfigError, match=r"buffer 'x' of _Unwritten .* left it unwritten"):
        materialize_(model, "cpu")


# ---- parameters of any rank (Note [any rank]) ----------------------------------------------------


def documented(shape: tuple[int, ...], name: str, std: float, seed: int = 0) -> torch.Tensor:
    """The documented init, written out: rows in chunks of CHUNK_ROWS, each chunk one randn(rows,
    rest) block."""
    rows, rest = shape[0], math.prod(shape[1:])
    blocks = [
        torch.randn(
            min(CHUNK_ROWS, rows - first),
            rest,
            generator=torch.Generator().manual_seed(_seed(seed, name, c)),
        )
        for c, first in enumerate(range(0, rows, CHUNK_ROWS))
    ]
    return (torch.cat(blocks) * std).view(shape)


@pytest.mark.parametrize("shape", [(5,), (300, 7), (3, 4, 5), (300, 2, 3), (2, 3, 3, 3)])
def test_any_rank_draws_the_documented_values_and_slices_agree(shape):
    whole = torch.empty(shape)
    fill_(whole, ("normal", 0.5), "w", ShardLayout(full_shape=shape), seed=2)
    # Bitwise: `documented` draws the very blocks fill_ draws (same generator seeds, same randn
    # shapes, so the same CPU kernel) and scales them by one exactly-rounded multiply; slices copy
    # values, computing nothing.
    assert torch.equal(whole, documented(shape, "w", 0.5, seed=2))
    if len(shape) > 1:
        # two row ranges, as a fused [q | k | v]
        rows, cols = ((0, 1), (shape[0] - 1, shape[0])), (1, shape[1])
        part = torch.empty(2, shape[1] - 1, *shape[2:])
        fill_(
            part, ("normal", 0.5), "w", ShardLayout(full_shape=shape, rows=rows, cols=cols), seed=2
        )
        assert torch.equal(part, torch.cat([whole[:1, 1:], whole[-1:, 1:]]))


class Experts(nn.Module):
    """Fused expert weights, (num_experts, hidden, ffn), as Mixtral-style MoE layers hold them."""

    def __init__(self, experts: int = 4, hidden: int = 8, ffn: int = 12):
        super().__init__()
        self.up = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.gate = nn.Parameter(torch.empty(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bh,ehf->bef", x, self.up) * self.gate


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 2, 3)
        self.head = nn.Linear(2 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv2(F.relu(self.conv1(x)))).flatten(1))


def test_conv_and_expert_weights_materialise_to_the_documented_init():
    with torch.device("meta"):
        cnn, experts = SmallCNN(), Experts()
    materialize_(cnn, "cpu", seed=4)
    materialize_(experts, "cpu", seed=4)
    # Bitwise for the reason test_any_rank_draws_the_documented_values_and_slices_agree gives.
    assert torch.equal(cnn.conv1.weight, documented((4, 3, 3, 3), "conv1.weight", 0.02, seed=4))
    assert torch.equal(cnn.head.weight, documented((5, 32), "head.weight", 0.02, seed=4))
    assert torch.count_nonzero(cnn.conv2.bias) == 0
    assert torch.equal(experts.up, documented((4, 8, 12), "up", 0.02, seed=4))
    assert experts.gate.item() == 1.0  # a scalar weight starts at one


def test_a_world_of_one_trains_a_cnn_as_the_reference(world_of_one):
    with torch.device("meta"):
        model, reference = SmallCNN(), SmallCNN()
    images = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(0))
    targets = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    plan = hp.plan(model, CPU1, 4, None, "fp32", example_inputs=images, dp=1, tp=1, pp=1)
    pmodel = hp.parallelize(model, plan, example_inputs=images, seed=7, device="cpu")
    loss = pmodel.train_step(images, targets, F.mse_loss)
    # built the same way: the same draws, so bitwise (no step was taken)
    materialize_(reference, "cpu", seed=7)
    for name, param in reference.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name
    ref_loss = F.mse_loss(reference(images), targets)
    ref_loss.backward()
    _assert_same_step(model, reference, loss, ref_loss)
