"""Pipeline schedules written out by hand from their definitions, per rank, as compute actions
("1F0" = stage 1's forward of micro-batch 0). tests/test_schedule.py compares them with
``schedule()`` and tests/test_pipeline.py with the order the runtime executed, so neither the IR nor
the runtime is checked only against itself.

How each was written (rank r holds stage r; with v virtual stages, stages r, r + pp, ...):

- gpipe: every forward, then every backward, both in micro-batch order (torch's ScheduleGPipe).
- 1f1b (PipeDream-flush): rank r warms up with pp - r - 1 forwards, then alternates one forward and
  one backward, then drains the remaining backwards: it never holds more than pp - r micro-batches.
- interleaved-1f1b (Megatron-LM's forward_backward_pipelining_with_interleaving), pp = 2, v = 2, m =
  4: the k-th forward of a rank runs chunk (k mod pp v) div pp on the next micro-batch that chunk
  has not seen, so micro-batches go through chunk 0 in groups of pp = 2, then the same group through
  chunk 1: chunk sequence 0 0 1 1 0 0 1 1, i.e. (chunk, micro-batch) (0,0) (0,1) (1,0) (1,1) (0,2)
  (0,3) (1,2) (1,3). Backwards walk the chunks the other way: (1,0) (1,1) (0,0) (0,1) (1,2) (1,3)
  (0,2) (0,3). Warm-up is 2 (pp - r - 1) + (v - 1) pp forwards (4 on rank 0, 2 on rank 1), then
  forward k and backward k - warm-up alternate, then the remaining backwards. Chunk c of rank r is
  stage c pp + r: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3.
"""

from __future__ import annotations

# (kind, pp, m, v) -> rank -> actions
HAND_WRITTEN: dict[tuple[str, int, int, int], dict[int, str]] = {
    ("gpipe", 2, 2, 1): {
        0: "0F0 0F1 0B0 0B1",
        1: "1F0 1F1 1B0 1B1",
    },
    ("gpipe", 2, 4, 1): {
        0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
    },
    ("gpipe", 3, 4, 1): {
        0: "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        1: "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        2: "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    },
    ("1f1b", 2, 3, 1): {
        0: "0F0 | 0F1 0B0 0F2 0B1 | 0B2",  # warm-up 1 | steady | drain ("|" only marks the phases)
        # warm-up 0: the last stage runs each backward right after its forward
        1: "1F0 1B0 1F1 1B1 1F2 1B2",
    },
    ("1f1b", 2, 4, 1): {
        0: "0F0 | 0F1 0B0 0F2 0B1 0F3 0B2 | 0B3",
        1: "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3",
    },
    ("1f1b", 3, 4, 1): {
        0: "0F0 0F1 | 0F2 0B0 0F3 0B1 | 0B2 0B3",
        1: "1F0 | 1F1 1B0 1F2 1B1 1F3 1B2 | 1B3",
        2: "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    },
    ("1f1b", 4, 4, 1): {
        0: "0F0 0F1 0F2 | 0F3 0B0 | 0B1 0B2 0B3",
        1: "1F0 1F1 | 1F2 1B0 1F3 1B1 | 1B2 1B3",
        2: "2F0 | 2F1 2B0 2F2 2B1 2F3 2B2 | 2B3",
        3: "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3",
    },
    ("interleaved-1f1b", 2, 4, 2): {
        # warm-up: forwards k = 0..3 | steady: forward k = 4..7 with backward k = 0..3 | drain:
        # backwards 4..7
        0: "0F0 0F1 2F0 2F1 | 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 | 2B2 2B3 0B2 0B3",
        # warm-up: forwards 0, 1 | steady: forward k = 2..7 with backward k = 0..5 | drain:
        # backwards 6, 7
        1: "1F0 1F1 | 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 | 1B2 1B3",
    },
}


def expected(kind: str, pp: int, m: int, v: int = 1) -> dict[int, list[str]]:
    """The hand-written order of (kind, pp, m, v) per rank, as a list of action strings."""
    return {
        rank: [a for a in text.split() if a != "|"]
        for rank, text in HAND_WRITTEN[kind, pp, m, v].items()
    }
