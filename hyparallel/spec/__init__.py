"""What a plan and a cluster are, and how hyparallel says no: the files' schemas, their limits, the
errors.

Below everything else: the model graph, the planner, the runtime and the tools all read these, and
these read none of them (tests/test_layering.py).
"""
