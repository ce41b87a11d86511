"""A dry run on meta runs each distinct repeated block once (Note [a repeated block runs once on
meta])."""

from __future__ import annotations

import torch
from torch import nn

from hyparallel.graph.repeats import repeated_blocks_once
from hyparallel.graph.tracer import first_failure


class Counted(nn.Module):
    """A block that counts its runs and views its input with its own ``width``."""

    runs = 0

    def __init__(self, width: int, hidden: int = 8):
        super().__init__()
        self.width = width
        self.proj = nn.Linear(hidden, hidden, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).runs += 1
        return self.proj(x).view(*x.shape[:-1], -1, self.width).flatten(-2)


class Stack(nn.Module):
    def __init__(self, widths: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(Counted(w) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def run(model: nn.Module, x: torch.Tensor) -> tuple[int, torch.Size]:
    Counted.runs = 0
    with torch.no_grad(), repeated_blocks_once(model):
        out = model(x)
    return Counted.runs, out.shape


def test_equal_blocks_run_once_and_give_the_same_shapes():
    model, x = Stack([4] * 6), torch.empty(2, 3, 8, device="meta")
    assert run(model, x) == (1, torch.Size([2, 3, 8]))
    assert "forward" not in model.layers[0].__dict__  # the patch is undone on leaving
    Counted.runs = 0
    with torch.no_grad():
        assert model(x).shape == (2, 3, 8)
    assert Counted.runs == 6


def test_a_block_with_other_attributes_or_real_inputs_runs():
    # width 2 is another block
    assert run(Stack([4, 4, 2, 4]), torch.empty(2, 3, 8, device="meta"))[0] == 2
    real = Stack([4] * 3).to_empty(device="cpu")
    assert run(real, torch.zeros(2, 3, 8))[0] == 3  # real tensors hold values: nothing is skipped


def test_the_first_failure_is_found_in_the_block_that_differs():
    model = Stack([4, 4, 4, 3, 4])  # 8 is no multiple of 3: layers.3 fails
    where, exc = first_failure(model, torch.empty(2, 3, 8, dtype=torch.float32), "fx")
    assert where == "layers.3" and isinstance(exc, RuntimeError)
    assert first_failure(Stack([4] * 5), torch.empty(2, 3, 8), "fx") is None
