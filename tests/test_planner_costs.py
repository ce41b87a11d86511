"""The cost model's formulas against hand-computed values."""

from __future__ import annotations

import pytest

import hyparallel as hp
from hyparallel.pipeline.schedule import lower, schedule, send_window
from hyparallel.planner import costs, inflight
from hyparallel.planner.inflight import backward_sends_held
from hyparallel.planner.profile import ModelProfile
from hyparallel.spec.cluster import LinkSpec

LINK = LinkSpec(name="test", bandwidth_bytes_per_s=100e9, latency_s=10e-6)


def test_collectives():
    # Ring all-reduce of 1 GB over 8 ranks: 2*7 steps of 10 us, and 2*7/8 of the bytes at 100 GB/s.
    assert costs.ring_allreduce_s(1e9, 8, LINK) == pytest.approx(14 * 10e-6 + 1.75 * 1e9 / 100e9)
    assert costs.ring_allgather_s(1e9, 8, LINK) == pytest.approx(7 * 10e-6 + 0.875 * 1e9 / 100e9)
    assert costs.ring_reduce_scatter_s(1e9, 4, LINK) == pytest.approx(
        3 * 10e-6 + 0.75 * 1e9 / 100e9
    )
    assert costs.p2p_s(1e6, LINK) == pytest.approx(10e-6 + 1e-5)
    assert costs.ring_allreduce_s(1e9, 1, LINK) == 0 and costs.ring_allreduce_s(0, 8, LINK) == 0
    # All-reduce = reduce-scatter + all-gather (the identity sequence parallelism relies on).
    assert costs.ring_allreduce_s(3e8, 4, LINK) == pytest.approx(
        costs.ring_reduce_scatter_s(3e8, 4, LINK) + costs.ring_allgather_s(3e8, 4, LINK)
    )


def test_a_collectives_own_step_latency_prices_its_steps_and_not_a_send():
    # Note [a collective's latency] in calibrate.py: gloo's all-reduce pays more per step than a
    # send/recv.
    slow = LINK.model_copy(update={"collective_latency_s": 1e-3})
    assert costs.ring_allreduce_s(1e9, 8, slow) == pytest.approx(14 * 1e-3 + 1.75 * 1e9 / 100e9)
    assert costs.ring_allgather_s(1e9, 8, slow) == pytest.approx(7 * 1e-3 + 0.875 * 1e9 / 100e9)
    assert costs.p2p_s(1e6, slow) == costs.p2p_s(1e6, LINK)


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
    assert [inflight.inflight_microbatches("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert [inflight.inflight_microbatches("1f1b", 4, 2, s) for s in range(4)] == [2, 2, 2, 1]
    assert inflight.inflight_microbatches("gpipe", 4, 8, 3) == 8
    # Megatron-LM interleaving, p=4, v=2, m=8: stage 0 warms up 2*3 + 1*4 = 10 chunks, +1 in steady
    # state.
    assert inflight.inflight_microbatches("interleaved-1f1b", 4, 8, 0, 2) == pytest.approx(11 / 2)
    assert inflight.inflight_microbatches("interleaved-1f1b", 4, 8, 3, 2) == pytest.approx(5 / 2)
    assert inflight.inflight_microbatches("1f1b", 1, 8, 0) == 1


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_the_memory_models_send_bound_is_the_one_the_runtime_reads_off_its_program(kind):
    # The runtime holds at most schedule.send_window(program) gradients sent back (Note [gradients
    # sent back]); the planner counts inflight.backward_sends_held by formula: equal for every
    # device of every shape here.
    for pp, m in [(2, 1), (2, 4), (4, 2), (4, 8), (8, 8)]:
        for v in [1] if kind != "interleaved-1f1b" else [2, 3]:
            if kind == "interleaved-1f1b" and m % pp:
                continue
            programs = lower(schedule(kind, pp, m, v), pp, v)
            for rank in range(pp):
                assert backward_sends_held(kind, pp, m, rank, v) == send_window(programs[rank]), (
                    pp,
                    m,
                    v,
                    rank,
                )


def test_zero_state_bytes():
    # bf16 under autocast: 4 (fp32 weight) + 2 (its bf16 copy) + 4 (fp32 grad) + 8 (AdamW m, v) = 18
    # bytes; with dp > 1 DDP's fp32 gradient buckets add 4 (costs.DDP_BUCKET_BYTES_PER_PARAM).
    assert costs.state_bytes_per_param("bf16", 0, 1) == 18
    assert costs.state_bytes_per_param("bf16", 0, 8) == 18 + 4
    # ZeRO 1 as parallelize runs it: fp32 weights gathered through the step + a bf16 copy + whole
    # fp32 gradients, sharded fp32 master weights and AdamW m, v.
    assert costs.state_bytes_per_param("bf16", 1, 8) == 4 + 2 + 4 + (4 + 8) / 8
    assert costs.state_bytes_per_param("bf16", 2, 8) == 4 + 2 + (4 + 4 + 8) / 8
    # shards only; the gathered units are the search's
    assert costs.state_bytes_per_param("bf16", 3, 8) == 16 / 8
    assert costs.state_bytes_per_param("bf16", 3, 1) == 18  # nothing to shard over
    assert costs.state_bytes_per_param("fp32", 0, 1) == 4 + 4 + 8
    assert (
        costs.adam_step_bytes_per_param("bf16") == 30
        and costs.adam_step_bytes_per_param("fp32") == 28
    )


def test_korthikanti_reference_formula():
    s, b, h, a = 2048, 1, 12288, 96
    assert costs.korthikanti_activation_bytes(s, b, h, a) == pytest.approx(
        s * b * h * (34 + 5 * a * s / h)
    )
    assert costs.korthikanti_activation_bytes(
        s, b, h, a, tp=8, sequence_parallel=True
    ) == pytest.approx(s * b * h * (34 + 5 * a * s / h) / 8)
    assert (
        costs.korthikanti_activation_bytes(
            s, b, h, a, tp=8, recompute="full", sequence_parallel=True
        )
        == 2 * s * b * h / 8
    )


def test_model_flops_match_megatron():
    # 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per step (Narayanan et al. 2021, eq. 3 without
    # recomputation: 3x forward).
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
    # Tensors a zoo GPT block keeps for backward (bf16, s=16, h=64, 4 heads), by hand. Under
    # autocast the residual stream stays fp32 (Note [fp32 under autocast]): the embedding and every
    # residual add make fp32, so each norm saves a 4-byte input and the Linear after it a 2-byte
    # cast of the norm's fp32 output:
    #   attn_norm input 4sh, qkv input (the cast) 2sh, attention q/k/v (views of the qkv output) 6sh
    #   + its output 2sh + fp32 log-sum-exp 4*a*s bytes, projection input (a copy after the
    #   transpose) 2sh, dropout mask sh, mlp_norm input 4sh, fc input (the cast) 2sh, GeLU input
    #   8sh, projection input 8sh, dropout mask sh: 40 sh; and each norm's fp32 mean and reciprocal
    #   std per row, 8s bytes each.
    s, h, a = 16, 64, 4
    stats = 2 * 8 * s
    by_hand = 40 * s * h + 4 * a * s + stats
    link = gpt_profile.cluster.intra_node
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    assert gpt_profile.segment_costs(1, False, 1, "none", link)[block].activation_bytes == by_hand
    assert (
        gpt_profile.segment_costs(1, False, 3, "none", link)[block].activation_bytes == 3 * by_hand
    )
    # tp=2: what lies between the column and row Linears is split (Korthikanti's 24/t part; ours
    # 26/t), the rest (norm inputs and their casts, masks: 14 sh) is replicated, unless sequence
    # parallel.
    split = 26 * s * h + 4 * a * s
    assert gpt_profile.segment_costs(2, False, 1, "none", link)[block].activation_bytes == (
        14 * s * h + stats + split / 2
    )
    # Sequence parallel: everything a 1/tp share, but the two column Linears' inputs (the 2sh
    # casts), which parallelize all-gathers and autograd saves whole (Note [what sequence
    # parallelism shards] in profile.py).
    assert (
        gpt_profile.segment_costs(2, True, 1, "none", link)[block].activation_bytes
        == by_hand / 2 + 2 * s * h
    )
    # Full recomputation keeps only the block's input (the fp32 hidden state, 4sh), plus one block
    # while recomputing, on top of the backward's own transient (Note [backward's own]).
    full = gpt_profile.segment_costs(1, False, 1, "full", link)[block]
    none = gpt_profile.segment_costs(1, False, 1, "none", link)[block]
    assert full.activation_bytes == 4 * s * h and full.working_bytes == by_hand + none.working_bytes
    # The backward's own: the largest op's gradients (the GeLU: its 16-bit input and output, 8sh
    # each) and the largest weight's gradient (fc's 64 x 256 + 256 bias, 2 + 4 bytes each in bf16).
    assert none.working_bytes == 16 * s * h + (64 * 256 + 256) * 6


def test_fp32_under_autocast_follows_the_dtypes(gpt_profile):
    # Note [fp32 under autocast]: norms and embeddings make fp32, Linears and attention 16 bits, an
    # elementwise op fp32 when any input is; in fp32 plans nothing is widened.
    graph = gpt_profile.graph
    fp32 = gpt_profile.fp32_values
    kinds = {name: graph.graph.nodes[name]["kind"] for name in graph.graph.nodes}
    assert all(name in fp32 for name, kind in kinds.items() if kind in ("norm", "embedding"))
    assert not any(name in fp32 for name, kind in kinds.items() if kind in ("linear", "attention"))
    # bias_dropout_residual: bf16 + fp32 residual
    residual = [n for n, k in kinds.items() if k == "dropout"]
    assert residual and all(n in fp32 for n in residual)
    # computed from a Linear's 16-bit output only
    gelu = [n for n, k in kinds.items() if k == "activation"]
    assert gelu and not any(n in fp32 for n in gelu)
    fp32_profile = ModelProfile(graph, gpt_profile.cluster, "fp32", 16)
    assert fp32_profile.fp32_values == frozenset()


def test_tp_communication_of_a_gpt_layer(gpt_profile):
    # Megatron pairs: forward all-reduce after attention and MLP projections, backward before qkv
    # and fc: 4 x (s*h*2 bytes).
    link = gpt_profile.cluster.intra_node
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    cost = gpt_profile.segment_costs(4, False, 2, "none", link)[block]
    assert cost.tp_comm_s == pytest.approx(4 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, link))
    recomputed = gpt_profile.segment_costs(4, False, 2, "full", link)[block]
    assert recomputed.tp_comm_s == pytest.approx(
        6 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, link)
    )


def test_sequence_parallelism_on_gloo_all_reduces_for_its_reduce_scatters(gpt_profile):
    # Note [sequence parallelism on gloo]: a ring reduce-scatter and all-gather cost one all-reduce
    # (NCCL), but gloo's reduce-scatter is a whole all-reduce, so each of a layer's 4 pairs costs an
    # all-reduce plus an all-gather.
    graph, link = gpt_profile.graph, gpt_profile.cluster.intra_node
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    nccl = gpt_profile.segment_costs(4, True, 2, "none", link)[block]
    assert nccl.tp_comm_s == pytest.approx(4 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, link))
    cpu = hp.ClusterSpec.preset("cpu")
    gloo = ModelProfile(graph, cpu, "bf16", 16)
    pair = costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, cpu.intra_node) + costs.ring_allgather_s(
        2 * 16 * 64 * 2, 4, cpu.intra_node
    )
    assert gloo.segment_costs(4, True, 2, "none", cpu.intra_node)[block].tp_comm_s == pytest.approx(
        4 * pair
    )
    # without SP: all-reduces, as before
    plain = gloo.segment_costs(4, False, 2, "none", cpu.intra_node)[block]
    assert plain.tp_comm_s == pytest.approx(
        4 * costs.ring_allreduce_s(2 * 16 * 64 * 2, 4, cpu.intra_node)
    )


def test_parameters_per_rank(gpt_profile):
    link = gpt_profile.cluster.intra_node
    h, f, layers = 64, 256, 2
    total = sum(s.params for s in gpt_profile.segment_costs(1, False, 1, "none", link))
    assert total == gpt_profile.graph.num_params
    per_rank = sum(s.params for s in gpt_profile.segment_costs(2, False, 1, "none", link))
    # Split: qkv and fc (weights and biases), the row Linears' weights, the vocab-parallel
    # embedding.
    split = layers * (3 * h * h + 3 * h + h * f + f + h * h + f * h) + 256 * h
    assert per_rank == pytest.approx(total - split / 2)


def test_every_group_decides_the_link():
    from hyparallel.planner.search import axis_link

    cluster = hp.ClusterSpec.preset("a100-80g", num_nodes=3)  # 24 GPUs, 8 per node
    # tp=3: groups (0,1,2) .. (6,7,8): the third group crosses a node boundary.
    assert (
        axis_link(("pp", "dp", "tp"), {"pp": 1, "dp": 8, "tp": 3}, "tp", cluster)
        == cluster.inter_node
    )
    assert (
        axis_link(("pp", "dp", "tp"), {"pp": 3, "dp": 1, "tp": 8}, "tp", cluster)
        == cluster.intra_node
    )
    # dp groups of 3 ranks 2 apart (0,2,4), (6,8,10): the second crosses.
    assert (
        axis_link(("pp", "dp", "tp"), {"pp": 4, "dp": 3, "tp": 2}, "dp", cluster)
        == cluster.inter_node
    )
    assert (
        axis_link(("pp", "dp", "tp"), {"pp": 3, "dp": 4, "tp": 2}, "dp", cluster)
        == cluster.intra_node
    )


def test_seq_by_seq_tensors_come_from_dataflow_not_shapes():
    # hidden == seq makes every (1, seq, hidden) activation look seq x seq; only attention scores
    # are.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 64))  # hidden 64
    assert not ModelProfile(graph, hp.ClusterSpec.preset("cpu"), "fp32", 64).has_quadratic
    # Bloom writes attention out with baddbmm/softmax/bmm: its scores are kept, and selective
    # recomputation drops them.
    bloom = hp.models.load("hf:bloom n_layer=2 hidden_size=128 n_head=4 vocab_size=1000").module
    profile = ModelProfile(
        hp.trace(bloom, hp.models.example_inputs(bloom, 1, 48)),
        hp.ClusterSpec.preset("cpu"),
        "fp32",
        48,
    )
    block = next(i for i, s in enumerate(profile.segments) if s.is_block)
    link = profile.cluster.intra_node
    none, selective = (
        profile.segment_costs(1, False, 1, r, link)[block] for r in ("none", "selective")
    )
    scores = 4 * 48 * 48 * 4  # one (heads, seq, seq) fp32 tensor
    # softmax output, dropout output at least
    assert none.activation_bytes - selective.activation_bytes >= 2 * scores
    assert selective.backward_s > none.backward_s


def test_op_overhead_is_a_floor_on_a_gpu_and_adds_on_a_cpu():
    # a short kernel waits for its launch
    assert costs.dispatched_s(2e-6, 1e-5, serial=False) == 1e-5
    assert costs.dispatched_s(3e-3, 1e-5, serial=False) == 3e-3  # a long one hides the next launch
    assert costs.dispatched_s(2e-6, 1e-5, serial=True) == pytest.approx(1.2e-5)


def test_op_overhead_costs_every_dispatched_op_on_a_cpu():
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))

    def forward_s(overhead: float) -> float:
        cluster = hp.ClusterSpec.preset("cpu")
        cluster = cluster.model_copy(
            update={"device": cluster.device.model_copy(update={"op_overhead_s": overhead})}
        )
        profile = ModelProfile(graph, cluster, "fp32", 16)
        return sum(
            s.forward_s for s in profile.segment_costs(1, False, 1, "none", cluster.intra_node)
        )

    from hyparallel.planner.profile import _COPYING_VIEWS

    kernels = sum(
        1 for op in graph.compute_ops() if op.kind != "view" or op.target in _COPYING_VIEWS
    )  # aliases are free
    assert forward_s(1e-3) - forward_s(0.0) == pytest.approx(kernels * 1e-3, rel=1e-6)


def test_the_loss_keeps_fp32_log_probabilities_and_its_backward_two_fp32_gradients():
    # Note [the loss's memory]: 4 bytes per logit saved; its forward holds the logits (2 in bf16)
    # and their fp32 copy (4) beside them, its backward nll_loss's and log_softmax's fp32 gradients
    # (4 + 4): the larger, 8 bytes per logit, in both dtypes.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    logits = 16 * model.config.vocab_size
    for dtype in ("bf16", "fp32"):
        cluster = hp.ClusterSpec.preset("a100-80g")
        last = ModelProfile(graph, cluster, dtype, 16).segment_costs(
            1, False, 2, "none", cluster.intra_node
        )[-1]
        assert last.working_bytes == pytest.approx(2 * logits * 8)
        assert last.activation_bytes >= 2 * logits * 4


# ---- gradient compression (Note [gradient compression], Note [PowerSGD's wire] in costs.py) ------

DEVICE = hp.ClusterSpec.preset("a100-80g").device.model_copy(
    update={
        "memory_bandwidth_bytes_per_s": 1e12,
        "memory_efficiency": 0.8,
        "matmul_efficiency": 0.5,
        "op_overhead_s": 1e-5,
        "peak_flops": (
            hp.ClusterSpec.preset("a100-80g").device.peak_flops.model_copy(update={"fp32": 20e12})
        ),
    }
)


def test_the_planner_mirrors_the_runtimes_compression_rule():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    from hyparallel.runtime import compression

    assert costs.MIN_COMPRESSION_RATE == compression.MIN_COMPRESSION_RATE
    for rows, cols in [
        (1024, 1024),
        (64, 1),
        (10, 3),
        (16, 16),
        (17, 16),
        (8, 8),
        (4096, 64),
        (3, 1000),
    ]:
        for rank in (1, 2, 4, 32):
            r = min(rows, cols, rank)
            expected = _should_compress(rows, cols, r, compression.MIN_COMPRESSION_RATE)[0]
            assert (costs.powersgd_factor_rank(rows, cols, rank) > 0) == expected, (
                rows,
                cols,
                rank,
            )


def test_powersgd_wire_elements():
    assert costs.powersgd_wire_elements((1024, 1024), 4) == 4 * (1024 + 1024)  # P and Q
    assert costs.powersgd_wire_elements((64,), 4) == 64  # a vector, (64, 1): sent whole
    # r = 3: (10 + 3) 3 x 2 = 78 >= 30, sent whole
    assert costs.powersgd_wire_elements((10, 3), 4) == 30
    assert costs.powersgd_wire_elements((16, 16), 4) == 16 * 16  # (16 + 16) 4 x 2 = 256, not < 256
    assert costs.powersgd_wire_elements((17, 16), 4) == 4 * (17 + 16)  # 264 < 272
    # A convolution (out, in, k, k) is viewed as (out, in k k) = (256, 576).
    assert costs.powersgd_wire_elements((256, 64, 3, 3), 4) == 4 * (256 + 576)
    assert costs.powersgd_wire_elements((), 4) == 1  # a scalar


def test_gradient_bytes_on_the_wire():
    assert costs.grad_wire_bytes("none", 1e6, 0) == 4e6
    assert costs.grad_wire_bytes("bf16", 1e6, 0) == costs.grad_wire_bytes("fp16", 1e6, 0) == 2e6
    assert costs.grad_wire_bytes("powersgd", 1e6, 3e4) == 1.2e5  # fp32 factors and vectors
    assert [costs.collectives_per_bucket(m) for m in costs.GRAD_COMPRESSIONS] == [1, 1, 1, 3]


def test_the_gradient_all_reduce_by_mode():
    mib = 2**20
    grad = 100 * mib  # 4 buckets of 25 MiB
    # none: as before, one ring all-reduce of everything, and the last bucket's.
    whole, last = costs.dp_allreduce_s("none", grad, grad, 4, LINK)
    assert whole == pytest.approx(costs.ring_allreduce_s(grad, 4, LINK))
    assert last == pytest.approx(costs.ring_allreduce_s(25 * mib, 4, LINK))
    whole, last = costs.dp_allreduce_s("bf16", grad, grad / 2, 4, LINK)
    assert whole == pytest.approx(costs.ring_allreduce_s(grad / 2, 4, LINK))
    assert last == pytest.approx(costs.ring_allreduce_s(12.5 * mib, 4, LINK))
    # PowerSGD sending 10 MiB: two more collectives per bucket, each 2 (n - 1) ring steps of 10 us.
    whole, last = costs.dp_allreduce_s("powersgd", grad, 10 * mib, 4, LINK)
    assert whole == pytest.approx(costs.ring_allreduce_s(10 * mib, 4, LINK) + 2 * 4 * 6 * 10e-6)
    assert last == pytest.approx(costs.ring_allreduce_s(2.5 * mib, 4, LINK) + 2 * 6 * 10e-6)
    assert costs.dp_allreduce_s("powersgd", 0.0, 0.0, 4, LINK) == (0.0, 0.0)


def test_compression_kernels_and_their_dispatch():
    # bf16 over 1M gradients (one bucket): 16 bytes per element at 1 TB/s x 0.8 = 20 us; 3 ops x 10
    # us.
    assert costs.compression_compute_s("bf16", 1e6, 0, 0, DEVICE, serial=True) == pytest.approx(
        2e-5 + 3e-5
    )
    assert costs.compression_compute_s("bf16", 1e6, 0, 0, DEVICE, serial=False) == pytest.approx(
        3e-5
    )
    # PowerSGD: the per-matrix work given, plus 6 ops per bucket; 40M gradients are 7 buckets.
    assert costs.compression_compute_s(
        "powersgd", 40e6, 1e-3, 100, DEVICE, serial=False
    ) == pytest.approx(
        max(1e-3, (100 + 7 * 6) * 1e-5)
    )  # on gloo (serial) the sum, times GLOO_POWERSGD_IN_STEP: the test below
    assert costs.compression_compute_s("none", 40e6, 1.0, 100, DEVICE, serial=True) == 0


def test_powersgd_kernels_of_one_matrix():
    n = m = 1024
    # Three products of 2 n m r = 8.4 MFLOP (0.84 us at 10 TFLOP/s) over 4 (n m + (n + m) r) bytes
    # (5.3 us): memory.
    product = 4 * (n * m + (n + m) * 4) / 0.8e12
    # Two QRs of a 1024 x 4 factor: 2 k r^2 = 32,768 FLOPs (3.3 ns), 8 k r bytes = 32 KiB (41 ns):
    # memory.
    orthogonalise = 2 * 8 * 1024 * 4 / 0.8e12
    assert costs.powersgd_matrix_s(n, m, 4, DEVICE) == pytest.approx(3 * product + orthogonalise)
    assert costs.powersgd_matrix_ops(4) == 3 + 2 * 2  # QR and its R, twice
    assert costs.powersgd_matrix_ops(2) == 3 + 2 * (6 * 2 - 4)  # Gram-Schmidt for r <= 2
    # Error feedback over 1M elements, 1,000 of them sent whole: 32 B each, and 24 more for those.
    assert costs.powersgd_elementwise_s(1e6, 1e3, DEVICE) == pytest.approx((32e6 + 24e3) / 0.8e12)


def test_zero_state_bytes_under_compression():
    # ZeRO 1, bf16 gathers in bf16 training: sharded master and AdamW, 2-byte weights and 2-byte
    # gradients whole.
    assert costs.state_bytes_per_param("bf16", 1, 8, "bf16") == 4 / 8 + 2 + 2 + 8 / 8
    assert costs.state_bytes_per_param("bf16", 2, 8, "fp16") == 4 / 8 + 2 + (4 + 8) / 8
    assert costs.state_bytes_per_param("bf16", 3, 8, "bf16") == 16 / 8
    # fp32 training gathers fp32 whatever the reduction's dtype.
    assert costs.state_bytes_per_param("fp32", 1, 8, "bf16") == costs.state_bytes_per_param(
        "fp32", 1, 8
    )
    assert costs.unsharded_bytes_per_param("bf16", "bf16") == (2, 2)
    # fp32 weight, autocast's copy, fp32 gradient
    assert costs.unsharded_bytes_per_param("bf16") == (4 + 2, 4)
    # ZeRO 0: a 16-bit reduction holds nothing more; PowerSGD an fp32 residual per element (none
    # with dp = 1).
    assert costs.state_bytes_per_param("bf16", 0, 8, "bf16") == 18 + 4  # DDP's buckets
    assert costs.state_bytes_per_param("bf16", 0, 8, "powersgd") == 18 + 4 + 4
    assert costs.state_bytes_per_param("bf16", 0, 1, "powersgd") == 18
    assert (
        costs.gathered_bytes_per_param("bf16", "bf16") == 2
        and costs.gathered_bytes_per_param("bf16") == 4
    )
    assert costs.reduced_bytes_per_param("fp16") == 2 and costs.reduced_bytes_per_param("none") == 4
    # PowerSGD's buffers: P, Q and the uncompressed copy (4 B per element sent), and one bucket's
    # clone.
    assert costs.powersgd_buffer_bytes(100 * 2**20, 1e6) == 4e6 + 25 * 2**20


def test_powersgd_elements_of_gpt_tiny(gpt_profile):
    # gpt-tiny: vocab 256, 128 positions, hidden 64, MLP 256, 2 layers, biases, tied head; rank 4.
    # Each matrix sends 4 (n + m) (all pass (n + m) 4 x 2 < n m), each vector all of itself:
    #   embeddings (256, 64) and (128, 64): 1,280 + 768
    #   a layer: 4 norm vectors 256; qkv (192, 64) 1,024 + 192; proj (64, 64) 512 + 64; fc (256, 64)
    #   1,280 + 256; mlp proj (64, 256) 1,280 + 64: 4,928
    #   the final norm: 128
    work = gpt_profile.powersgd_work(1, 4)
    assert sum(w.elements for w in work) == 1280 + 768 + 2 * 4928 + 128
    block = next(i for i, seg in enumerate(gpt_profile.segments) if seg.is_block)
    assert work[block].elements == 4928
    # tp 2 shards as the runtime does: the vocab embedding (128, 64) 768, qkv (96, 64) 640 + 96,
    # proj (64, 32) 384 + 64 (bias whole), fc (128, 64) 768 + 128, mlp proj (64, 128) 768 + 64,
    # norms whole.
    assert sum(w.elements for w in gpt_profile.powersgd_work(2, 4)) == 768 + 768 + 2 * 3168 + 128
    # The tied head: a stage holding the head without the embedding reduces the embedding's factors
    # too.
    [(owner, readers, tied)] = gpt_profile.tied_powersgd_work(1, 4)
    assert owner == 0 and readers == (len(gpt_profile.segments) - 1,) and tied.elements == 1280


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "hf-gpt2"])
def test_local_shapes_hold_what_params_per_rank_counts(name):
    import math

    from .conftest import HF_GPT2_TINY

    model = hp.models.load(HF_GPT2_TINY).module if name == "hf-gpt2" else hp.models.build(name)
    graph = hp.trace(model, hp.models.example_inputs(model, 1, 16))
    profile = ModelProfile(graph, hp.ClusterSpec.preset("cpu"), "fp32", 16)
    for op in graph.compute_ops():
        assert sum(math.prod(s) for s in op.param_shapes) == op.param_count
        for tp in (1, 2, 4):
            if graph.structure.check(tp, graph):
                continue
            shapes = profile.local_param_shapes(op, tp)
            assert sum(math.prod(s) for s in shapes) == pytest.approx(
                graph.structure.params_per_rank(op, tp)
            )
    # transformers' Conv1D stores (in, out); split, the runtime holds (out, in)
    if name == "hf-gpt2":
        c_attn = graph.op("transformer.h.0.attn.c_attn")
        assert c_attn.param_shapes == ((64, 192), (192,))
        assert profile.local_param_shapes(c_attn, 2) == ((96, 64), (96,))


def test_sixteen_bit_sums_on_gloo_cost_their_measured_share_of_fp32():
    # Note [16-bit sums on gloo]: NCCL halves the bytes; gloo's CPU sum costs a measured fraction of
    # fp32's.
    assert (
        costs.grad_wire_bytes("bf16", 1e6, 0, serial=True)
        == 4e6 * costs.GLOO_SIXTEEN_BIT_SUM["bf16"]
    )
    assert (
        costs.grad_wire_bytes("fp16", 1e6, 0, serial=True)
        == 4e6 * costs.GLOO_SIXTEEN_BIT_SUM["fp16"]
    )
    assert costs.grad_wire_bytes("none", 1e6, 0, serial=True) == 4e6
    # fp32 factors either way
    assert costs.grad_wire_bytes("powersgd", 1e6, 3e4, serial=True) == 1.2e5
    assert (
        costs.reduced_bytes_per_param("bf16", serial=True) == 4 * costs.GLOO_SIXTEEN_BIT_SUM["bf16"]
    )
    assert all(0.5 < share <= 1.5 for share in costs.GLOO_SIXTEEN_BIT_SUM.values())


def test_powersgd_on_gloo_is_charged_its_measured_in_step_cost():
    # Note [PowerSGD inside a gloo step]: serial (gloo) clusters pay GLOO_POWERSGD_IN_STEP x the
    # model's work.
    device = hp.ClusterSpec.preset("cpu").device
    cpu = costs.compression_compute_s("powersgd", 1e6, 0.01, 100, device, serial=True)
    ops = 100 + 6  # the matrices' ops and one bucket's 6
    assert cpu == pytest.approx(costs.GLOO_POWERSGD_IN_STEP * (0.01 + ops * device.op_overhead_s))
    # The 16-bit hooks keep their model on gloo: what they miss is in the sum's share
    # (GLOO_SIXTEEN_BIT_SUM).
    assert costs.compression_compute_s("bf16", 1e6, 0, 0, device, serial=True) == pytest.approx(
        16e6 / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
        + 3 * device.op_overhead_s
    )


# ---- shape-dependent efficiency (Note [matmul curve], Note [GEMM shapes]) ------------------------


def test_the_matmul_curve_is_monotone_relative_and_reaches_the_plateau():
    curve = hp.ClusterSpec.preset("a100-80g").device.matmul_curve
    squares = [curve.factor(n * n, n) for n in (64, 256, 1024, 4096, 16384, 65536)]
    # bigger GEMMs are nearer the plateau
    assert all(0 < a < b <= 1 for a, b in zip(squares, squares[1:]))
    assert squares[-1] > 0.99  # the plateau is matmul_efficiency itself
    # a short reduction is slower per FLOP
    assert curve.factor(8192 * 8192, 64) < curve.factor(8192 * 8192, 8192)
    assert curve.factor(64 * 8192, 8192) < curve.factor(8192 * 8192, 8192)  # so are few rows
    assert costs.curve_factor(None, 1.0, 1.0) == 1.0  # no curve: every product at the plateau


def _linear_times(device_update: dict, tp: int = 1, micro_batch: int = 1, style: str = "qkv"):
    """(forward, backward) seconds of gpt-1.3b's first attention projection on an a100-80g under
    ``device_update``."""
    from hyparallel.planner.profile import _op_times

    model = hp.models.build("gpt-1.3b")
    graph = hp.trace(model, model.example_inputs(1, 2048))
    cluster = hp.ClusterSpec.preset("a100-80g")
    device = cluster.device.model_copy(
        update={"op_overhead_s": 0.0, "kernel_floor_s": 0.0, **device_update}
    )
    profile = ModelProfile(graph, cluster, "bf16", 2048)
    # layers.0.attn.qkv: column
    op = next(op for raw in profile.raw for op in raw.ops if op.kind == "linear")
    return op, _op_times(op, tp, False, micro_batch, device.peak_flops.bf16, device, serial=False)


def test_scaling_the_plateau_scales_every_matmul():
    # The online calibration fits matmul_efficiency: halving it must double a compute-bound
    # product's time.
    _, (forward, backward) = _linear_times({})
    _, (forward_half, backward_half) = _linear_times({"matmul_efficiency": 0.365})
    assert forward_half == pytest.approx(2 * forward) and backward_half == pytest.approx(
        2 * backward
    )


def test_without_a_curve_a_product_costs_its_flops_at_the_plateau():
    op, (forward, backward) = _linear_times({"matmul_curve": None})
    device = hp.ClusterSpec.preset("a100-80g").device
    assert forward == pytest.approx(op.flops / (device.peak_flops.bf16 * device.matmul_efficiency))
    assert backward == pytest.approx(2 * forward)  # the two backward products, each at the plateau


def test_gemm_shapes_follow_the_tensor_parallel_split():
    from hyparallel.planner.profile import _rank_gemm

    op, _ = _linear_times({})
    # M tokens, N = 3h, K = h
    assert op.style == "column" and op.gemm == (1.0, 2048.0, 3 * 2048.0, 2048.0)
    # 2 sequences' tokens, N split by tp
    assert _rank_gemm(op, 4, 2) == (1.0, 4096.0, 1536.0, 2048.0)
    # A smaller split GEMM is slower per FLOP: 4 tp ranks take more than a quarter of the time each.
    _, (forward_1, _) = _linear_times({}, tp=1)
    _, (forward_4, _) = _linear_times({}, tp=4)
    assert forward_4 > forward_1 / 4


def test_backward_products_are_costed_by_their_own_shapes():
    # Few rows (M = 64 tokens) under a large weight: the forward and the input gradient have M x N
    # or M x K outputs, too few to fill the device; the weight gradient has K x N outputs, reduced
    # over the 64 tokens.
    curve = hp.ClusterSpec.preset("a100-80g").device.matmul_curve
    forward = costs.gemm_efficiency(0.7, curve, 1, 64, 8192, 8192)
    input_grad, weight_grad = costs.gemm_backward_efficiencies(0.7, curve, 1, 64, 8192, 8192)
    # M x K over N
    assert input_grad == pytest.approx(costs.gemm_efficiency(0.7, curve, 1, 64, 8192, 8192))
    # K x N over M
    assert weight_grad == pytest.approx(costs.gemm_efficiency(0.7, curve, 1, 8192, 8192, 64))
    assert forward < weight_grad < 0.7


def test_a_kernel_takes_at_least_the_floor():
    assert costs.kernel_s(1e-7, 2e-6) == 2e-6 and costs.kernel_s(1e-3, 2e-6) == 1e-3
    # A tiny op on a GPU without host overhead costs the device's floor.
    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    cluster = hp.ClusterSpec.preset("a100-80g")
    cluster = cluster.model_copy(
        update={
            "device": cluster.device.model_copy(
                update={"op_overhead_s": 0.0, "kernel_floor_s": 1e-3}
            )
        }
    )
    profile = ModelProfile(graph, cluster, "bf16", 16)
    kernels = sum(1 for raw in profile.raw for op in raw.ops if op.kind != "view")
    forward = sum(
        s.forward_s for s in profile.segment_costs(1, False, 1, "none", cluster.intra_node)
    )
    assert forward == pytest.approx(kernels * 1e-3, rel=1e-6)


def test_the_loss_is_vocab_parallel_unless_asked_and_each_way_is_priced_as_it_runs():
    # gpt-tiny with a 4,096-token vocabulary at tp 2: the planner's plan computes the loss
    # vocab-parallel (three all-reduces of one fp32 figure per token); asked to gather the logits,
    # it prices their all-gather instead, per micro-batch, and each rank holds the loss's fp32
    # tensors whole rather than its half.
    model = hp.models.load("gpt-tiny vocab_size=4096").module
    cluster = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
    fixed = dict(tp=2, dp=1, pp=1, micro_batch=4, zero=0, sequence_parallel=False, recompute="none")
    vocab = hp.plan(model, cluster, 8, 64, "fp32", **fixed)
    gathered = hp.plan(model, cluster, 8, 64, "fp32", vocab_parallel_loss=False, **fixed)
    assert vocab.parallel.vocab_parallel_loss and not gathered.parallel.vocab_parallel_loss
    assert not hp.plan(
        model, cluster.resized(gpus_per_node=1), 8, 64, "fp32", tp=1
    ).parallel.vocab_parallel_loss
    logits, tokens = 4 * 64 * 4096, 4 * 64  # per micro-batch
    link = cluster.intra_node
    per_micro_batch = costs.ring_allgather_s(logits * 4, 2, link) - 3 * costs.ring_allreduce_s(
        tokens * 4, 2, link
    )
    difference = (gathered.predicted.comm_s.tp - vocab.predicted.comm_s.tp) / vocab.num_microbatches
    assert difference == pytest.approx(per_micro_batch, rel=1e-4)
    # At least the saved fp32 tensor's other half (4 - 4/2 bytes per logit), at most every loss
    # tensor whole (Note [the loss's memory]: 4 saved, 8 transient, 6 of gloo's late frees, the
    # logits' other half 2 (Note [the gathered logits]), less the 2 + 2 split).
    extra = (gathered.predicted.memory_gib[0] - vocab.predicted.memory_gib[0]) * 2**30 / logits
    assert 2 <= extra <= 16


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_fsdp_and_the_optimizer_dispatch_per_tensor_on_a_cpu(backend):
    # Note [what FSDP and the optimizer dispatch on a CPU]: gpt-mini's 52 parameter tensors at dp 2.
    # The op overhead moves compute alike under every ZeRO stage, so how ZeRO 1's step minus ZeRO
    # 0's grows with it is the per-tensor work alone: an all-gather and a reduce-scatter per tensor,
    # and AdamW on DTensors for plain ones. On nccl (GPUs launch it behind the kernels) nothing.
    model = hp.models.build("gpt-mini")
    tensors = len(list(model.parameters()))
    assert tensors == 52

    def zero_cost(overhead: float) -> float:
        base = hp.ClusterSpec.preset("cpu", num_nodes=1, gpus_per_node=2)
        device = base.device.model_copy(update={"op_overhead_s": overhead})
        cluster = base.model_copy(update={"device": device, "backend": backend})
        step = {
            z: (
                hp.plan(
                    model, cluster, 16, 128, "fp32", dp=2, tp=1, pp=1, micro_batch=8, zero=z
                ).predicted.step_time_s
            )
            for z in (0, 1)
        }
        return step[1] - step[0]

    growth = (zero_cost(2e-5) - zero_cost(1e-5)) / 1e-5
    expected = tensors * (
        2 * costs.FSDP_OPS_PER_TENSOR
        + costs.ADAM_DTENSOR_OPS_PER_TENSOR
        - costs.ADAM_OPS_PER_TENSOR
    )
    assert growth == pytest.approx(expected if backend == "gloo" else 0.0, rel=1e-3, abs=1e-3)


def _activation_times(costs_by_function: dict, tp: int = 1, micro_batch: int = 2):
    """(op, (forward, backward)) of gpt-tiny's first MLP activation (tanh-GELU, between a column and
    a row Linear) on the cpu preset without op overhead, with the given per-element activation
    costs."""
    from hyparallel.planner.profile import _op_times
    from hyparallel.spec.cluster import ElementCost

    model = hp.models.build("gpt-tiny")
    graph = hp.trace(model, model.example_inputs(1, 16))
    device = hp.ClusterSpec.preset("cpu").device
    device = device.model_copy(
        update={
            "op_overhead_s": 0.0,
            "activation_costs": {k: ElementCost(**v) for k, v in costs_by_function.items()},
        }
    )
    profile = ModelProfile(graph, hp.ClusterSpec.preset("cpu"), "fp32", 16)
    op = next(op for raw in profile.raw for op in raw.ops if op.kind == "activation")
    return op, _op_times(op, tp, False, micro_batch, device.peak_flops.fp32, device, serial=True)


def test_a_cpu_activation_costs_the_larger_of_its_compute_and_its_bytes():
    # Note [activations a CPU computes]: gpt-tiny's MLP runs nn.GELU(approximate="tanh"), named
    # gelu_tanh.
    op, (forward_bytes, backward_bytes) = _activation_times({})
    # tokens x ffn per sequence
    assert op.function == "gelu_tanh" and op.out_elements == 16 * 4 * 64
    elements = 2 * op.out_elements
    _, (forward, backward) = _activation_times(
        {"gelu_tanh": {"forward_s": 1e-6, "backward_s": 3e-6}}
    )
    assert forward == pytest.approx(elements * 1e-6) and backward == pytest.approx(elements * 3e-6)
    # A tensor-parallel rank computes its share of the split activation.
    _, (forward_tp, _) = _activation_times(
        {"gelu_tanh": {"forward_s": 1e-6, "backward_s": 3e-6}}, tp=2
    )
    assert forward_tp == pytest.approx(forward / 2)
    # Cheaper than its bytes: the bytes price it; another function's cost does not apply.
    assert _activation_times({"gelu_tanh": {"forward_s": 1e-15, "backward_s": 1e-15}})[
        1
    ] == pytest.approx((forward_bytes, backward_bytes))
    assert _activation_times({"gelu": {"forward_s": 1e-6, "backward_s": 3e-6}})[1] == (
        forward_bytes,
        backward_bytes,
    )
