"""DLRM (Naumov et al. 2019): embedding-bag tables for sparse features, MLPs for dense ones, dot
interaction.

``forward(dense (B, num_dense) float, sparse (B, num_tables, bag) int64) -> logits (B,)``; the loss
is
``bce_loss(logits, clicks)`` = ``F.binary_cross_entropy_with_logits`` (the model applies no
sigmoid). Shapes follow Facebook's reference (github.com/facebookresearch/dlrm,
``dlrm_s_pytorch.py``) with
``--arch-interaction-op=dot``: the bottom MLP maps the dense features to one embedding-sized vector,
the interaction takes the pairwise dot products of it and the tables' pooled embeddings, and the top
MLP reads those beside the bottom output. ``synthetic_clicks`` / ``batch_for`` make a click log with
a learnable signal, batch by batch, so any process can regenerate any batch of it.
"""

# Note [one call per table]
#     Each table is called as ``self.tables[t](sparse[:, t, :])``: a (B, bag) id tensor, fixed-size
#     bags, no offsets. A parameter-server runtime swaps each EmbeddingBag module for a remote one
#     taking that same input, so the call form is part of the model's contract: keep it when editing
#     ``forward``.
# Note [the interaction's pairs]
#     The (T+1) x (T+1) gram matrix Z of the bottom output and the T pooled embeddings is symmetric,
#     so its strictly-upper and strictly-lower triangles hold the same (T+1)T/2 dot products. The
#     pairs are taken in Facebook's order (``interact_features``: row i, then column j < i, with
#     ``arch_interaction_itself`` off), so the top MLP's first weight lines up column for column
#     with a model trained by the reference code.

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hyparallel.models.bounds import check_int, check_number
from hyparallel.spec.limits import MAX_FFN_HIDDEN, MAX_HIDDEN, MAX_LAYERS, MAX_PARAMS

# Rows of one table: 2^32 = 4.3 billion, a hundred times Criteo Terabyte's largest (39,979,771 under
# MLPerf's 40M hashing); indices are int64, so nothing overflows below it.
MAX_TABLE_ROWS = 2**32
# Sparse features (tables): 2^12 = 4,096, over a hundred times Criteo's 26; the trace holds one op
# per table.
MAX_TABLES = 2**12
# Ids per feature per sample: Criteo's features are one-hot (1); 2^16 leaves room for long multi-hot
# histories.
MAX_BAG = 2**16


def _widths(name: str, value: object) -> tuple[int, ...]:
    """``value`` (a tuple, or a list from a YAML override) as a tuple of checked widths."""
    if not isinstance(value, (tuple, list)) or len(value) > MAX_LAYERS:
        raise ValueError(
            f"{name} must be a list of up to {MAX_LAYERS} layer widths, got {value!r:.40}"
        )
    for width in value:
        check_int(f"{name} width", width, 1, MAX_FFN_HIDDEN)
    return tuple(value)


@dataclass(frozen=True)
class DLRMConfig:
    """Shape of a DLRM: dense features, one embedding table per sparse feature, the two MLPs' hidden
    widths."""

    num_dense: int
    table_rows: tuple[int, ...]
    dim: int
    bottom: tuple[int, ...]
    top: tuple[int, ...]
    bag: int = 1

    def __post_init__(self) -> None:
        check_int("num_dense", self.num_dense, 1, MAX_HIDDEN)
        check_int("dim", self.dim, 1, MAX_HIDDEN)
        check_int("bag", self.bag, 1, MAX_BAG)
        if (
            not isinstance(self.table_rows, (tuple, list))
            or not 1 <= len(self.table_rows) <= MAX_TABLES
        ):
            raise ValueError(
                f"table_rows must list 1 to {MAX_TABLES:,} table sizes, got {self.table_rows!r:.40}"
            )
        for rows in self.table_rows:
            check_int("table_rows entry", rows, 1, MAX_TABLE_ROWS)
        # frozen: lists from overrides -> tuples
        object.__setattr__(self, "table_rows", tuple(self.table_rows))
        object.__setattr__(self, "bottom", _widths("bottom", self.bottom))
        object.__setattr__(self, "top", _widths("top", self.top))
        if self.num_params() > MAX_PARAMS:
            raise ValueError(
                f"the model would have {self.num_params():,} parameters, over {MAX_PARAMS:,}"
            )

    @property
    def num_tables(self) -> int:
        """Sparse features, one embedding table each."""
        return len(self.table_rows)

    @property
    def interaction_width(self) -> int:
        """Width of the top MLP's input: the bottom output and the (T+1)T/2 pairwise dot
        products."""
        vectors = self.num_tables + 1
        return self.dim + vectors * (vectors - 1) // 2

    def mlp_widths(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Layer widths, input first: bottom num_dense -> ... -> dim, top interaction -> ... ->
        1."""
        return (self.num_dense, *self.bottom, self.dim), (self.interaction_width, *self.top, 1)

    def num_params(self) -> int:
        """Closed-form parameter count: the tables' rows x dim plus each Linear's weight and
        bias."""
        mlps = sum(i * o + o for widths in self.mlp_widths() for i, o in zip(widths, widths[1:]))
        return sum(self.table_rows) * self.dim + mlps


def _mlp(widths: tuple[int, ...], last_relu: bool) -> nn.Sequential:
    """Linear+ReLU for each consecutive pair of widths; the last Linear without ReLU unless
    ``last_relu``."""
    layers: list[nn.Module] = []
    for i, (width_in, width_out) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(width_in, width_out))
        if last_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """``forward(dense (B, num_dense), sparse (B, num_tables, bag) int64) -> logits (B,)``."""

    def __init__(self, cfg: DLRMConfig):
        super().__init__()
        self.config = cfg
        bottom, top = cfg.mlp_widths()
        self.bottom = _mlp(bottom, last_relu=True)  # the reference's bottom MLP ends in ReLU too
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, cfg.dim, mode="sum") for rows in cfg.table_rows
        )
        # logits: the reference's final sigmoid is left to the loss
        self.top = _mlp(top, last_relu=False)
        vectors = cfg.num_tables + 1
        # Note [the interaction's pairs]
        pairs = [i * vectors + j for i in range(vectors) for j in range(i)]
        self.register_buffer("pairs", torch.tensor(pairs, dtype=torch.long), persistent=False)
        self.init_weights()

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)  # (B, dim)
        # Note [one call per table]
        pooled = [self.tables[t](sparse[:, t, :]) for t in range(len(self.tables))]
        vectors = torch.stack([x, *pooled], dim=1)  # (B, T+1, dim)
        gram = torch.bmm(vectors, vectors.transpose(1, 2))  # (B, T+1, T+1)
        dots = gram.flatten(1)[:, self.pairs]  # (B, (T+1)T/2)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Tables uniform(-1/sqrt(rows), 1/sqrt(rows)) as the reference; Linear layers keep torch's
        default."""
        for table in self.tables:
            bound = 1.0 / math.sqrt(table.num_embeddings)
            nn.init.uniform_(table.weight, -bound, bound)

    def init_std(self, name: str) -> float:
        """Std of parameter ``name``'s eager init, for ``materialize_``'s normal draws (uniform(-b,
        b): b/sqrt 3)."""
        module = self.get_submodule(name.rpartition(".")[0])
        # a table's rows, a Linear's inputs
        fan = getattr(module, "num_embeddings", None) or module.in_features
        # torch's Linear default is uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) too
        return 1.0 / math.sqrt(3 * fan)

    def example_inputs(
        self, batch_size: int, seq_len: int = 1, device: torch.device | str = "meta"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(dense, sparse) of ``batch_size`` samples for tracing; ``seq_len`` has no meaning here
        and is ignored."""
        cfg = self.config
        dense = torch.zeros(batch_size, cfg.num_dense, device=device)
        sparse = torch.zeros(batch_size, cfg.num_tables, cfg.bag, dtype=torch.long, device=device)
        return dense, sparse


def bce_loss(logits: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
    """DLRM's loss: mean binary cross-entropy of the logits (B,) against clicks (B,) in {0., 1.}."""
    return F.binary_cross_entropy_with_logits(logits, clicks)


# Note [the synthetic click log]
#     A click is drawn from a hidden logistic model: logit = w . dense + sum over tables of the mean
#     score of the sample's ids. The scores are indexed by id % SCORE_SLOTS, so a table of 40M rows
#     needs no 40M-entry array, and tables smaller than that get one score per id. The hidden model
#     (w, the scores) is fixed by the config alone (drawn from TRUTH_SEED), the same in every batch;
#     a batch's seed draws only its samples. Each term's scale is TERM_STD (a bag's mean of several
#     ids varies less): measured over 100K samples, the logit's std is 1.9 / 1.7 / 2.1 for dlrm-tiny
#     / -mid / -criteo-tb, and the hidden model's own BCE 0.47 / 0.49 / 0.43, well below a constant
#     predictor's log 2 = 0.693, so a model that learns the signal shows it in its loss. Ids are
#     Zipf-distributed, the hot ones the smallest: a table sharded by row ranges finds its hot rows
#     on its first shard.
# a prime: ids that are multiples of a small number do not share a slot more than others
SCORE_SLOTS = 1009
TRUTH_SEED = 0xD1_4A  # any fixed number: the hidden model must not depend on the batch's seed
# scale of each logit term (dense, sparse): chosen to give the BCE figures of the Note
TERM_STD = 1.5
# a prime above a million: seeds of (seed, index) are distinct for index < it
BATCH_STRIDE = 1_000_003


def _truth(cfg: DLRMConfig) -> tuple[np.ndarray, np.ndarray]:
    """The hidden model's dense weights (num_dense,) and id scores (num_tables, SCORE_SLOTS)."""
    rng = np.random.default_rng(TRUTH_SEED)
    weights = rng.standard_normal(cfg.num_dense) * (TERM_STD / math.sqrt(cfg.num_dense))
    scores = rng.standard_normal((cfg.num_tables, SCORE_SLOTS)) * (
        TERM_STD / math.sqrt(cfg.num_tables)
    )
    return weights, scores


def synthetic_clicks(
    config: DLRMConfig, batch: int, seed: int, zipf_a: float = 1.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One batch of a synthetic click log, the same for the same (config, batch, seed, zipf_a).

    Returns dense (B, num_dense) float32 ~ N(0, 1), sparse (B, num_tables, bag) int64 ids with
    ``(zipf(zipf_a) - 1) % rows`` per table, and clicks (B,) float32 in {0, 1} drawn from a hidden
    logistic model (Note [the synthetic click log]).
    """
    check_int("batch", batch, 1, 2**31)
    check_number("zipf_a", zipf_a, 1.0, 100.0, open_low=True)  # numpy's zipf needs a > 1
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((batch, config.num_dense), dtype=np.float32)
    rows = np.asarray(config.table_rows, dtype=np.int64)[None, :, None]
    # (B, T, bag)
    sparse = (rng.zipf(zipf_a, size=(batch, config.num_tables, config.bag)) - 1) % rows
    weights, scores = _truth(config)
    # (B, T, bag)
    table_score = scores[np.arange(config.num_tables)[None, :, None], sparse % SCORE_SLOTS]
    logit = dense.astype(np.float64) @ weights + table_score.mean(axis=2).sum(axis=1)
    clicks = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(clicks)


def batch_for(
    config: DLRMConfig, batch_size: int, index: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch number ``index`` of click log ``seed``: any process regenerates it (a data shard is a
    range of indices).

    Logs of different seeds share no batch while ``index`` < BATCH_STRIDE (1,000,003).
    """
    return synthetic_clicks(config, batch_size, seed * BATCH_STRIDE + index)
