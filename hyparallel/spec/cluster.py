"""ClusterSpec: the devices and links a plan runs on, loaded from presets or YAML files.

All figures are per device (one GPU, or one process on a CPU machine) and per direction:
``intra_node.bandwidth_bytes_per_s`` is what one device can send to its neighbours inside a
node, ``inter_node.bandwidth_bytes_per_s`` what it can send across nodes (its share of the
node's network adapters). Presets live in ``configs/clusters/*.yaml`` with a comment giving
the source of every figure.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from hyparallel.spec import limits
from hyparallel.spec.errors import ConfigError
from hyparallel.spec.files import atomic_output, kind_of
from hyparallel.spec.yaml_io import dump_yaml, read_yaml, validate


def int_in(low: int, high: int) -> Any:
    """The type of an integer field from ``low`` to ``high`` inclusive (bools, floats and strings
    refused)."""
    return Annotated[int, Field(ge=low, le=high, strict=True)]


def _not_a_boolean(value: Any) -> Any:
    # pydantic's lax floats would read true as 1.0: a figure edited by mistake
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


def float_in(low: float, high: float | None = None) -> Any:
    """The type of a finite float field from ``low`` (inclusive) up to ``high`` (inf, nan and
    booleans refused).

    Numeric strings stay accepted: PyYAML reads ``3e14`` (no dot) as the string '3e14'.
    """
    return Annotated[
        float, Field(ge=low, le=high, allow_inf_nan=False), BeforeValidator(_not_a_boolean)
    ]


def float_above(low: float, high: float) -> Any:
    """As :func:`float_in`, with ``low`` itself refused (a duration that must be more than
    nothing)."""
    return Annotated[
        float, Field(gt=low, le=high, allow_inf_nan=False), BeforeValidator(_not_a_boolean)
    ]


PositiveInt = Annotated[int, Field(gt=0, strict=True)]
# finite; planner figures (seconds, GiB) with no upper bound of their own
NonNegativeFloat = float_in(0.0)
Flops = float_in(limits.MIN_RATE, limits.MAX_FLOPS)
BytesPerS = float_in(limits.MIN_RATE, limits.MAX_BYTES_PER_S)
LatencyS = float_in(0.0, limits.MAX_LATENCY_S)
MemoryBytes = int_in(1, limits.MAX_DEVICE_MEMORY_BYTES)

# The dtypes a device has a peak FLOP/s figure for (the fields of PeakFlops); a plan trains in a
# schema.Dtype.
PeakDtype = Literal["fp32", "tf32", "bf16", "fp16"]
Backend = Literal["nccl", "gloo"]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PeakFlops(_Frozen):
    """Dense (no structured sparsity) peak FLOP/s of one device by dtype."""

    fp32: Flops = Field(description="FLOP/s of fp32 arithmetic without tensor cores.")
    tf32: Flops = Field(
        description="FLOP/s of TF32 tensor-core matmuls (fp32 on machines without TF32)."
    )
    bf16: Flops = Field(description="FLOP/s of bf16 matmuls.")
    fp16: Flops = Field(description="FLOP/s of fp16 matmuls.")


Fraction = float_in(limits.MIN_EFFICIENCY, 1.0)


# Note [matmul curve]
#     A GEMM's efficiency falls below the device's plateau (matmul_efficiency) when it is too small
#     to keep every SM busy or too short along its reduction to amortise each tile's start and end:
#     cuBLAS splits the output into tiles, one thread block each, and each block loops over K
#     (NVIDIA, "Matrix Multiplication Background User's Guide", 2023, Sec. 2.1 and 3: tile and wave
#     quantization). The curve is Hockney's half-performance form (R. W. Hockney, "The Parallel
#     Computers 2", 1988: r(n) = r_inf n / (n + n_half)) in those two sizes:
#         factor = output / (output + half_output_elements) * k / (k + half_k)
#     with output = batch x M x N, the elements of C (every one a unit of parallel work) and k = K,
#     the reduction. It is relative, in (0, 1], and tends to 1 for large GEMMs, so matmul_efficiency
#     stays the plateau and scaling it scales every matmul. Fused attention uses the same form
#     (attention_curve): output = the query rows x head dim across batch and heads (FlashAttention-2
#     parallelises over them), k = the keys each query reads. A cluster file without a curve keeps
#     factor 1 (every matmul at matmul_efficiency, the model before curves existed): its
#     efficiencies were taken for the shapes it was written for, and loading it must not change its
#     predictions; `hyparallel calibrate` writes a fitted curve.
class MatmulCurve(_Frozen):
    """A matmul's efficiency relative to the plateau by its shape (Note [matmul curve]); both halves
    0: factor 1."""

    half_output_elements: float_in(0.0, limits.MAX_CURVE_ELEMENTS) = Field(
        description=(
            "Output elements (batch x M x N) at which the output's parallelism alone halves the"
            " efficiency."
        )
    )
    half_k: float_in(0.0, limits.MAX_CURVE_ELEMENTS) = Field(
        description="Reduction length K at which the reduction alone halves the efficiency."
    )

    def factor(self, output_elements: float, k: float) -> float:
        """The relative efficiency, in (0, 1], of a product with ``output_elements`` outputs reduced
        over ``k``."""
        if output_elements <= 0 or k <= 0:
            return 1.0
        return (
            output_elements / (output_elements + self.half_output_elements) * k / (k + self.half_k)
        )


# Note [activations a CPU computes]
#     A GPU's activation functions are memory-bound: their bytes at the memory bandwidth price them.
#     A CPU core computes a transcendental per element more slowly than it streams it: on the Intel
#     Xeon here tanh-GELU ran at 1.8 ns per fp32 element forward against the 0.57 its bytes take at
#     the copy bandwidth, on the AMD EPYC 4.4 ns against 1.2 (erf-GELU about half that, ReLU at its
#     bytes). `hyparallel calibrate` on a CPU times each common activation's forward and backward
#     per element (fp32, the dtype CPUs train in); the cost model charges an activation the larger
#     of that and its bytes at bandwidth (planner/profile.py, _op_times). The functions are named as
#     the graph names them: the module's or function's name lowercased, with GELU's approximation
#     appended ("gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh"); others run at their bytes.
class ElementCost(_Frozen):
    """Seconds per element of one activation function's forward and backward (Note [activations a
    CPU computes])."""

    forward_s: float_in(0.0, limits.MAX_LATENCY_S) = Field(
        description="Forward seconds per element."
    )
    backward_s: float_in(0.0, limits.MAX_LATENCY_S) = Field(
        description="Backward seconds per element (the input's gradient)."
    )


class DeviceSpec(_Frozen):
    """One accelerator (or one CPU process): compute, memory capacity and memory bandwidth.

    The efficiencies are the fractions of peak that real kernels reach (what ``hyparallel
    calibrate`` measures); ``reserved_bytes`` is memory the model cannot use (CUDA context,
    communication buffers, allocator slack).
    """

    name: str = Field(description="The device's name, for people.")
    peak_flops: PeakFlops = Field(description="Dense peak FLOP/s by dtype.")
    memory_bytes: MemoryBytes = Field(description="Total device memory in bytes.")
    memory_bandwidth_bytes_per_s: BytesPerS = Field(description="Peak memory (HBM) bandwidth.")
    matmul_efficiency: Fraction = Field(
        0.75,
        description=(
            "Fraction of peak FLOP/s that large matrix products reach (the plateau of"
            " matmul_curve)."
        ),
    )
    attention_efficiency: Fraction = Field(
        0.6,
        description=(
            "Fraction of peak FLOP/s that large fused attention reaches (the plateau of"
            " attention_curve)."
        ),
    )
    matmul_curve: MatmulCurve | None = Field(
        None,
        description=(
            "How matrix products of smaller shapes fall below matmul_efficiency (Note [matmul"
            " curve] in cluster.py); none: every product at matmul_efficiency."
        ),
    )
    attention_curve: MatmulCurve | None = Field(
        None,
        description=(
            "The same for fused attention, below attention_efficiency: output = query rows x head"
            " dim over batch and heads, k = keys; none: every attention at attention_efficiency."
        ),
    )
    kernel_floor_s: LatencyS = Field(
        0.0,
        description=(
            "The least time one kernel takes on the device whatever its size (launch and teardown),"
            " besides the host's op_overhead_s; 0 on a CPU."
        ),
    )
    memory_efficiency: Fraction = Field(
        0.8, description="Fraction of memory bandwidth that memory-bound kernels reach."
    )
    reserved_bytes: int_in(0, limits.MAX_DEVICE_MEMORY_BYTES) = Field(
        0,
        description=(
            "Memory the model cannot use (CUDA context, communication buffers, allocator slack);"
            " less than memory_bytes."
        ),
    )
    op_overhead_s: LatencyS = Field(
        0.0,
        description=(
            "Host time to dispatch one op (Python, the framework, the kernel launch): a GPU op"
            " takes at least this long, a CPU op (backend gloo) this long on top of its work."
        ),
    )
    activation_costs: dict[str, ElementCost] = Field(
        default_factory=dict,
        description=(
            "Compute time per element of activation functions where it exceeds their memory traffic"
            " (a CPU's GELU, SiLU), by function name ('gelu', 'gelu_tanh', 'silu', ...: Note"
            " [activations a CPU computes] in cluster.py); empty: every activation at its bytes"
            " over memory bandwidth."
        ),
    )

    @model_validator(mode="after")
    def _check_memory(self) -> DeviceSpec:
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(
                f"device.reserved_bytes ({self.reserved_bytes:,}) must be less than memory_bytes "
                f"({self.memory_bytes:,}): nothing would be left for the model"
            )
        return self

    @property
    def usable_memory_bytes(self) -> int:
        """Memory left for parameters, gradients, optimizer state and activations."""
        return self.memory_bytes - self.reserved_bytes


class LinkSpec(_Frozen):
    """An interconnect as seen from one device: per-direction bandwidth and per-message latency."""

    name: str = Field(description="The link's name, for people.")
    bandwidth_bytes_per_s: BytesPerS = Field(
        description=(
            "Bytes per second one device sends in one direction, as collectives reach it (bus"
            " bandwidth)."
        )
    )
    latency_s: LatencyS = Field(
        description=(
            "Seconds per message (and per step of a ring collective, unless collective_latency_s"
            " says)."
        )
    )
    collective_latency_s: LatencyS | None = Field(
        None,
        description=(
            "Seconds per step of a ring collective where it differs from a message's latency_s"
            " (gloo's all-reduce on a CPU: Note [a collective's latency] in calibrate.py); none:"
            " latency_s."
        ),
    )

    @property
    def step_latency_s(self) -> float:
        """The latency of one step of a ring collective: collective_latency_s, else latency_s."""
        return self.latency_s if self.collective_latency_s is None else self.collective_latency_s


class ClusterSpec(_Frozen):
    """A homogeneous cluster: ``num_nodes`` nodes of ``gpus_per_node`` identical devices."""

    name: str = Field(description="Preset name, or any name for a cluster file.")
    description: str = Field("", description="One line for people.")
    num_nodes: int_in(1, limits.MAX_DEVICES) = Field(
        1, description="Nodes; `--gpus` and `ClusterSpec.preset(..., num_nodes=)` resize it."
    )
    gpus_per_node: int_in(1, limits.MAX_GPUS_PER_NODE) = Field(
        description="Devices (processes) per node."
    )
    backend: Backend = Field(
        description=(
            "The torch.distributed backend the link figures are for: `nccl` for GPUs, `gloo` for"
            " CPUs (`parallelize` picks its backend from the device)."
        )
    )
    device: DeviceSpec = Field(description="One device's compute and memory.")
    intra_node: LinkSpec = Field(description="The link between devices of one node.")
    inter_node: LinkSpec = Field(description="A device's share of the network between nodes.")
    # Checkpoint figures (docs/cost-model.md, "Checkpoints and goodput"); optional: only `hyparallel
    # plan --mtbf` reads them, and a cluster file written before they existed still loads.
    host_memory_bandwidth_bytes_per_s: BytesPerS | None = Field(
        None,
        description=(
            "Bytes per second of one device's memory checkpoint, every device of its node saving at"
            " once: the copy off the device and its write into the node's shared memory, as"
            ' `hp.checkpoint.save(..., storage="memory")` makes them.'
        ),
    )
    disk_bandwidth_bytes_per_s: BytesPerS | None = Field(
        None,
        description=(
            "Bytes per second one node writes to the checkpoint directory, shared by its devices "
            "(local NVMe, or the node's share of a shared file system)."
        ),
    )
    # Parameter-server figure (docs/cost-model.md, "Embedding tables: parameter servers or GPUs");
    # optional: the planner assumes a default
    # (hyparallel.planner.servers.DEFAULT_SERVER_MEMORY_BYTES) when it is absent.
    ps_server_memory_bytes: MemoryBytes | None = Field(
        None,
        description=(
            "Host memory one parameter-server process may fill with its rows of the tables, the"
            " dense weights it holds, their optimizer state and a step's staged pushes (ps mode);"
            " none: 512 GiB, one socket's share of a DGX A100's host memory."
        ),
    )

    @model_validator(mode="after")
    def _check_size(self) -> ClusterSpec:
        if self.num_gpus > limits.MAX_DEVICES:
            raise ValueError(
                f"num_nodes ({self.num_nodes:,}) x gpus_per_node ({self.gpus_per_node:,}) ="
                f" {self.num_gpus:,} devices, more than the {limits.MAX_DEVICES:,} hyparallel plans"
                " for; use fewer nodes"
            )
        return self

    @property
    def num_gpus(self) -> int:
        """Devices in the whole cluster."""
        return self.num_nodes * self.gpus_per_node

    def resized(
        self, num_nodes: int | None = None, gpus_per_node: int | None = None
    ) -> ClusterSpec:
        """The same hardware with another node count or devices per node."""
        update = {}
        if num_nodes is not None:
            update["num_nodes"] = num_nodes
        if gpus_per_node is not None:
            update["gpus_per_node"] = gpus_per_node
        return validate(ClusterSpec, {**self.model_dump(), **update}, f"cluster '{self.name}'")

    @staticmethod
    def presets() -> list[str]:
        """Names of the built-in presets (``configs/clusters/*.yaml``)."""
        return sorted(
            p.name.removesuffix(".yaml") for p in preset_dir().iterdir() if p.name.endswith(".yaml")
        )

    @classmethod
    def preset(
        cls, name: str, num_nodes: int | None = None, gpus_per_node: int | None = None
    ) -> ClusterSpec:
        """A built-in preset, optionally resized: ``ClusterSpec.preset("a100-80g",
        num_nodes=16)``."""
        names = cls.presets()
        if name not in names:
            raise ConfigError(
                f"unknown cluster preset '{name}'; choose one of: {', '.join(names)} (or pass a"
                " YAML file)"
            )
        spec = cls.load(preset_dir() / f"{name}.yaml")
        return (
            spec
            if num_nodes is None and gpus_per_node is None
            else spec.resized(num_nodes, gpus_per_node)
        )

    @classmethod
    def load(cls, path: str | Path) -> ClusterSpec:
        """Load and validate a cluster YAML file; errors name the file and field."""
        return validate(cls, read_yaml(path), str(path))

    @classmethod
    def resolve(
        cls, name_or_path: str, num_nodes: int | None = None, gpus_per_node: int | None = None
    ) -> ClusterSpec:
        """A preset name or a YAML file path, as the CLI's ``--cluster`` accepts."""
        kind = kind_of(name_or_path) if name_or_path else "missing"
        # loaded, to say "is a folder"
        is_folder = kind == "folder" and name_or_path not in cls.presets()
        if name_or_path.endswith((".yaml", ".yml")) or kind == "file" or is_folder:
            spec = cls.load(name_or_path)
            return (
                spec
                if num_nodes is None and gpus_per_node is None
                else spec.resized(num_nodes, gpus_per_node)
            )
        return cls.preset(name_or_path, num_nodes, gpus_per_node)

    def to_yaml(self) -> str:
        """This spec as YAML text (an optional figure left out is not written)."""
        return dump_yaml(self.model_dump(mode="json", exclude_none=True))

    def save(self, path: str | Path) -> None:
        """Write this spec as YAML; the file is replaced only once the new text is complete."""
        with atomic_output(path) as tmp:
            tmp.write_text(self.to_yaml())


def preset_dir():
    """The folder of the built-in cluster presets (``configs/clusters``, shipped as
    ``hyparallel.configs``)."""
    return resources.files("hyparallel.configs") / "clusters"
