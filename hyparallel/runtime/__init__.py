"""The runtime: ``parallelize`` applies a plan inside the user's training loop (tensor and pipeline
parallelism from ``hyparallel.tensor`` and ``hyparallel.pipeline``, data parallelism, gradient
compression, recomputation), and keeps it alive (launch and heartbeats, checkpoints, metrics);
``ps`` is the parameter-server mode.

The package imports nothing: ``import hyparallel`` and the planning commands load no runtime module.
"""
