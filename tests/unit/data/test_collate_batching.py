import itertools
import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data import SFTDataset, pack_collate, pad_collate, token_budget_batches

ITEMS = [
    {"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]},
    {"input_ids": [8, 9], "loss_mask": [0, 1]},
    {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]},
]


def test_pad_collate_right_pads():
    b = pad_collate(ITEMS, pad_id=0)
    assert all(v.dtype == torch.long and v.shape == (3, 4) for v in b.values())
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 1, 1]]


def test_pack_collate_restarts_positions():
    b = pack_collate(ITEMS)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert b["loss_mask"].tolist() == [[0, 0, 1, 0, 1, 0, 1, 1, 1]]
    assert b["seq_lens"] == [3, 2, 4]
    # first token of every sample is never a target, so no label crosses a boundary
    starts = [0, 3, 5]
    assert all(b["loss_mask"][0, s] == 0 for s in starts)


def test_pack_collate_rejects_target_first_token():
    with pytest.raises(ValueError, match="item 1 has loss_mask\\[0\\] = 1"):
        pack_collate([ITEMS[0], {"input_ids": [1, 2], "loss_mask": [1, 1]}])


def test_pack_collate_on_real_dataset(tokenizer):
    rows = [{"p": f"What is {i} + {i}?", "r": str(2 * i)} for i in range(4)]
    ds = SFTDataset(rows, tokenizer, 64, input_key="p", output_key="r", apply_chat_template=True)
    b = pack_collate([ds[i] for i in range(4)])
    starts = [sum(ds.lengths[:k]) for k in range(4)]
    pos = b["position_ids"][0].tolist()
    assert [i for i, p in enumerate(pos) if p == 0] == starts
    assert all(b["loss_mask"][0, s] == 0 for s in starts)
    assert b["input_ids"].shape == (1, sum(ds.lengths))
    padded = pad_collate([ds[i] for i in range(4)], tokenizer.pad_token_id)
    assert padded["loss_mask"].sum() == b["loss_mask"].sum()


def test_token_budget_greedy_in_order(caplog):
    assert token_budget_batches([3, 4, 2, 5, 1], 7) == [[0, 1], [2, 3], [4]]
    with caplog.at_level(logging.WARNING):
        assert token_budget_batches([2, 9, 2, 2], 5) == [[0], [1], [2, 3]]
    assert "exceed the budget of 5 tokens" in caplog.text and "[1]" in caplog.text
    with pytest.raises(ValueError, match="max_tokens"):
        token_budget_batches([1], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 50), max_size=60), st.integers(1, 80))
def test_token_budget_properties(lengths, budget):
    batches = token_budget_batches(lengths, budget)
    assert [i for b in batches for i in b] == list(range(len(lengths)))  # order-preserving partition
    for b in batches:
        assert sum(lengths[i] for i in b) <= budget or len(b) == 1
    for b, nxt in itertools.pairwise(batches):  # greedy: the next sample did not fit
        assert sum(lengths[i] for i in b) + lengths[nxt[0]] > budget
