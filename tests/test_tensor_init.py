"""Deterministic slice-by-slice initialisation: any slice equals the same slice of the full
parameter."""

from __future__ import annotations

import torch

import hyparallel as hp
from hyparallel.tensor.init import CHUNK_ROWS, ShardLayout, fill_, materialize_


def full(shape, name="w", std=0.5, seed=3):
    tensor = torch.empty(shape)
    fill_(tensor, ("normal", std), name, ShardLayout(full_shape=shape), seed)
    return tensor


# Exact comparisons below are safe: a slice and the whole parameter draw the same CHUNK_ROWS-row
# blocks from the same generators with the same kernel in this process, so the values are the very
# same numbers, not a rounding.
def test_slices_equal_the_full_parameter():
    shape = (2 * CHUNK_ROWS + 37, 40)
    whole = full(shape)
    assert whole.std().item() == torch.tensor(0.5).item() or abs(whole.std().item() - 0.5) < 0.02
    rows = ((100, 300), (CHUNK_ROWS * 2, shape[0]))  # two ranges, like a fused [q | k | v] split
    part = torch.empty(200 + 37, 20)
    fill_(
        part, ("normal", 0.5), "w", ShardLayout(full_shape=shape, rows=rows, cols=(10, 30)), seed=3
    )
    torch.testing.assert_close(
        part, torch.cat([whole[100:300, 10:30], whole[2 * CHUNK_ROWS :, 10:30]]), rtol=0, atol=0
    )


def test_vocabulary_padding_is_zero():
    shape = (250, 8)
    whole = full(shape, name="emb")
    last = torch.empty(63, 8)  # rank 3 of tp 4: rows 189..251, of which 250 and 251 are padding
    fill_(last, ("normal", 0.5), "emb", ShardLayout(full_shape=shape, rows=((189, 252),)), seed=3)
    torch.testing.assert_close(last[:61], whole[189:], rtol=0, atol=0)
    assert torch.count_nonzero(last[61:]) == 0


def test_streams_differ_by_name_and_seed():
    assert not torch.equal(full((8, 8), name="a"), full((8, 8), name="b"))
    assert not torch.equal(full((8, 8), seed=1), full((8, 8), seed=2))
    assert torch.equal(full((8, 8)), full((8, 8)))


def test_materialize_follows_the_model_rules():
    model = materialize_(hp.models.build("gpt-tiny", num_layers=4), "cpu", seed=0)
    assert torch.equal(model.layers[0].attn_norm.weight, torch.ones(64))
    assert torch.count_nonzero(model.layers[0].mlp.fc.bias) == 0
    big = model.layers[0].mlp.fc.weight.std().item()
    residual = model.layers[0].mlp.proj.weight.std().item()  # scaled by 1/sqrt(2 * 4 layers)
    assert abs(big - 0.02) < 0.003 and abs(residual - 0.02 / 8**0.5) < 0.001
    assert model.output.weight is model.tok_embeddings.weight
    llama = materialize_(hp.models.build("llama-tiny"), "cpu")
    torch.testing.assert_close(llama.rope.cos, hp.models.build("llama-tiny", device="cpu").rope.cos)
