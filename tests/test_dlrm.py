"""The DLRM zoo models (hyparallel/models/dlrm.py): shapes, meta build, synthetic click log,
training, tracing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import hyparallel as hp
from hyparallel.models.dlrm import DLRM, DLRMConfig, batch_for, bce_loss, synthetic_clicks
from hyparallel.models.zoo import CRITEO_TB_ROWS
from hyparallel.spec.errors import ModelSpecError
from hyparallel.tensor.init import materialize_

DLRM_PRESETS = ["dlrm-tiny", "dlrm-mid", "dlrm-criteo-tb"]


def mlp_params(widths: list[int]) -> int:
    return sum(i * o + o for i, o in zip(widths, widths[1:]))


def test_forward_shapes_and_gradients():
    torch.manual_seed(0)
    model = hp.models.build("dlrm-tiny", device="cpu")
    cfg = model.config
    dense, sparse, clicks = batch_for(cfg, 16, 0)
    assert dense.shape == (16, 4) and dense.dtype == torch.float32
    assert sparse.shape == (16, 4, 2) and sparse.dtype == torch.int64
    assert clicks.shape == (16,) and clicks.dtype == torch.float32
    logits = model(dense, sparse)
    assert logits.shape == (16,) and torch.isfinite(logits).all()
    # bottom output and the 10 pairs of 5 vectors
    assert model.top[0].in_features == cfg.dim + 5 * 4 // 2
    bce_loss(logits, clicks).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_interaction_is_facebooks_dot():
    # dlrm_s_pytorch.py's interact_features with --arch-interaction-op=dot (arch_interaction_itself
    # off).
    torch.manual_seed(0)
    model = hp.models.build("dlrm-tiny", device="cpu")
    dense, sparse, _ = batch_for(model.config, 8, 1)
    x = model.bottom(dense)
    ly = [model.tables[t](sparse[:, t, :]) for t in range(4)]
    vectors = torch.cat([x] + ly, dim=1).view(8, -1, model.config.dim)
    z = torch.bmm(vectors, vectors.transpose(1, 2))
    li = torch.tensor([i for i in range(5) for j in range(i)])
    lj = torch.tensor([j for i in range(5) for j in range(i)])
    expected = model.top(torch.cat([x, z[:, li, lj]], dim=1)).squeeze(1)
    torch.testing.assert_close(model(dense, sparse), expected)


def test_tables_init_uniform_by_seed():
    torch.manual_seed(3)
    first = hp.models.build("dlrm-tiny", device="cpu")
    torch.manual_seed(3)
    second = hp.models.build("dlrm-tiny", device="cpu")
    for a, b in zip(first.parameters(), second.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for table in first.tables:
        assert table.weight.abs().max() <= 1 / math.sqrt(table.num_embeddings)
        assert table.mode == "sum"


def test_criteo_tb_builds_on_meta_with_its_parameter_count():
    model = hp.models.build("dlrm-criteo-tb")
    assert all(p.is_meta for p in model.parameters())
    # the interaction's pair indices only
    assert sum(b.numel() for b in model.buffers()) == 27 * 26 // 2
    mlps = mlp_params([13, 512, 256, 128]) + mlp_params(
        [128 + 27 * 26 // 2, 1024, 1024, 512, 256, 1]
    )
    expected = sum(CRITEO_TB_ROWS) * 128 + mlps
    assert (
        sum(p.numel() for p in model.parameters())
        == expected
        == hp.models.config("dlrm-criteo-tb").num_params()
    )
    assert len(CRITEO_TB_ROWS) == 26 and sum(CRITEO_TB_ROWS) == 187_767_399


def test_config_overrides_and_refusals():
    # YAML lists become tuples
    model = hp.models.build("dlrm-tiny", table_rows=[10, 20], bottom=[8, 8])
    assert (
        model.config.table_rows == (10, 20)
        and len(model.tables) == 2
        and model.config.bottom == (8, 8)
    )
    with pytest.raises(ModelSpecError, match="dim must be an integer"):
        hp.models.build("dlrm-tiny", dim=0)
    with pytest.raises(ModelSpecError, match="table_rows"):
        hp.models.build("dlrm-tiny", table_rows=[])
    with pytest.raises(ValueError, match="table_rows entry"):
        DLRMConfig(num_dense=1, table_rows=(0,), dim=1, bottom=(), top=())


def test_batch_for_is_deterministic_and_differs_per_index():
    cfg = hp.models.config("dlrm-mid")
    first, again = batch_for(cfg, 32, 5), batch_for(cfg, 32, 5)
    for a, b in zip(first, again):
        # exact: the same numpy generator, seed and calls regenerate the same draws
        assert torch.equal(a, b)
    for other in (batch_for(cfg, 32, 6), batch_for(cfg, 32, 5, seed=1)):
        assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    assert torch.equal(
        synthetic_clicks(cfg, 32, 1_000_003 + 5)[0], batch_for(cfg, 32, 5, seed=1)[0]
    )
    assert set(first[2].unique().tolist()) <= {0.0, 1.0}


def test_ids_in_range_and_zipf_skewed():
    cfg = hp.models.config("dlrm-mid")
    _, sparse, clicks = synthetic_clicks(cfg, 4096, seed=7)
    rows = torch.tensor(cfg.table_rows)[None, :, None]
    assert (sparse >= 0).all() and (sparse < rows).all()
    # 200,000 rows: a uniform draw of 16,384 ids repeats almost none
    ids = sparse[:, 0, :].flatten()
    uniform = ids.numel() / cfg.table_rows[0]
    assert torch.bincount(ids).max() > 1000 * uniform
    assert 0.2 < clicks.mean() < 0.8  # both outcomes common
    _, huge, _ = synthetic_clicks(hp.models.config("dlrm-criteo-tb"), 256, seed=0)
    assert (huge < torch.tensor(CRITEO_TB_ROWS)[None, :, None]).all()


def test_tiny_trains_below_log2():
    # Measured: the mean BCE of the last 20 of 150 steps is 0.490-0.522 over torch seeds and logs
    # 0-2 (the hidden model's own BCE is ~0.47; a constant guess scores log 2 = 0.693). 0.60 leaves
    # room for another platform.
    torch.manual_seed(0)
    model = hp.models.build("dlrm-tiny", device="cpu")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    losses = []
    for step in range(150):
        dense, sparse, clicks = batch_for(model.config, 64, step)
        loss = bce_loss(model(dense, sparse), clicks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert np.mean(losses[-20:]) < 0.60 < math.log(2)


@pytest.mark.parametrize("name", DLRM_PRESETS)
def test_example_inputs_trace_on_meta(name):
    model = hp.models.build(name)
    dense, sparse = hp.models.example_inputs(model, 4, 1)
    cfg = model.config
    assert (
        dense.shape == (4, cfg.num_dense)
        and sparse.shape == (4, cfg.num_tables, cfg.bag)
        and dense.is_meta
    )
    graph = hp.trace(model, (dense, sparse))
    assert graph.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert graph.num_params == cfg.num_params()
    bags = [op for op in graph.ops if op.target == "EmbeddingBag"]
    assert [op.param_bytes for op in bags] == [rows * cfg.dim * 4 for rows in cfg.table_rows]
    for op in bags:
        assert op.kind == "embedding" and op.output_bytes == 4 * cfg.dim * 4
        assert op.flops == 4 * cfg.bag * cfg.dim  # Note [embedding bag FLOPs]


def test_export_trace_counts_bag_flops_too():
    model = hp.models.build("dlrm-tiny")
    graph = hp.trace(model, model.example_inputs(4), method="export")
    bags = [op for op in graph.ops if op.target == "EmbeddingBag"]
    assert len(bags) == 4 and all(op.flops == 4 * 2 * 8 for op in bags)
    assert graph.flops == hp.trace(model, model.example_inputs(4), method="fx").flops


def test_zoo_rows():
    rows = {row.name: row for row in hp.models.entries()}
    assert (
        rows["dlrm-criteo-tb"].family == "dlrm" and rows["dlrm-criteo-tb"].vocab_size == 187_767_399
    )
    assert rows["dlrm-mid"].num_params == hp.models.config("dlrm-mid").num_params()
    assert isinstance(hp.models.build("dlrm-tiny"), DLRM)


def test_materialised_from_meta_draws_at_the_eager_scale():
    # materialize_ draws N(0, init_std): the std of the eager uniform init, 1/sqrt(3 * fan).
    model = materialize_(hp.models.build("dlrm-mid"), "cpu")
    for name, fan in (
        ("tables.0.weight", 200_000),
        ("top.0.weight", model.config.interaction_width),
    ):
        std = model.get_parameter(name).std().item()
        assert abs(std * math.sqrt(3 * fan) - 1) < 0.05, name
