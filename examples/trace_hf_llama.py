"""Trace a Hugging Face Llama built from a config on the meta device, and print where it can be cut.

Run: .venv/bin/python examples/trace_hf_llama.py
No weights are allocated and nothing is downloaded: the 7B-shaped model below exists only as shapes.
"""

from __future__ import annotations

import logging

import hyparallel as hp

logging.getLogger("transformers").setLevel(logging.ERROR)

# Llama-2-7B shapes with 8 layers, grouped-query attention (8 key/value heads for 32 query heads).
model = hp.models.load("hf:LlamaForCausalLM num_hidden_layers=8 num_key_value_heads=8").module
graph = hp.trace(model, hp.models.example_inputs(model, batch_size=1, seq_len=4096))

print(graph.summary())
print(f"\n{'segment':32} {'params':>12} {'fwd TFLOPs':>11} {'sent onward MiB':>16}")
for segment in graph.segments():
    print(
        f"{segment.name:32} {segment.param_count:>12,} {segment.flops / 1e12:>11.2f} "
        f"{segment.output_bytes / 2**20:>16.1f}"
    )
