"""The update rules parameter servers apply to the rows they hold (``ps.optimizer``).

Each rule keeps its state per row of one tensor, so that an update touches only the rows a batch
used: a table of 40M rows pays for the few thousand a batch looks up. Dense weights are updated the
same way, all rows at once (a 1-D tensor is one row).

Note [the rules, and the torch optimizers they match]
    ``sgd``: w -= lr * g, torch.optim.SGD without momentum or weight decay.
    ``adagrad``: s += g * g; w -= lr * g / (sqrt(s) + eps), torch.optim.Adagrad with its defaults
    (eps 1e-10, no lr decay, initial accumulator 0). A row a step does not touch has a zero gradient
    there, so its state and weights stay as they are: dense torch Adagrad and this sparse one agree.
    ``rowwise-adam``: Adam (betas 0.9, 0.999, eps 1e-8, torch's defaults) whose second moment is one
    number per row, the mean of g * g over the row, and whose bias correction counts the row's own
    updates (a "lazy" Adam: an untouched row's moments do not decay). One float per row instead of
    one per weight, as FBGEMM's row-wise optimizers keep, which is what makes Adam affordable for
    huge tables.
"""

from __future__ import annotations

from typing import Literal

import torch

Rule = Literal["sgd", "adagrad", "rowwise-adam"]

ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default
ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults
ADAM_EPS = 1e-8


class RowOptimizer:
    """The state of ``rule`` for one tensor; ``apply`` updates the given rows (all when ``rows`` is
    None)."""

    def __init__(self, rule: Rule, lr: float, weight: torch.Tensor) -> None:
        self.rule, self.lr = rule, lr
        rows = _as_rows(weight)
        self.state: dict[str, torch.Tensor] = {}
        if rule == "adagrad":
            self.state["sum"] = torch.zeros_like(rows)
        elif rule == "rowwise-adam":
            self.state["m"] = torch.zeros_like(rows)
            self.state["v"] = torch.zeros(rows.shape[0], dtype=rows.dtype)
            self.state["steps"] = torch.zeros(rows.shape[0], dtype=torch.int64)

    def apply(self, weight: torch.Tensor, rows: torch.Tensor | None, grad: torch.Tensor) -> None:
        """``weight[rows] -= update(grad)`` in place; ``rows`` unique, ``grad`` one row per entry of
        ``rows``."""
        view = _as_rows(weight)
        grad = grad.reshape(-1, view.shape[1]) if rows is not None else _as_rows(grad)
        index = rows if rows is not None else slice(None)
        if self.rule == "sgd":
            view[index] -= self.lr * grad
        elif self.rule == "adagrad":
            total = self.state["sum"][index] + grad * grad
            self.state["sum"][index] = total
            view[index] -= self.lr * grad / (total.sqrt() + ADAGRAD_EPS)
        else:
            beta1, beta2 = ADAM_BETAS
            steps = self.state["steps"][index] + 1
            m = beta1 * self.state["m"][index] + (1 - beta1) * grad
            v = beta2 * self.state["v"][index] + (1 - beta2) * (grad * grad).mean(dim=1)
            self.state["steps"][index], self.state["m"][index], self.state["v"][index] = steps, m, v
            m_hat = m / (1 - beta1 ** steps.to(m.dtype)).unsqueeze(1)
            v_hat = v / (1 - beta2 ** steps.to(v.dtype))
            view[index] -= self.lr * m_hat / (v_hat.sqrt() + ADAM_EPS).unsqueeze(1)


def _as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A (rows, width) view: a 1-D tensor or a scalar is one row."""
    if tensor.dim() >= 2:
        return tensor.view(tensor.shape[0], -1)
    return tensor.view(1, -1)
