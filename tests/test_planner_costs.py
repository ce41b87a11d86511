"""The cost model's formulas against hand-computed values."""

from __future__ import annotations

import pytest

import hyparallel as hp
from hyparallel.cluster import LinkSpec
from hyparallel.planner import costs
from hyparallel.planner.profile import ModelProfile

LINK = LinkSpec(name="test", bandwidth_bytes_per_s=100e9, latency_s=10e-6)


def test_collectives():
    # Ring all-reduce of 1 GB over 8 ranks: 2*7 steps of 10 us, and 2*7/8 of the bytes at 100 GB/s.
    assert costs.ring_allreduce_s(1e9, 8, LINK) == pytest.approx(14 * 10e-6 + 1.75 * 1e9 / 100e9)
    assert costs.ring_allgather_s(1e9, 8, LINK) == pytest.approx(7 * 10e-6 + 0.875 * 1e9 / 100e9)
    assert costs.ring_reduce_scatter_s(1e9, 4, LINK) == pytest.approx(3 * 10e-6 + 0.75 * 1e9 / 100e9)
    assert costs.p2p_s(1e6, LINK) == pytest.approx(10e-6 + 1e-5)
    assert costs.ring_allreduce_s(1e9, 1, LINK) == 0 and costs.ring_allreduce_s(0, 8, LINK) == 0
    # All-reduce = reduce-scatter + all-gather (the identity sequence parallelism relies on).
    assert costs.ring_allreduce_s(3e8, 4, LINK) == pytest.approx(
        costs.ring_reduce_scatter_s(3e8, 4, LINK) + costs.ring_allgather_s(3e8, 4, LINK)
    )


def test_roofline():
    # 1 TFLOP at 100 TFLOP/s x 0.5 = 20 ms; 1 GB at 1 TB/s x 0.8 = 1.25 ms: compute-bound.
    assert costs.roofline_s(1e12, 1e9, 100e12, 0.5, 1e12, 0.8) == pytest.approx(0.02)
    # 1 GFLOP over 10 GB: memory-bound, 12.5 ms.
    assert costs.roofline_s(1e9, 10e9, 100e12, 0.5, 1e12, 0.8) == pytest.approx(0.0125)


def test_nothing_hides_behind_compute_on_a_cpu():
    assert costs.overlapped_s(2.0, 5.0, serial=True) == 2.0
    assert costs.overlapped_s(2.0, 5.0) == pytest.approx(costs.OVERLAP_CONTENTION * 2.0)


def test_overlap_charges_contention():
    assert costs.overlapped_s(1.0, 3.0) == pytest.approx(costs.OVERLAP_CONTENTION * 1.0)
    assert costs.overlapped_s(3.0, 1.0) == pytest.approx(2.0 + costs.OVERLAP_CONTENTION * 1.0)


def test_bubble_and_inflight_microbatches():
    assert costs.bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert costs.bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)
    assert [costs.inflight_microbatches("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [costs.inflight_microbatches("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    assert costs.inflight_microbatches("gpipe", 4, 8, 3) == 8
    # Megatron-LM interleaving, p=4, v=2, m=8: stage 0 warms up 2*3 + 1*4 = 10 chunks, +1 in steady state.
    assert costs.inflight_microbatches("interleaved-1f1b", 4, 8, 0, 2) == pytest.approx(11 / 2)
    assert costs.inflight_microbatches("interleaved-1f1b", 4, 8, 3, 2) == pytest.approx(5 / 2)
    assert costs.inflight_microbatches("1f1b", 1, 8, 0) == 1


def test_zero_state_bytes():
    # bf16 under autocast: 4 (fp32 weight) + 2 (its bf16 copy) + 4 (fp32 grad) + 8 (AdamW m, v) = 18 bytes.
    assert costs.state_bytes_per_param("bf16", 0, 8) == 18
    # ZeRO 1 as parallelize runs it: fp32 weights gathered through the step + a bf16 copy + whole fp32 gradients,
    # sharded fp32 master weights and AdamW m, v.
    assert costs.state_bytes_per_param("bf16", 1, 8) == 4 + 2 + 4 + (4 + 8) / 8
    assert costs.state_bytes_per_param("bf16", 2, 8) == 4 + 2 + (4 + 4 + 8) / 8
    assert costs.state_bytes_per_param("bf16", 3, 8) == 16 / 8  # shards only; the gathered units are the search's
    assert costs.state_bytes_per_param("bf16", 3, 1) == 18  # nothing to shard over
    assert costs.state_bytes_per_param("fp32", 0, 1) == 4 + 4 + 8
    assert costs.adam_step_bytes_per_param("bf16") == 30 and costs.adam_step_bytes_per_param("fp32") == 28


def test_korthikanti_reference_formula():
    s, b, h, a = 2048, 1, 12288, 96
    assert costs.korthikanti_activation_bytes(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert costs.korthikanti_activation_bytes(s, b, h, a, tp=8, sequence_parallel=True) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h) / 8
    )
    assert (
        costs.korthikanti_activation_bytes(s, b, h, a, tp=8, recompute="full", sequence_parallel=True)
        == 2 * s * b * h / 8
    )


def test_model_flops_match_megatron():
    # 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per step (Narayanan et al. 2021, eq. 3 without recomputation: 3x forward).
    model = hp.models.build("gpt-1.3b")
    graph = hp.trace(model, model.example_inputs(1, 2048))
    cfg, batch, s = model.config, 512, 2048
    h, L, V = cfg.hidden_size, cfg.num_layers, cfg.vocab_size
    megatron = 72 * batch * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert costs.model_flops_per_step(graph.flops, batch) == pytest.approx(megatron, rel=1e-12)


@pytest.fixture(scope="module")
def gpt_profile():
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    return ModelProfile(graph, hp.ClusterSpec.preset("a100-80g"), "bf16", 16)


def test_activation_bytes_of_a_gpt_layer(gpt_profile):
    # Tensors a zoo GPT block keeps for backward (bf16, s=16, h=64, 4 heads), by hand:
    #   attn_norm input 2sh, qkv input 2sh, attention q/k/v (views of the qkv output) 6sh + its output 2sh
    #   + fp32 log-sum-exp 4*a*s bytes, projection input (a copy after the transpose) 2sh, dropout mask sh,
    #   mlp_norm input 2sh, fc input 2sh, GeLU input 8sh, projection input 8sh, dropout mask sh: 36 sh in all.
    s, h, a = 16, 64, 4
    by_hand = 36 * s * h + 4 * a * s
    link = gpt_profile.cluster.intra_node
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    assert gpt_profile.segment_costs(1, False, 1, "none", link)[block].activation_bytes == by_hand
    assert gpt_profile.segment_costs(1, False, 3, "none", link)[block].activation_bytes == 3 * by_hand
    # tp=2: what lies between the column and row Linears is split (Korthikanti's 24/t part; ours 26/t),
    # the rest (norm inputs and outputs, residual, masks: 10 sh) is replicated, unless sequence parallel.
    split = 26 * s * h + 4 * a * s
    assert gpt_profile.segment_costs(2, False, 1, "none", link)[block].activation_bytes == 10 * s * h + split / 2
    assert gpt_profile.segment_costs(2, True, 1, "none", link)[block].activation_bytes == by_hand / 2
    # Full recomputation keeps only the block's input (the hidden state, 2sh), plus one block while recomputing.
    full = gpt_profile.segment_costs(1, False, 1, "full", link)[block]
    assert full.activation_bytes == 2 * s * h and full.working_bytes == by_hand


def test_tp_communication_of_a_gpt_layer(gpt_profile):
    # Megatron pairs: forward all-reduce after attention and MLP projections, backward before qkv and fc:
    # 4 x (s*h*2 bytes).
    link = gpt_profile.cluster.intra_node
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    cost = gpt_profile.segment_costs(4, False, 2, "none", link)[block]
    assert cost.tp_comm_s == pytest.approx(4 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, link))
    recomputed = gpt_profile.segment_costs(4, False, 2, "full", link)[block]
    assert recomputed.tp_comm_s == pytest.approx(6 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, link))


def test_parameters_per_rank(gpt_profile):
    link = gpt_profile.cluster.intra_node
    h, f, layers = 64, 256, 2
    total = sum(s.params for s in gpt_profile.segment_costs(1, False, 1, "none", link))
    assert total == gpt_profile.graph.num_params
    per_rank = sum(s.params for s in gpt_profile.segment_costs(2, False, 1, "none", link))
    # Split: qkv and fc (weights and biases), the row Linears' weights, the vocab-parallel embedding.
    split = layers * (3 * h * h + 3 * h + h * f + f + h * h + f * h) + 256 * h
    assert per_rank == pytest.approx(total - split / 2)


def test_every_group_decides_the_link():
    from hyparallel.planner.search import axis_link

    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=3)  # 24 GPUs, 8 per node
    # tp=3: groups (0,1,2) .. (6,7,8): the third group crosses a node boundary.
    assert axis_link(("pp", "dp", "tp"), {"pp": 1, "dp": 8, "tp": 3}, "tp", cluster) == cluster.inter_node
    assert axis_link(("pp", "dp", "tp"), {"pp": 3, "dp": 1, "tp": 8}, "tp", cluster) == cluster.intra_node
    # dp groups of 3 ranks 2 apart (0,2,4), (6,8,10): the second crosses.
    assert axis_link(("pp", "dp", "tp"), {"pp": 4, "dp": 3, "tp": 2}, "dp", cluster) == cluster.inter_node
    assert axis_link(("pp", "dp", "tp"), {"pp": 3, "dp": 4, "tp": 2}, "dp", cluster) == cluster.intra_node


def test_seq_by_seq_tensors_come_from_dataflow_not_shapes():
    # hidden == seq makes every (1, seq, hidden) activation look seq x seq; only attention scores are.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 64))  # hidden 64
    assert not ModelProfile(graph, hp.ClusterSpec.preset("cpu"), "fp32", 64).has_quadratic
    # Bloom writes attention out with baddbmm/softmax/bmm: its scores are kept, and selective recomputation drops them.
    bloom = hp.models.load("hf:bloom n_layer=2 hidden_size=128 n_head=4 vocab_size=1000").module
    profile = ModelProfile(
        hp.trace(bloom, hp.models.example_inputs(bloom, 1, 48)), hp.ClusterSpec.preset("cpu"), "fp32", 48
    )
    block = next(i for i, s in enumerate(profile.segments) if s.is_block)
    link = profile.cluster.intra_node
    none, selective = (profile.segment_costs(1, False, 1, r, link)[block] for r in ("none", "selective"))
    scores = 4 * 48 * 48 * 4  # one (heads, seq, seq) fp32 tensor
    assert none.activation_bytes - selective.activation_bytes >= 2 * scores  # softmax output, dropout output at least
    assert selective.backward_s > none.backward_s


def test_op_overhead_is_a_floor_on_a_gpu_and_adds_on_a_cpu():
    assert costs.dispatched_s(2e-6, 1e-5, serial=False) == 1e-5  # a short kernel waits for its launch
    assert costs.dispatched_s(3e-3, 1e-5, serial=False) == 3e-3  # a long one hides the next launch
    assert costs.dispatched_s(2e-6, 1e-5, serial=True) == pytest.approx(1.2e-5)


def test_op_overhead_costs_every_dispatched_op_on_a_cpu():
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))

    def forward_s(overhead: float) -> float:
        cluster = hp.ClusterSpec.preset("cpu")
        cluster = cluster.model_copy(update={"device": cluster.device.model_copy(update={"op_overhead_s": overhead})})
        profile = ModelProfile(graph, cluster, "fp32", 16)
        return sum(s.forward_s for s in profile.segment_costs(1, False, 1, "none", cluster.intra_node))

    from hyparallel.planner.profile import _COPYING_VIEWS

    kernels = sum(
        1 for op in graph.compute_ops() if op.kind != "view" or op.target in _COPYING_VIEWS
    )  # aliases are free
    assert forward_s(1e-3) - forward_s(0.0) == pytest.approx(kernels * 1e-3, rel=1e-6)


def test_the_loss_keeps_fp32_log_probabilities_and_briefly_the_logits_twice():
    # Note [the loss's memory]: 4 bytes per logit saved; while the loss runs, the logits (2 in bf16) and their
    # fp32 copy (4) too.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    logits = 16 * model.config.vocab_size
    for dtype, transient in (("bf16", 6), ("fp32", 4)):
        cluster = hp.ClusterSpec.preset("a100-80g")
        last = ModelProfile(graph, cluster, dtype, 16).segment_costs(1, False, 2, "none", cluster.intra_node)[-1]
        assert last.working_bytes == pytest.approx(2 * logits * transient)
        assert last.activation_bytes >= 2 * logits * 4
