"""Context parallelism's attention (issue 39, Note [context-parallel attention] in
hyparallel/tensor/context.py; Note [ring attention]): keys and values all-gathered or passed round a
ring, exact against one process, each rank the same share of the work."""

from __future__ import annotations

import pytest
import torch

from hyparallel.tensor.context import positions, shard_sequence, unshard_sequence

from .conftest import REPO, torchrun


def test_the_shards_are_two_chunks_each_and_make_the_sequence_again():
    x = torch.arange(2 * 16).reshape(2, 16)
    shards = [shard_sequence(x, 1, 4, rank) for rank in range(4)]
    # rank 0: chunks 0 and 7 of 8; rank 3: chunks 3 and 4
    assert shards[0][0].tolist() == [0, 1, 14, 15] and shards[3][0].tolist() == [6, 7, 8, 9]
    # exact: integer ids only cut and concatenated, no arithmetic on them
    assert torch.equal(unshard_sequence(shards, 1), x)
    assert positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        shard_sequence(torch.zeros(1, 12), 1, 4, 0)


def test_context_parallel_attention_is_one_processes_and_balanced_also_in_a_llama(tmp_path):
    results = torchrun(REPO, "tests/distributed/context_worker.py", tmp_path / "out.jsonl", 4)
    attention = {
        f"{kind}-cp{cp}-{mask}"
        for kind in ("gather", "ring")
        for cp in (2, 4)
        for mask in ("causal", "full")
    }
    assert set(results) == attention | {"llama-gather-cp2", "llama-ring-cp4"}
    # a tiny Llama (grouped-query attention, rotary embeddings at global positions): each rank's
    # logits, and every weight's gradient (by name) summed over its cp ranks, one process's
    for case in ("llama-gather-cp2", "llama-ring-cp4"):
        for rank in results[case]:
            assert rank["logits"] <= 1e-5 and rank["grads"] <= 1e-5, (case, rank)
            assert sorted(rank["checked"]) == rank["names"]
    for case in attention:
        ranks = results[case]
        for rank in ranks:  # fp32: a softmax over 32 keys in another order
            for name in ("out", "q", "k", "v"):
                assert rank[name] <= 1e-5, (case, rank["rank"], name, rank[name])
        # every rank computes as many (query, key) pairs as the others, causal or not
        pairs = [rank["pairs"] for rank in ranks]
        assert max(pairs) <= 1.05 * min(pairs), (case, pairs)


def test_what_the_split_attention_cannot_split_is_refused_naming_the_module():
    from hyparallel.tensor import context

    q = k = v = torch.zeros(1, 2, 4, 8)
    layer = torch.nn.Linear(1, 1)
    with pytest.raises(RuntimeError, match="Linear: context-parallel attention called outside"):
        context._transformers_attention(layer, q, k, v, None)
    with context.split_attention(object()):
        with pytest.raises(ValueError, match="Linear: context parallelism cannot split a mask"):
            context._transformers_attention(layer, q, k, v, torch.ones(1, 1, 4, 4))
        with pytest.raises(ValueError, match="cannot split dropout 0.1 in training"):
            context._transformers_attention(layer, q, k, v, None, dropout=0.1)
        with pytest.raises(ValueError, match="cannot split attention that is not causal"):
            context._transformers_attention(layer, q, k, v, None, is_causal=False)
    with pytest.raises(ValueError, match="'gather' or 'ring'"):
        with context.split_attention(object(), "flash"):
            pass
