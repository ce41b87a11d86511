"""Models built on meta come out exactly as a CPU build makes them: buffers computed in ``__init__`` (Note
[parameters on meta, buffers real]), or a one-line refusal."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hyparallel as hp
from hyparallel.errors import ConfigError
from hyparallel.tensor.init import materialize_

VOCAB, HIDDEN, SEQ = 32, 16, 8
HF_GEMMA_TINY = (
    "hf:GemmaForCausalLM num_hidden_layers=1 hidden_size=64 num_attention_heads=4 num_key_value_heads=2 head_dim=16 "
    "intermediate_size=128 vocab_size=128 max_position_embeddings=64 bos_token_id=0 eos_token_id=0 pad_token_id=0"
)
CPU1 = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=1)


class ScaledEmbedding(nn.Embedding):
    """An embedding whose output is scaled by a buffer computed in ``__init__`` (Gemma's shape)."""

    def __init__(self, num: int, dim: int):
        super().__init__(num, dim)
        self.register_buffer("scale", torch.tensor(dim**0.5) / 3, persistent=False)
        self.register_buffer("table", torch.empty(SEQ, dim), persistent=False)  # filled in place, as rotary tables
        self.table.copy_(torch.sin(torch.arange(SEQ * dim, dtype=torch.float32).view(SEQ, dim) / 7))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * self.scale + self.table[: idx.size(1)]


class ScaledLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ScaledEmbedding(VOCAB, HIDDEN)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)), persistent=False)  # a causal mask
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        t = idx.size(1)
        mixed = (self.mask[:t, :t] / self.mask[:t, :t].sum(-1, keepdim=True)) @ x  # causal mean of the prefix
        return self.head(mixed)

    def example_inputs(self, batch_size: int, seq_len: int, device) -> torch.Tensor:
        return torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)


def make_scaled() -> ScaledLM:
    """The factory ``tests.test_meta_build:make_scaled``."""
    return ScaledLM()


def _reference_step(reference: nn.Module, trained: nn.Module, inputs, targets, loss_fn):
    """Load ``trained``'s weights into the CPU-built ``reference`` (its buffers its own), one forward and backward."""
    reference.load_state_dict({n: p.detach() for n, p in trained.named_parameters()}, strict=False)
    loss = loss_fn(reference(inputs), targets)
    loss.backward()
    return loss


def _assert_same_step(model: nn.Module, reference: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor) -> None:
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
        assert torch.equal(model.get_buffer(name), buf), name  # the same code computed both: bitwise
    assert model.emb.scale.item() == pytest.approx(HIDDEN**0.5 / 3)


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
    assert torch.equal(model.model.embed_tokens.embed_scale, torch.tensor(64**0.5))
    assert torch.equal(model.model.embed_tokens.embed_scale, reference.model.embed_tokens.embed_scale)
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
    with pytest.raises(ConfigError, match=r"^materialize: buffer 'mask' of ScaledLM is on the meta device") as e:
        hp.parallelize(model, plan, device="cpu")
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()  # refused before the first collective
    with pytest.raises(ConfigError, match=r"^materialize: buffer 'scale' of ScaledEmbedding is on the meta device"):
        materialize_(model.emb, "cpu")  # a module with parameters: nothing recomputes its buffer


def test_rotary_tables_of_a_users_meta_build_are_still_recomputed():
    with torch.device("meta"):
        model = hp.models.Llama(hp.models.config("llama-tiny"))
    materialize_(model, "cpu")
    torch.testing.assert_close(model.rope.cos, hp.models.build("llama-tiny", device="cpu").rope.cos, rtol=0, atol=0)


class _Unwritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("x", torch.empty(3))

    def reset_parameters(self) -> None:  # recomputes nothing
        pass


def test_a_recomputation_that_leaves_a_buffer_unwritten_is_refused():
    model = hp.models.load("tests.test_meta_build:_Unwritten").module
    assert model.x.is_meta  # never written in __init__: it holds no value (Note [parameters on meta, buffers real])
    with pytest.raises(ConfigError, match=r"buffer 'x' of _Unwritten .* left it unwritten"):
        materialize_(model, "cpu")
