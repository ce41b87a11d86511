"""The bounds on every number a user gives hyparallel, in one place.

The plan and cluster schemas, the model configs, the planner's request checks and the CLI's flags
all read these constants, so a number is refused the same way whichever door it comes in by (a plan
file,
``--gpus``, ``hp.plan(...)``). Each bound is far above anything real and low enough that the work it
allows (the rank loops of ``show``, the schedule ``simulate`` times, a model traced on the meta
device) still ends in seconds; the comment on each says where its figure comes from.
"""

from __future__ import annotations

# Devices (processes) in one cluster, plan or mesh axis: 2^20 = 1,048,576, about five times the
# largest training clusters built (some 200,000 GPUs) and small enough for `hyparallel show`'s
# per-rank work.
MAX_DEVICES = 2**20

# Devices per node: a DGX node has 8, an NVL72 rack 72; 1,024 leaves room for one process per core
# of a many-core CPU host, and bounds the columns of `show`'s device map.
MAX_GPUS_PER_NODE = 1024

# Sequences per optimizer step (and so micro-batches, and sequences per micro-batch): 2^24 = 16.8M.
# GPT-3 trained with 1,536 sequences per step, Llama 2 with 1,024; 2^24 is four orders of magnitude
# above.
MAX_GLOBAL_BATCH = 2**24

# Tokens per sequence: 2^24 = 16.8M, above the longest context windows trained (10M tokens).
MAX_SEQ_LEN = 2**24

# Transformer layers of a zoo or Hugging Face model: four times the deepest zoo entry (gpt-1t, 128)
# and above every published LLM (Llama 3 405B: 126). Tracing and the stage search grow faster than
# linearly with depth: on this 2-core machine 512 layers trace in 3 s and plan for 1,024 GPUs in 2
# s, 1,024 layers take 7 s and 25 s; this is what keeps `--model ... num_layers=N` from running for
# hours.
MAX_LAYERS = 512

# Model chunks per pipeline rank (interleaved 1F1B): each chunk holds at least one layer, so no more
# than the deepest model allowed (MAX_LAYERS); Megatron-LM's recipes use up to about a dozen.
MAX_VIRTUAL_STAGES = MAX_LAYERS

# PowerSGD's factor rank: 1-4 in Vogels et al. 2019 and torch's examples, up to 32 in their
# ablations; 1,024 keeps a typo from asking for factors as large as the matrices they approximate.
MAX_POWERSGD_RANK = 1024
# Parameter-server staleness bound: beyond a few hundred steps stale-synchronous training is plain
# async SGD.
MAX_PS_STALENESS = 10_000
# Steps before PowerSGD compresses (torch's start_powerSGD_iter, default 1,000): up to a billion
# steps.
MAX_POWERSGD_START_STEP = 10**9

# Width of a layer (hidden size, MLP width): 2^17 = 131,072 hidden, five times gpt-1t's 25,600; the
# MLP up to 2^19 (four times the largest hidden, as GPT's 4 x h).
MAX_HIDDEN = 2**17
MAX_FFN_HIDDEN = 2**19

# Vocabulary: 2^22 = 4.2M tokens, sixteen times the largest in use (Gemma's 256K).
MAX_VOCAB = 2**22

# Parameters of a whole model: 2^50 = 1.1 quadrillion, a thousand times the largest trained.
MAX_PARAMS = 2**50

# Ops counted as a plan's num_layers when a model has no repeated blocks (every parameterised op).
MAX_MODEL_OPS = 2**20

# Memory of one device: 2^50 bytes = 1 PiB (an H200 has 141 GB).
MAX_DEVICE_MEMORY_BYTES = 2**50

# Rates of a cluster file, per device: FLOP/s up to 1e21 (a zettaFLOP/s; an H200 does 1e15 in bf16),
# bytes/s up to 1e18 (an exabyte/s; HBM3e is 5e12), both at least 1 per second. Within these the
# cost model's figures stay finite (no division by a denormal, no overflow to inf).
MAX_FLOPS = 1e21
MAX_BYTES_PER_S = 1e18
MIN_RATE = 1.0

# Efficiencies (fractions of a peak): at least 0.1%, as `hyparallel calibrate` rounds them.
MIN_EFFICIENCY = 0.001
# The half-performance sizes of an efficiency curve (elements): far beyond any GEMM a device runs in
# one call.
MAX_CURVE_ELEMENTS = 1e15

# Latencies and per-op overheads: an hour per message is no link.
MAX_LATENCY_S = 3600.0

# `hyparallel plan --top K`: a table of more than 100 plans is not read.
MAX_TOP = 100

# `hyparallel plan --mtbf HOURS` (the job's mean time between failures) and `--restart-s`: 10^7
# hours is over a thousand years, far above one device's MTBF (GPUs are rated at tens of thousands
# of hours); a restart of a day is no restart.
MAX_MTBF_HOURS = 1e7
MAX_RESTART_S = 86400.0
# the busiest expert-parallel rank's routed pairs over the mean (plan --expert-imbalance): at most
# every pair on one of 64 ranks' share
MAX_EXPERT_IMBALANCE = 64.0

# `hyparallel simulate` times every forward and backward of every micro-batch on every (virtual)
# stage, one by one in Python: 2 x pp x virtual_stages x num_microbatches of them, at most 2^17 =
# 131,072 (gpt-175b's plan for 1,024 A100s has 18,432), and draws one row per pipeline rank, at most
# 256 (twice the deepest pipelines trained; 512 rows would be a picture 52,000 pixels tall). At both
# bounds a step is simulated and drawn in under ten seconds on a 2-core machine.
MAX_SIMULATED_ACTIONS = 2**17
MAX_SIMULATED_PP = 256

# Plan and cluster files (YAML): a planner-written plan of a 1T model on thousands of GPUs is tens
# of KiB.
MAX_YAML_BYTES = 16 * 2**20  # 16 MiB: refuses /dev/zero and mistaken data files
MAX_YAML_DEPTH = 64  # nesting of lists and mappings; a plan nests 5 deep
MAX_YAML_NODES = 10**6  # values once aliases are expanded: stops a "billion laughs" alias bomb
