"""What a pipeline device holds in flight under each schedule, as the planner's memory model counts
it.

The runtime reads the same bounds off the program it runs (hyparallel.pipeline.schedule.send_window,
the peak a simulation of the lowered schedule finds); tests/test_planner_costs.py and
tests/test_pipeline.py check that the formulas here equal them.
"""

from __future__ import annotations

import math

from hyparallel.spec.schema import Schedule


def inflight_microbatches(
    schedule: Schedule, pp: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> float:
    """Micro-batches whose activations a pipeline stage holds at its peak, in units of the whole
    stage.

    GPipe runs every forward before any backward: m. 1F1B lets stage s run p - s forwards before its
    first backward (Narayanan et al. 2021, Sec. 2.2): min(p - s, m). Interleaved 1F1B warms up
    2(p - s - 1) + (v - 1)p chunk forwards, plus one in the steady state (Megatron-LM's
    get_num_warmup_microbatches), each chunk 1/v of the stage.
    """
    if schedule == "gpipe":
        return float(num_microbatches)
    if pp == 1:
        return 1.0
    if schedule == "1f1b":
        return float(min(pp - stage, num_microbatches))
    chunks = min(
        2 * (pp - stage - 1) + (virtual_stages - 1) * pp + 1, num_microbatches * virtual_stages
    )
    return chunks / virtual_stages


def backward_sends_held(
    schedule: Schedule, pp: int, num_microbatches: int, stage: int, virtual_stages: int = 1
) -> int:
    """Gradients a pipeline device has sent back and still holds, at most (Note [gradients sent
    back]).

    PipelineRuntime keeps at most one per micro-batch chunk in flight on the device
    (``inflight_microbatches`` x v, at least one), waiting for the oldest before it holds more;
    never more than it sends: m per virtual stage past the device's first (the first stage sends
    none).
    """
    sent = num_microbatches * (virtual_stages - (1 if stage == 0 else 0))
    window = max(
        1,
        math.ceil(
            inflight_microbatches(schedule, pp, num_microbatches, stage, virtual_stages)
            * virtual_stages
        ),
    )
    return min(sent, window)
