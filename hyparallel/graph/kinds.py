"""Classify traced operations into the op kinds the planner reasons about."""

from __future__ import annotations

import functools
import operator
from typing import Any, Literal

import torch
from torch import nn

OpKind = Literal[
    "input",
    "output",
    "embedding",
    "linear",
    "matmul",
    "attention",
    "norm",
    "activation",
    "dropout",
    "elementwise",
    "view",
    "loss",
    "other",
]

_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "flex_attention",
    "multi_head_attention_forward",
}
_MATMUL = {
    "matmul",
    "mm",
    "bmm",
    "baddbmm",
    "addmm",
    "addbmm",
    "einsum",
    "linear",
    "conv1d",
    "conv2d",
    "convolution",
    "__matmul__",
}
# Grouped matrix products (mixture-of-experts layers): torch's, and the fallback op transformers
# registers for CPU and fp32. torch's FLOP counter knows none of them: the tracer counts them (Note
# [grouped matmul FLOPs]).
GROUPED_MM = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
_MATMUL |= GROUPED_MM
# The ATen ops of an embedding bag (torch.export shows them; torch's FLOP counter counts none of
# them).
EMBEDDING_BAG_OPS = frozenset({"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"})
_EMBEDDING = {"embedding", *EMBEDDING_BAG_OPS}
_NORM = {
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "batch_norm",
    "native_batch_norm",
    "instance_norm",
}
_ACTIVATION = {
    "swiglu",
    "gelu",
    "silu",
    "relu",
    "relu_",
    "tanh",
    "sigmoid",
    "mish",
    "softplus",
    "leaky_relu",
    "elu",
    "hardswish",
    "glu",
}
_DROPOUT = {
    "dropout",
    "native_dropout",
    "dropout_",
    "alpha_dropout",
    "feature_dropout",
    "bias_dropout_residual",
}
_LOSS = {
    "cross_entropy",
    "nll_loss",
    "nll_loss_forward",
    "mse_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
    "smooth_l1_loss",
    "l1_loss",
    "huber_loss",
}
# Op names that view, reshape or look up a tensor (kind "view"); the tracer runs them without its
# FLOP counter.
VIEW_OPS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "permute",
    "unflatten",
    "flatten",
    "expand",
    "expand_as",
    "contiguous",
    "chunk",
    "split",
    "split_with_sizes",
    "unbind",
    "getitem",
    "size",
    "dim",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "t",
    "narrow",
    "alias",
    "detach",
    "view_as",
    "movedim",
    "numel",
    "getattr",
    "sym_size",
    "clone",
}

# Note [what acts on each token on its own]
#     Sequence parallelism hands each tensor-parallel rank a slice of the sequence between the split
#     regions, so every op there must compute each token from that token alone. That is proved by
#     name, never assumed: the ops below act per element (with broadcasting; type casts and fills
#     included), and REDUCTIONS reduce over the dims they are given, which the structure accepts
#     only where the output keeps the (batch, seq) prefix of the input. Anything else met on the
#     token stream between the split regions (an FFT over the sequence, a cumsum, a sort of the
#     tokens for expert dispatch, a convolution, a softmax over an unknown dim, a custom op) refuses
#     sequence parallelism for the model; tensor parallelism itself is untouched.
POINTWISE = frozenset(
    {
        *(
            "add",
            "sub",
            "rsub",
            "mul",
            "div",
            "true_divide",
            "floor_divide",
            "remainder",
            "fmod",
            "neg",
            "pow",
        ),
        *(
            "exp",
            "exp2",
            "expm1",
            "log",
            "log1p",
            "log2",
            "sqrt",
            "rsqrt",
            "reciprocal",
            "square",
            "abs",
            "sign",
        ),
        *(
            "sin",
            "cos",
            "tanh",
            "sigmoid",
            "erf",
            "erfc",
            "relu",
            "gelu",
            "silu",
            "softplus",
            "hardtanh",
            "mish",
        ),
        *(
            "clamp",
            "clamp_min",
            "clamp_max",
            "clip",
            "where",
            "masked_fill",
            "maximum",
            "minimum",
            "lerp",
        ),
        *(
            "addcmul",
            "addcdiv",
            "round",
            "floor",
            "ceil",
            "trunc",
            "nan_to_num",
            "eq",
            "ne",
            "lt",
            "le",
            "gt",
        ),
        *(
            "ge",
            "logical_and",
            "logical_or",
            "logical_not",
            "bitwise_and",
            "bitwise_or",
            "bitwise_not",
        ),
        *(
            "to",
            "_to_copy",
            "type_as",
            "float",
            "half",
            "bfloat16",
            "double",
            "type",
            "copy",
            "copy_",
            "clone",
        ),
        *(
            "zeros_like",
            "ones_like",
            "empty_like",
            "full_like",
            "fill",
            "detach",
            "alias",
            "lift_fresh_copy",
        ),
        *(
            "contiguous",
            "dropout",
            "native_dropout",
            "bias_dropout_residual",
            "__add__",
            "__mul__",
            "__sub__",
        ),
        *("__truediv__", "__radd__", "__rmul__", "__neg__", "iadd", "imul", "add_", "mul_"),
    }
)
REDUCTIONS = frozenset(
    {
        "mean",
        "sum",
        "var",
        "std",
        "var_mean",
        "amax",
        "amin",
        "max",
        "min",
        "norm",
        "linalg_vector_norm",
        "prod",
    }
)


# Note [embedding bag FLOPs]
#     An embedding lookup moves rows and computes nothing (0 FLOPs, costed by its bytes). An
#     embedding bag also pools each bag of rows: a sum, mean or max of ``bag`` rows of ``dim``
#     values each, one add (or compare) per gathered value into the bag's accumulator, as the
#     kernels run it, and one multiply more with per-sample weights. So a bag op counts numel(ids) *
#     dim FLOPs (twice that, weighted): for a (B, bag) id tensor, B * bag * dim. They are tiny
#     beside a model's matrix products; the bytes gathered are the real cost.


def embedding_bag_flops(ids: Any, dim: int, per_sample_weights: Any = None) -> int:
    """Forward FLOPs of pooling the bags of ``ids`` from rows of width ``dim`` (Note [embedding bag
    FLOPs])."""
    if not isinstance(ids, torch.Tensor):
        return 0
    return ids.numel() * dim * (2 if per_sample_weights is not None else 1)


def target_name(target: Any) -> str:
    """A short name for an fx node target: 'addmm', 'scaled_dot_product_attention', 'view',
    'add'."""
    if isinstance(target, str):
        return target
    schema = getattr(target, "_schema", None)
    if schema is not None:  # an ATen OpOverload: aten::addmm.default -> addmm
        return schema.name.split("::")[-1]
    if target in (operator.getitem,):
        return "getitem"
    return getattr(target, "__name__", type(target).__name__)


def function_kind(name: str) -> OpKind:
    """Kind of a functional op (torch function, tensor method or ATen op) by its short name."""
    name = name.removesuffix("_") if name.endswith("_") and not name.startswith("_") else name
    if name in _ATTENTION:
        return "attention"
    if name in _MATMUL:
        return "matmul"
    if name in _EMBEDDING:
        return "embedding"
    if name in _NORM:
        return "norm"
    if name in _DROPOUT:
        return "dropout"
    if name in _ACTIVATION:
        return "activation"
    if name in _LOSS:
        return "loss"
    if name in VIEW_OPS:
        return "view"
    return "elementwise"


def module_kind(module: nn.Module, inner: list[str] | None = None) -> OpKind:
    """Kind of a leaf module call; ``inner`` are the short names of the ATen ops it ran, when
    known."""
    inner = inner or []
    name = type(module).__name__
    if isinstance(module, nn.MultiheadAttention):
        return "attention"
    # transformers' Conv1D is a transposed Linear
    if isinstance(module, nn.Linear) or name == "Conv1D":
        return "linear"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return "embedding"
    standard = base_forward(module)  # Note [a layer that computes a standard one]
    if standard:
        return "embedding" if standard == "Embedding" else "linear"
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return "dropout"
    if name.endswith("Norm") or isinstance(
        module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)
    ):
        return "norm"
    if type(module).__module__ == nn.modules.activation.__name__:
        return "activation"
    if isinstance(module, nn.modules.loss._Loss):
        return "loss"
    weight = getattr(module, "weight", None)
    matmuls = [op for op in inner if op in _MATMUL]
    if len(matmuls) == 1 and isinstance(weight, nn.Parameter) and weight.dim() == 2:
        return "linear"  # a custom linear layer (one matrix product against a 2-D weight)
    kinds = {function_kind(op) for op in inner} - {"view"}
    if len(kinds) == 1:
        return kinds.pop()
    if "Activation" in name or "GELU" in name or "SiLU" in name:
        return "activation"
    return "other" if not inner else "elementwise"


# Note [a module replaced by type]
#     Tensor parallelism swaps a Linear for a ColumnParallelLinear and an Embedding for a
#     VocabParallelEmbedding: layers that reimplement nn.Linear.forward / nn.Embedding.forward on a
#     shard. A subclass with its own forward (Gemma's scaled word embedding multiplies by
#     embed_scale) would lose what it adds, so the tracer records, as a fact of the graph, whether a
#     leaf module runs its standard base's forward unchanged; the structure
#     (hyparallel.graph.structure) splits nothing else. Whether an overriding forward happens to
#     compute the same thing is not decided here: such a layer stays replicated, which is always
#     correct.
def base_forward(module: nn.Module) -> str:
    """The standard layer whose own forward ``module`` runs: "Linear", "Embedding", "Conv1D"
    (transformers'), or ""."""
    forward = type(module).forward
    if isinstance(module, nn.Linear):
        return "Linear" if forward is nn.Linear.forward else ""
    if isinstance(module, nn.Embedding):
        return "Embedding" if forward is nn.Embedding.forward else ""
    conv1d = next((cls for cls in type(module).__mro__ if cls.__name__ == "Conv1D"), None)
    if conv1d is not None:
        return "Conv1D" if forward is conv1d.forward else ""
    return _computes(module)


# Note [a layer that computes a standard one]
#     torchtitan's Llama (and many a user's model) brings its own Linear and Embedding classes: not
#     subclasses of torch's, so by type nothing would split ("tp 2 splits nothing"). A module
#     without children whose parameters are a 2-D ``weight`` (and a 1-D ``bias``) and whose forward,
#     traced by torch.fx on its own, is exactly ``F.linear(input, self.weight[, self.bias])`` (or
#     ``F.embedding(input, self.weight)`` with no padding_idx, max_norm or sparse gradient) computes
#     what nn.Linear (nn.Embedding) computes: it is split as one. Anything more in its forward (a
#     scale, a cast, another op) keeps it replicated, as for a subclass that overrides it.
def _computes(module: nn.Module) -> str:
    """ "Linear" or "Embedding" when ``module``'s forward is exactly that standard layer's (the Note
    above)."""
    if next(module.children(), None) is not None or type(module).__module__.startswith("torch."):
        return ""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if (
        weight is None
        or weight.dim() != 2
        or set(params) - {"weight", "bias"}
        or (bias is not None and bias.dim() != 1)
    ):
        return ""
    return _forward_is(type(module), bias is not None)


_EMBEDDING_DEFAULTS = {
    "padding_idx": None,
    "max_norm": None,
    "norm_type": 2.0,
    "scale_grad_by_freq": False,
    "sparse": False,
}


@functools.cache
def _forward_is(cls: type, has_bias: bool) -> str:
    import torch.fx as fx
    import torch.nn.functional as F

    try:
        probe = cls.__new__(cls)
        nn.Module.__init__(probe)
        probe.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
        probe.bias = nn.Parameter(torch.empty(4, device="meta")) if has_bias else None
        graph = fx.symbolic_trace(probe).graph
    except Exception:  # noqa: BLE001 -- a forward torch.fx cannot follow on its own is not judged standard
        return ""
    calls = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    attrs = {n: n.target for n in graph.nodes if n.op == "get_attr"}
    if len(calls) != 1 or len(inputs) != 1 or calls[0].op != "call_function":
        return ""
    if any(
        _EMBEDDING_DEFAULTS.get(key, object()) != value for key, value in calls[0].kwargs.items()
    ):
        # a padding row, a max_norm (or anything but F.embedding's defaults): not the plain layer
        return ""
    call, args = calls[0], tuple(calls[0].args)
    while args and args[-1] is None:  # F.linear(x, self.weight, self.bias) with bias None
        args = args[:-1]
    named = [attrs.get(a) for a in args[1:]]
    if (
        call.target is F.linear
        and args[:1] == (inputs[0],)
        and named == (["weight", "bias"] if has_bias else ["weight"])
    ):
        return "Linear"
    if (
        call.target in (F.embedding, torch.embedding)
        and args[:1] == (inputs[0],)
        and named == ["weight"]
    ):
        return "Embedding"
    return ""


def writes_in_place(target: str) -> bool:
    """Whether an op of this target writes into a tensor it is given (``x.add_(y)``, ``out[i] = y``,
    ``x += y``)."""
    return (
        target == "setitem"
        or target in ("iadd", "isub", "imul", "itruediv", "ior", "iand")
        or (target.endswith("_") and not target.endswith("__"))
    )


def logits_of(output: Any) -> Any:
    """What the default loss reads of a model's output: ``output.logits`` (a Hugging Face output) or
    ``output["logits"]``; None when it has neither (then the loss reads the whole output)."""
    if hasattr(output, "logits"):
        return output.logits
    return output.get("logits") if isinstance(output, dict) else None
