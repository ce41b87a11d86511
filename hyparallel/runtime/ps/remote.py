"""Embedding tables whose rows live on the parameter servers: the modules a worker's model runs
with.

``RemoteEmbedding`` replaces an ``nn.Embedding`` or ``nn.EmbeddingBag`` and takes the same inputs.
In its forward it pulls the distinct rows the input names (one request per server, sent together),
runs torch's own
``F.embedding`` / ``F.embedding_bag`` on them with the ids renumbered, and keeps the pulled rows as
a leaf tensor whose gradient is the sparse gradient the worker pushes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (table, {server: local rows}) -> {server: rows (U_s, dim)}: the worker's pull, one request per
# server.
PullFn = Callable[[str, dict[int, torch.Tensor]], dict[int, torch.Tensor]]


def unsupported(module: nn.Module) -> str | None:
    """Why a table cannot live on parameter servers (None when it can)."""
    if not isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return f"is a {type(module).__name__}, not an nn.Embedding or nn.EmbeddingBag"
    if module.max_norm is not None:
        return (
            "has max_norm, which renormalises rows in place during forward; servers cannot do that"
        )
    if module.scale_grad_by_freq:
        return "has scale_grad_by_freq, which needs the whole batch's id counts on one process"
    return None


class RemoteEmbedding(nn.Module):
    """An embedding table held by ``servers`` parameter servers; forward as the module it
    replaces."""

    def __init__(
        self, original: nn.Embedding | nn.EmbeddingBag, name: str, servers: int, pull: PullFn
    ) -> None:
        super().__init__()
        self.table, self.servers, self._pull = name, servers, pull
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.padding_idx = original.padding_idx
        self.bag_mode = original.mode if isinstance(original, nn.EmbeddingBag) else None
        self.include_last_offset = getattr(original, "include_last_offset", False)
        # (global ids (U,), rows (U, dim) leaf) per call
        self.pulled: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(
        self, ids: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights=None
    ):
        unique, inverse = torch.unique(ids, return_inverse=True)
        if len(unique) and (unique[0] < 0 or unique[-1] >= self.num_embeddings):
            raise IndexError(
                f"{self.table}: ids must be in [0, {self.num_embeddings}), got"
                f" {unique[0]}..{unique[-1]}"
            )
        rows = self._rows(unique).requires_grad_(torch.is_grad_enabled())
        self.pulled.append((unique, rows))
        padding = None
        if self.padding_idx is not None and (hit := (unique == self.padding_idx).nonzero()).numel():
            padding = int(hit[0])
        if self.bag_mode is None:
            return F.embedding(inverse, rows, padding_idx=padding)
        return F.embedding_bag(
            inverse,
            rows,
            offsets,
            mode=self.bag_mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
            padding_idx=padding,
        )

    def _rows(self, unique: torch.Tensor) -> torch.Tensor:
        owner = unique % self.servers
        asks = {s: unique[owner == s] // self.servers for s in range(self.servers)}
        asks = {s: local for s, local in asks.items() if local.numel()}
        answers = self._pull(self.table, asks)
        rows = torch.empty(len(unique), self.embedding_dim)
        for server, values in answers.items():
            rows[owner == server] = values
        return rows

    def gradients(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """server -> (local rows, summed gradient rows) of every call since the last ``clear``."""
        ids = (
            torch.cat([u for u, _ in self.pulled])
            if self.pulled
            else torch.empty(0, dtype=torch.long)
        )
        grads = [r.grad if r.grad is not None else torch.zeros_like(r) for _, r in self.pulled]
        grads = torch.cat(grads) if grads else torch.empty(0, self.embedding_dim)
        unique, inverse = torch.unique(ids, return_inverse=True)
        summed = torch.zeros(len(unique), self.embedding_dim).index_add_(0, inverse, grads)
        owner = unique % self.servers
        return {
            s: (unique[owner == s] // self.servers, summed[owner == s])
            for s in range(self.servers)
            if (owner == s).any()
        }

    def clear(self) -> None:
        """Forget the rows pulled (after the push)."""
        self.pulled.clear()

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r},"
            f" servers={self.servers}"
        )
