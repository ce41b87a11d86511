"""The plan file (YAML, version 1): the only contract between the planner and the runtime.

Every section is a frozen pydantic model that rejects unknown keys. A plan written by hand with
only ``training`` and ``parallel`` is accepted: the derived figures (micro-batch count, placement)
are completed here; ``stages``, ``tensor_parallel`` and ``predicted`` come from the planner.

Note [rank order]
    ``placement.order`` lists the mesh axes outermost first, exactly as the dims of torch's
    ``init_device_mesh(..., mesh_dim_names=order)``. The default ``[pp, dp, tp]`` puts tp innermost,
    so a tp group is ``tp`` consecutive ranks, and torchrun numbers ranks node by node, so tp stays
    inside a node whenever ``tp <= gpus_per_node`` (Megatron-LM's default order, too). A cp axis
    above 1 sits right inside dp (``[pp, dp, cp, tp]`` by default): the cp ranks of a data-parallel
    rank are neighbours after tp, as Megatron-Core orders tp-cp-ep-dp-pp, and dp and cp flatten into
    the one group that shares the weight gradients.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hyparallel.spec import limits
from hyparallel.spec.cluster import (
    ClusterSpec,
    NonNegativeFloat,
    PositiveInt,
    float_above,
    float_in,
    int_in,
)
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.files import atomic_output
from hyparallel.spec.yaml_io import dump_yaml, read_yaml, validate

if TYPE_CHECKING:
    import torch

# The bounds are hyparallel.spec.limits', shared with the CLI's flags and the planner's request
# checks.
Sequences = int_in(1, limits.MAX_GLOBAL_BATCH)
Degree = int_in(1, limits.MAX_DEVICES)
ParamCount = int_in(0, limits.MAX_PARAMS)

# The vocabulary of plans, defined here once: the planner, the pipeline and the runtime import these
# names.
# compute precision of training (not cluster.PeakDtype, the peak table's)
Dtype = Literal["bf16", "fp16", "fp32"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]
Recompute = Literal["none", "selective", "full"]
ZeroStage = Literal[0, 1, 2, 3]
TPStyle = Literal["column", "row", "vocab", "replicate"]
Axis = Literal["pp", "dp", "tp"]
# how gradients cross dp (docs/data-parallel.md)
GradCompression = Literal["none", "bf16", "fp16", "powersgd"]
# applied on the parameter servers (docs/parameter-server.md)
PsOptimizer = Literal["sgd", "adagrad", "rowwise-adam"]
# hp.checkpoint.save's storage=: host memory first, or straight to disk
CheckpointStorage = Literal["memory", "disk"]
# (model output, targets) -> scalar loss, as train_step and eval_step take it. A string
# "torch.Tensor": this module, which the planner and the CLI load, does not import torch.
LossFn = Callable[[Any, Any], "torch.Tensor"]

DEFAULT_ORDER: tuple[Axis, ...] = ("pp", "dp", "tp")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Section):
    """What the plan was made for; ``fingerprint`` is hyparallel.models.fingerprint(model)."""

    name: str = Field(
        description=(
            "The model's name as traced (the class name unless `hyparallel plan --model` named it)."
        )
    )
    num_params: ParamCount = Field(description="Parameters of the whole, unsplit model.")
    num_layers: int_in(0, limits.MAX_MODEL_OPS) = Field(
        description=(
            "Repeated blocks (transformer layers) found by the trace; "
            "the parameterised ops when there are none."
        )
    )
    fingerprint: str = Field(
        description=(
            "`sha256:` hash of the parameter names and shapes; `parallelize` refuses a model whose"
            " fingerprint differs (an empty string skips the check)."
        )
    )


class TrainingConfig(_Section):
    """Batch and precision of one optimizer step. ``global_batch`` and ``micro_batch`` count
    sequences."""

    global_batch: Sequences = Field(
        description="Sequences per optimizer step, summed over the data-parallel replicas."
    )
    micro_batch: Sequences = Field(
        1,
        description=(
            "Sequences in one micro-batch on one replica; derived from `parallel.num_microbatches`"
            " when only that is given."
        ),
    )
    seq_len: int_in(1, limits.MAX_SEQ_LEN) = Field(description="Tokens per sequence.")
    dtype: Dtype = Field(
        "bf16",
        description=(
            "Compute precision: `bf16`/`fp16` run under autocast with fp32 weights, gradients and "
            "optimizer state; `fp32` runs in fp32 throughout."
        ),
    )


class ParallelConfig(_Section):
    """Degrees and strategies; ``num_microbatches`` is derived when omitted."""

    dp: Degree = Field(
        1,
        description=(
            "Data-parallel degree: model replicas, each taking global_batch / dp sequences."
        ),
    )
    tp: Degree = Field(
        1, description="Tensor-parallel degree: ranks splitting each layer's matrices."
    )
    pp: Degree = Field(
        1, description="Pipeline-parallel degree: ranks each running a part of the layers."
    )
    ep: Degree = Field(
        1,
        description=(
            "Expert-parallel degree: each MoE layer's experts split over ep ranks taken from dp"
            " (ep divides dp; Note [expert parallelism], hyparallel.runtime.experts)."
        ),
    )
    cp: Degree = Field(
        1,
        description=(
            "Context-parallel degree: each sequence split over cp ranks (two chunks each, balanced"
            " for causal attention), attention exact across them; the cp ranks of a data-parallel"
            " rank take the same rows and share the weight gradients (Note [context parallelism],"
            " hyparallel.runtime.context)."
        ),
    )
    cp_attention: Literal["gather", "ring"] = Field(
        "gather",
        description=(
            "How attention crosses the cp ranks: `gather` all-gathers every layer's keys and"
            " values, `ring` passes one rank's block at a time round a ring, merging by log-sum-exp"
            " (ignored when cp = 1)."
        ),
    )
    schedule: Schedule = Field("1f1b", description="Pipeline schedule (ignored when pp = 1).")
    virtual_stages: int_in(1, limits.MAX_VIRTUAL_STAGES) = Field(
        1, description="Model chunks per pipeline rank; more than 1 only with `interleaved-1f1b`."
    )
    num_microbatches: Sequences | None = Field(
        None,
        description=(
            "Micro-batches per step on each replica: global_batch / (dp x micro_batch); derived"
            " when omitted."
        ),
    )
    recompute: Recompute = Field(
        "none",
        description=(
            "Activation recomputation: `selective` recomputes only the ops producing seq x seq"
            " tensors, `full` each block (each stage under a pipeline)."
        ),
    )
    zero: ZeroStage = Field(
        0,
        description=(
            "ZeRO stage of the data-parallel axis: 0 is DDP, 1 and 2 FSDP2 without resharding after"
            " forward, 3 FSDP2 resharding after forward. The planner picks 2 and 3 only when pp ="
            " 1, and ZeRO only when dp > 1."
        ),
    )
    sequence_parallel: bool = Field(
        False,
        description=(
            "Split the norms, dropout and residual adds between the tensor-parallel matmuls along"
            " the sequence over the tp ranks."
        ),
    )
    vocab_parallel_loss: bool = Field(
        False,
        description=(
            "Compute train_step's default loss (token cross-entropy) on each tp rank's slice of the"
            " vocab-parallel head's logits, Megatron-LM's vocab-parallel cross-entropy, never"
            " gathering them; false all-gathers the logits so that any loss_fn works (tp times the"
            " loss's memory, and the gather's traffic). The planner sets it wherever tp > 1 splits"
            " the head, unless asked not to. Needs tp > 1."
        ),
    )
    fused_kernels: bool = Field(
        True,
        description=(
            "Run the activation after a column-split Linear in that Linear's matmul epilogue (a"
            " Triton kernel on CUDA, outside autocast); the environment variable"
            " HYPARALLEL_TRITON=0 turns the kernels off as well."
        ),
    )
    sync_batchnorm: bool = Field(
        False,
        description=(
            "Convert the model's batch norms to torch.nn.SyncBatchNorm over the dp group, so that"
            " their statistics cover every data-parallel rank's rows of a micro-batch; they still"
            " cover one micro-batch, so they match a single device only with one micro-batch per"
            " step. Needs CUDA (SyncBatchNorm does not run on the CPU), tp = 1 and pp = 1."
        ),
    )
    compile: bool = Field(
        False,
        description=(
            "torch.compile the forward of each repeated block (each pipeline stage's graph when pp"
            " > 1), after recomputation: backend `parallelize(compile_backend=...)`, else"
            " $HYPARALLEL_COMPILE_BACKEND, else inductor. Parameter names and hooks are unchanged"
            " (hyparallel/runtime/compile.py). The planner's costs do not model it."
        ),
    )

    grad_compression: GradCompression = Field(
        "none",
        description=(
            "How gradients cross the data-parallel axis (ignored when dp = 1): `none` in fp32;"
            " `bf16` or `fp16` cast to 16 bits for the reduction (DDP's compression hooks; under"
            " ZeRO, FSDP2's reduce dtype, with the weights gathered in training.dtype when it is"
            " 16-bit); `powersgd` as rank-`powersgd_rank` factors with error feedback (PowerSGD,"
            " Vogels et al. 2019; ZeRO 0 only). Every mode but `none` changes the numerics."
        ),
    )
    powersgd_rank: int_in(1, limits.MAX_POWERSGD_RANK) = Field(
        4,
        description=(
            "Rank of PowerSGD's low-rank factors of each gradient matrix (`grad_compression:"
            " powersgd`)."
        ),
    )
    powersgd_start_step: int_in(2, limits.MAX_POWERSGD_START_STEP) = Field(
        1000,
        description=(
            "Steps reduced uncompressed before PowerSGD starts (its warm-up; at least 2: DDP"
            " settles its gradient buckets after the first step)."
        ),
    )

    @property
    def world_size(self) -> int:
        """dp * cp * tp * pp: the number of processes the plan needs."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def degrees(self) -> str:
        """``dp(2) * tp(2) * pp(1)``, cp named where it is above 1: how messages spell the world."""
        cp = f" * cp({self.cp})" if self.cp > 1 else ""
        return f"dp({self.dp}){cp} * tp({self.tp}) * pp({self.pp})"

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.world_size > limits.MAX_DEVICES:
            raise ValueError(
                f"{self.degrees} = {self.world_size:,} processes, "
                f"more than the {limits.MAX_DEVICES:,} hyparallel plans for; lower a degree"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"parallel.ep ({self.ep}) must divide dp ({self.dp}): expert-parallel ranks are"
                " taken from the data-parallel ones; raise dp or lower ep"
            )
        if self.cp > 1:
            beside = (
                f"pp {self.pp}: pipeline stages"
                if self.pp > 1
                else f"ep {self.ep}: expert parallelism"
                if self.ep > 1
                else None
            )
            if beside:
                raise ValueError(
                    f"parallel.cp {self.cp} beside {beside} with context parallelism is not"
                    " supported yet; set cp: 1, or drop the other axis"
                )
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(
                f"parallel.virtual_stages is {self.virtual_stages} but schedule is"
                f" '{self.schedule}'; virtual stages need schedule: interleaved-1f1b (or set"
                " virtual_stages: 1)"
            )
        if self.schedule == "interleaved-1f1b" and self.pp > 1 and self.virtual_stages < 2:
            raise ValueError(
                "parallel.schedule is interleaved-1f1b but virtual_stages is 1; "
                "set virtual_stages to 2 or more (or use schedule: 1f1b)"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ValueError(
                "parallel.sequence_parallel needs tp > 1: it shards along tp; set it to false or"
                " raise tp"
            )
        if self.vocab_parallel_loss and self.tp == 1:
            raise ValueError(
                "parallel.vocab_parallel_loss needs tp > 1: it computes the loss on each tp rank's"
                " slice of the logits; set it to false or raise tp"
            )
        if self.grad_compression == "powersgd" and self.zero > 0 and self.dp > 1:
            raise ValueError(
                f"parallel.grad_compression powersgd needs zero 0: ZeRO {self.zero} runs on FSDP2,"
                " whose reduce-scatters take no communication hook to compress; use bf16 or fp16"
                " there, or zero: 0"
            )
        return self


class PsConfig(_Section):
    """Parameter-server mode: embedding tables (and the dense weights) live on ``servers`` server
    processes.

    Workers pull the rows a batch needs and push sparse gradients; the servers apply ``optimizer``.
    The launch has ``parallel.dp`` workers plus ``servers`` server processes
    (docs/parameter-server.md): the planner's own pick for N GPUs has dp + servers = N (the servers
    on some of the GPUs' processes), ``--ps-servers`` adds them beside N workers.
    """

    servers: int_in(1, limits.MAX_DEVICES) = Field(
        description=(
            "Parameter-server processes; each holds every table's rows r with r % servers == its"
            " index."
        )
    )
    tables: list[str] | Literal["auto"] = Field(
        "auto",
        description=(
            "Module paths of the nn.Embedding / nn.EmbeddingBag tables held by the servers; `auto`"
            " takes every one. The model's other weights live on the servers too, each whole on one"
            " server."
        ),
    )
    staleness: int_in(0, limits.MAX_PS_STALENESS) = Field(
        0,
        description=(
            "How many steps a worker may run ahead of the slowest (stale-synchronous parallel); 0"
            " is synchronous SGD: each step's gradients are summed over the workers and applied"
            " once."
        ),
    )
    optimizer: PsOptimizer = Field(
        "adagrad",
        description=(
            "Update rule the servers apply: `sgd`, `adagrad` (torch.optim.Adagrad's) or"
            " `rowwise-adam` (Adam with one second moment per row, its steps counted per row)."
        ),
    )
    lr: float_above(0.0, 1e3) = Field(0.01, description="The servers' learning rate.")
    worker_timeout_s: float_above(0.0, 86_400.0) = Field(
        30.0,
        description=(
            "A worker silent this long is taken for dead: its unfinished data shard goes back in"
            " the queue."
        ),
    )


class Placement(_Section):
    """How ranks map onto the (pp, dp, tp) mesh; see Note [rank order]."""

    order: tuple[Axis, Axis, Axis] = Field(
        DEFAULT_ORDER,
        description=(
            "The mesh axes outermost first, as `init_device_mesh`'s dim names: the last varies "
            "fastest with the rank, so the default keeps a tp group on consecutive ranks."
        ),
    )

    @field_validator("order")
    @classmethod
    def _permutation(cls, order: tuple[str, ...]) -> tuple[str, ...]:
        if sorted(order) != sorted(DEFAULT_ORDER):
            raise ValueError(f"must name pp, dp and tp once each, got {list(order)}")
        return order


class StageSpec(_Section):
    """One pipeline stage (a virtual stage under interleaving): the module paths it runs."""

    index: int_in(0, limits.MAX_DEVICES * limits.MAX_VIRTUAL_STAGES) = Field(
        description="Position in the pipeline, 0 first; stage i runs on pipeline rank i % pp."
    )
    modules: list[str] = Field(
        min_length=1,
        description=(
            "Module paths (as in `named_modules()`) this stage runs; a module's children go with "
            "it, and glue code of unlisted parents runs where execution order puts it."
        ),
    )
    num_params: ParamCount | None = Field(
        None,
        description=(
            "Planner: parameters of these modules in the unsplit model (before tensor-parallel"
            " splitting)."
        ),
    )
    compute_s: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: forward + backward seconds of one micro-batch through this stage on one"
            " device, recomputation included, communication not."
        ),
    )
    memory_gib: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: peak GiB of the device running this stage (all its virtual stages), reserved "
            "memory included."
        ),
    )
    # The per-micro-batch figures `hyparallel simulate` times the schedule with; a plan without them
    # is drawn in relative units (hyparallel/planner/timeline.py).
    forward_s: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: forward seconds of one micro-batch through this stage on one device, its "
            "tensor-parallel all-reduces included."
        ),
    )
    backward_s: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: backward seconds of one micro-batch, recomputation, tensor-parallel"
            " all-reduces and (pp = 1 only) ZeRO-2/3's per-micro-batch traffic included."
        ),
    )
    activation_gib: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: GiB of activations one in-flight micro-batch keeps on this stage for its"
            " backward, under the plan's recompute."
        ),
    )
    p2p_s: NonNegativeFloat | None = Field(
        None,
        description=(
            "Planner: seconds of one point-to-point transfer to the next stage (a micro-batch's"
            " output activations; their gradient comes back in the same time); absent on the last"
            " stage."
        ),
    )


class CommTime(_Section):
    """Exposed communication time per step by mesh axis."""

    tp: NonNegativeFloat = Field(
        description=(
            "Tensor-parallel collectives of one device over the step (all its micro-batches, never"
            " overlapped)."
        )
    )
    dp: NonNegativeFloat = Field(
        description=(
            "The step's tail after the last backward on the slowest stage: gradient reduction not"
            " hidden behind the backward (with a compressing hook's kernels), ZeRO 1/2's weight"
            " all-gather, and the optimizer step (ZeRO 2/3's per-micro-batch traffic is in the"
            " stages' time instead). In ps mode: the pull from and push to the servers and their"
            " update."
        )
    )
    pp: NonNegativeFloat = Field(
        description=(
            "Point-to-point activation and gradient transfers: per micro-batch x (m + pp - 1)."
        )
    )
    ep: NonNegativeFloat | None = Field(
        None,
        description=(
            "Expert parallelism's all-to-alls of one device over the step (dispatch and combine,"
            " forward and backward, never overlapped); absent without ep."
        ),
    )
    cp: NonNegativeFloat | None = Field(
        None,
        description=(
            "Context parallelism's key/value traffic of one device over the step that compute does"
            " not hide (gathers and reduce-scatters, or ring steps); absent without cp."
        ),
    )


class UncompressedTime(_Section):
    """A compressing plan's predictions with grad_compression none: what compression saves."""

    step_time_s: NonNegativeFloat = Field(
        description=(
            "Seconds per optimizer step with the gradients reduced in fp32: the same configuration"
            " and stages."
        )
    )
    dp_comm_s: NonNegativeFloat = Field(
        description="`comm_s.dp` with the gradients reduced in fp32."
    )


class Predicted(_Section):
    """The planner's predictions for one optimizer step."""

    step_time_s: NonNegativeFloat = Field(
        description="Seconds per optimizer step (docs/cost-model.md, 'Step time')."
    )
    tokens_per_s: NonNegativeFloat = Field(
        description="global_batch x seq_len / step_time_s, over the whole cluster."
    )
    tflops_per_gpu: NonNegativeFloat = Field(
        description=(
            "Model TFLOP/s per device: 3 x forward FLOPs of the global batch (recomputation not"
            " counted) / step time / devices."
        )
    )
    mfu: NonNegativeFloat = Field(
        description="Model FLOPs utilisation: tflops_per_gpu over the device's peak in `dtype`."
    )
    bubble_fraction: NonNegativeFloat = Field(
        description=(
            "Pipeline idle time over ideal compute time, (pp - 1) / (virtual_stages x"
            " num_microbatches)."
        )
    )
    memory_gib: list[NonNegativeFloat] = Field(
        description="Peak GiB per pipeline rank (one entry per rank, reserved memory included)."
    )
    comm_s: CommTime = Field(description="Communication seconds per step by mesh axis.")
    expert_imbalance: float_in(1.0, limits.MAX_EXPERT_IMBALANCE) | None = Field(
        None,
        description=(
            "The experts' load imbalance the prediction assumed (ep > 1): the busiest ep rank's"
            " routed (token, expert) pairs over the mean (`hyparallel plan --expert-imbalance`,"
            " default 1.2); the online calibration costs the plan with it. Absent without ep."
        ),
    )
    uncompressed: UncompressedTime | None = Field(
        None,
        description=(
            "Written when the plan compresses gradients (`parallel.grad_compression` other than"
            " `none`, dp > 1): the same plan predicted uncompressed, so `step_time_s` against it is"
            " what compression saves (docs/cost-model.md, 'Gradient compression')."
        ),
    )


class CheckpointCost(_Section):
    """Checkpoint cost, the checkpoint interval that maximises goodput, and the goodput expected
    under failures.

    Written by ``hyparallel plan --mtbf`` (``hp.plan(..., mtbf_hours=)``); the formulas are in
    docs/cost-model.md, "Checkpoints and goodput". Informational: training does not read it.
    """

    mtbf_hours: float_above(0.0, limits.MAX_MTBF_HOURS) = Field(
        description=(
            "Mean time between failures of the whole job (any of its devices or nodes), in hours."
        )
    )
    restart_s: float_in(0.0, limits.MAX_RESTART_S) = Field(
        description=(
            "Seconds from a failure to training again: detection, relaunch, initialisation and the "
            "checkpoint's load."
        )
    )
    storage: CheckpointStorage = Field(
        description=(
            "`memory`: a save blocks for the copy into host memory and writes to disk in the"
            " background; `disk`: it blocks for the disk write."
        )
    )
    checkpoint_gib: NonNegativeFloat = Field(
        description=(
            "GiB the busiest rank writes to disk per checkpoint: its share of the fp32 weights and"
            " AdamW state of its pipeline stage, each replicated piece written once (spread over"
            " the tp x dp ranks)."
        )
    )
    host_copy_gib: NonNegativeFloat = Field(
        description=(
            "GiB the busiest rank copies into host memory per memory checkpoint: every piece it"
            " holds (replicated over dp unless ZeRO >= 1)."
        )
    )
    host_copy_s: NonNegativeFloat = Field(
        description=(
            "Seconds of a memory checkpoint: host_copy_gib at"
            " cluster.host_memory_bandwidth_bytes_per_s (given for `disk` too, for comparison)."
        )
    )
    disk_write_s: NonNegativeFloat = Field(
        description=(
            "Seconds for a node to write its ranks' checkpoint_gib at"
            " cluster.disk_bandwidth_bytes_per_s (in the background for `memory`)."
        )
    )
    save_time_s: NonNegativeFloat = Field(
        description=(
            "Seconds training stops per checkpoint: host_copy_s (`memory`) or disk_write_s"
            " (`disk`)."
        )
    )
    interval_steps: PositiveInt = Field(
        description=(
            "Optimizer steps between checkpoints: Young/Daly's sqrt(2 x save_time_s x MTBF) in"
            " whole steps, at least one (and, for `memory`, at least disk_write_s, so that every"
            " checkpoint reaches the disk)."
        )
    )
    interval_s: NonNegativeFloat = Field(description="interval_steps x predicted.step_time_s.")
    goodput: float_in(0.0, 1.0) = Field(
        description=(
            "Expected fraction of wall time spent on steps that are kept: 1 - save_time_s /"
            " interval_s - (interval_s / 2 + restart_s) / MTBF, at least 0."
        )
    )


class Plan(_Section):
    """A hybrid-parallel plan, written by the planner for the runtime; load with ``Plan.load``,
    write with ``save``."""

    version: Literal[1] = Field(1, description="Plan file format version.")
    model: ModelInfo | None = Field(
        None, description="The model the plan was made for; written by the planner."
    )
    cluster: ClusterSpec | None = Field(
        None,
        description=(
            "The cluster: a preset name (`cluster: a100-80g`), `{name, num_nodes, gpus_per_node}`"
            " of a preset, or every figure (docs/clusters.md)."
        ),
    )
    training: TrainingConfig = Field(description="Batch, sequence length and precision.")
    parallel: ParallelConfig = Field(description="Degrees and strategies.")
    placement: Placement = Field(Placement(), description="Rank layout on the (pp, dp, tp) mesh.")
    stages: list[StageSpec] | None = Field(
        None,
        description=(
            "One entry per (virtual) stage, pp x virtual_stages in all; planned by `parallelize`"
            " when absent."
        ),
    )
    tensor_parallel: dict[str, TPStyle] | None = Field(
        None,
        description=(
            "Module path or glob (`layers.*.attn.qkv`; `*` matches one dotted component) -> split"
            " style; planned by `parallelize` when absent and tp > 1."
        ),
    )
    predicted: Predicted | None = Field(
        None,
        description="The planner's predictions; informational: training does not depend on them.",
    )
    checkpoint: CheckpointCost | None = Field(
        None,
        description=(
            "Checkpoint cost, best interval and expected goodput; written by `hyparallel plan"
            " --mtbf`, informational."
        ),
    )
    ps: PsConfig | None = Field(
        None,
        description=(
            "Parameter-server mode (optional): embedding tables on server processes, async SGD."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_before(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        data["cluster"] = _expand_cluster(data.get("cluster"))
        training, parallel = data.get("training"), data.get("parallel")
        # micro_batch follows from num_microbatches when only the latter is given.
        if (
            isinstance(training, dict)
            and isinstance(parallel, dict)
            and "micro_batch" not in training
        ):
            gb, dp, nmb = (
                training.get("global_batch"),
                parallel.get("dp", 1),
                parallel.get("num_microbatches"),
            )
            if all(type(v) is int and v > 0 for v in (gb, dp, nmb)) and gb % (dp * nmb) == 0:
                data["training"] = {**training, "micro_batch": gb // (dp * nmb)}
        return data

    @field_validator("parallel")
    @classmethod
    def _derive_microbatches(cls, parallel: ParallelConfig, info) -> ParallelConfig:
        training = info.data.get("training")
        if training is None:  # training itself failed; its error is reported
            return parallel
        per_step = parallel.dp * training.micro_batch
        if training.global_batch % per_step:
            raise ValueError(
                f"training.global_batch ({training.global_batch}) must be a multiple of dp"
                f" ({parallel.dp}) x micro_batch ({training.micro_batch}) = {per_step}; change"
                " global_batch, micro_batch or dp"
            )
        derived = training.global_batch // per_step
        if parallel.num_microbatches is None:
            parallel = parallel.model_copy(update={"num_microbatches": derived})
        elif parallel.num_microbatches != derived:
            raise ValueError(
                f"parallel.num_microbatches ({parallel.num_microbatches}) must equal "
                f"global_batch ({training.global_batch}) / "
                f"(dp ({parallel.dp}) x micro_batch ({training.micro_batch})) = {derived}; "
                "fix one of them or omit num_microbatches"
            )
        if parallel.schedule == "interleaved-1f1b" and parallel.pp > 1 and derived % parallel.pp:
            raise ValueError(
                f"interleaved-1f1b needs num_microbatches ({derived}) to be a multiple of pp"
                f" ({parallel.pp}); change global_batch or micro_batch"
            )
        return parallel

    @model_validator(mode="after")
    def _check_whole(self) -> Plan:
        par = self.parallel
        # a ps plan's servers may run on some of the GPUs' processes (the planner's pick; Note
        # [servers inside the launch] in hyparallel/planner/tables.py) or beside one worker per GPU
        # (servers asked for)
        inside = self.ps is not None and par.world_size + self.ps.servers == getattr(
            self.cluster, "num_gpus", 0
        )
        if self.cluster is not None and self.cluster.num_gpus != par.world_size and not inside:
            c = self.cluster
            raise ValueError(
                f"{par.degrees} = {par.world_size} GPUs, but cluster"
                f" '{c.name}' has {c.num_nodes} node(s) x {c.gpus_per_node} = {c.num_gpus}; change"
                " the degrees or cluster.num_nodes"
            )
        if self.stages is not None:
            expected = par.pp * par.virtual_stages
            if len(self.stages) != expected:
                raise ValueError(
                    f"stages lists {len(self.stages)} stage(s) but pp ({par.pp}) x virtual_stages"
                    f" ({par.virtual_stages}) = {expected}; list one entry per (virtual) stage or"
                    " drop 'stages' to have them derived"
                )
            for position, stage in enumerate(self.stages):
                if stage.index != position:
                    raise ValueError(
                        f"stages[{position}].index is {stage.index}; stages must be listed in order"
                        f" 0..{expected - 1}"
                    )
            seen: dict[str, int] = {}
            for stage in self.stages:
                for module in stage.modules:
                    if module in seen:
                        raise ValueError(
                            f"module '{module}' is in stages {seen[module]} and {stage.index}; "
                            "each module belongs to one stage"
                        )
                    seen[module] = stage.index
        if par.cp > 1 and self.ps is not None:
            raise ValueError(
                f"ps (parameter-server mode) needs cp 1, not cp {par.cp}: its workers run whole"
                " sequences; drop ps or set cp: 1"
            )
        if par.cp > 1 and self.training.seq_len % (2 * par.cp):
            raise ValueError(
                f"training.seq_len ({self.training.seq_len}) must be a multiple of 2 x cp"
                f" ({2 * par.cp}): context parallelism cuts each sequence into 2 cp equal chunks;"
                " change seq_len or cp"
            )
        if self.ps is not None and (par.tp > 1 or par.pp > 1):
            raise ValueError(
                f"ps (parameter-server mode) needs tp 1 and pp 1, not tp {par.tp} and pp {par.pp}:"
                " each worker runs the whole dense model; drop ps or set tp: 1 and pp: 1"
            )
        if self.predicted is not None and len(self.predicted.memory_gib) != par.pp:
            raise ValueError(
                f"predicted.memory_gib has {len(self.predicted.memory_gib)} entries; "
                f"give one per pipeline stage (pp = {par.pp})"
            )
        return self

    # ---- mesh helpers -------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """dp * tp * pp."""
        return self.parallel.world_size

    @property
    def launch_size(self) -> int:
        """Processes to launch: dp * tp * pp, plus the parameter servers in ps mode."""
        return self.parallel.world_size + (self.ps.servers if self.ps is not None else 0)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel replica."""
        assert self.parallel.num_microbatches is not None  # always derived by validation
        return self.parallel.num_microbatches

    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> degree, outermost axis first (the order of ``init_device_mesh``); a cp axis
        above 1 right inside dp (Note [rank order])."""
        shape = {}
        for axis in self.placement.order:
            shape[axis] = getattr(self.parallel, axis)
            if axis == "dp" and self.parallel.cp > 1:
                shape["cp"] = self.parallel.cp
        return shape

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates ``{"pp": i, "dp": j, "tp": k}`` of a global rank (and ``"cp"`` when cp >
        1)."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(
                f"rank {rank} is outside the plan's world of {self.world_size} processes"
            )
        coords = {}
        for axis, size in reversed(self.mesh_shape().items()):
            coords[axis] = rank % size
            rank //= size
        return {axis: coords[axis] for axis in ("pp", "dp", "cp", "tp") if axis in coords}

    def rank_of(self, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at mesh coordinates (pp, dp, tp) and cp rank ``cp``."""
        index = {"pp": pp, "dp": dp, "tp": tp, "cp": cp}
        rank = 0
        for axis, size in self.mesh_shape().items():
            rank = rank * size + index[axis]
        return rank

    def group_ranks(self, axis: str) -> list[list[int]]:
        """All process groups along ``axis`` (pp, dp, tp, or cp): each list is the ranks that differ
        only in that coordinate."""
        sizes = self.mesh_shape()
        sizes.setdefault(axis, 1)  # cp 1: every rank its own group
        others = [a for a in sizes if a != axis]
        groups = []
        for fixed in itertools.product(*(range(sizes[a]) for a in others)):
            where = dict(zip(others, fixed))
            groups.append([self.rank_of(**{**where, axis: k}) for k in range(sizes[axis])])
        return sorted(groups)

    # ---- I/O ----------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Load, validate and complete a plan file; errors are one line naming file and field."""
        return validate(cls, read_yaml(path), str(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> Plan:
        """Validate a plan given as plain data (e.g. parsed JSON)."""
        return validate(cls, data, source)

    def to_dict(self) -> dict:
        """Plain data in file order, without absent sections."""
        return self.model_dump(mode="json", exclude_none=True)

    def to_yaml(self) -> str:
        """The plan as YAML text."""
        return (
            "# hyparallel plan (version 1); edit freely, `hyparallel show` checks it.\n"
            + dump_yaml(self.to_dict())
        )

    def save(self, path: str | Path) -> None:
        """Write the plan as YAML; the file is replaced only once the new text is complete."""
        text = self.to_yaml()
        with atomic_output(path) as tmp:
            tmp.write_text(text)


def _expand_cluster(cluster: Any) -> Any:
    """``cluster: a100-80g`` or ``{name: a100-80g, num_nodes: 4}`` -> the full preset, resized."""
    if isinstance(cluster, str):
        return ClusterSpec.preset(cluster)
    if (
        isinstance(cluster, dict)
        and "device" not in cluster
        and cluster.get("name") in ClusterSpec.presets()
    ):
        extra = set(cluster) - {"name", "num_nodes", "gpus_per_node"}
        unknown = sorted(str(key) for key in extra - set(ClusterSpec.model_fields))
        if unknown:  # a typo, not a full spec: say so rather than list what a full spec would miss
            raise ValueError(
                f"cluster: unknown key '{unknown[0]}'; a preset takes name, num_nodes and"
                f" gpus_per_node (or give every figure: {', '.join(ClusterSpec.model_fields)})"
            )
        if extra:
            return cluster  # figures of a full spec: let validation name what is missing
        # The preset's figures with the given sizes, validated (and their bounds reported) with the
        # plan.
        return {**ClusterSpec.preset(cluster["name"]).model_dump(), **cluster}
    return cluster
