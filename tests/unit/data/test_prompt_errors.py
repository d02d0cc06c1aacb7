"""PromptDataset's error for an empty prompt set names the cause: no rows at all, or every row too long."""

import pytest

from posttrain.data import PromptDataset
from posttrain.data.errors import DataError


def test_no_rows_is_not_blamed_on_max_len(tokenizer):
    with pytest.raises(DataError) as err:
        PromptDataset([], tokenizer, max_prompt_len=16)
    msg = str(err.value)
    assert msg.startswith("no prompts: the prompt dataset has no rows")
    assert "--data.prompt_split" in msg and "max_len" not in msg


def test_all_rows_too_long_advises_max_len(tokenizer):
    rows = [{"input": "what is the sum of numbers " * 8, "__source__": "p.jsonl", "__row__": i}
            for i in (1, 2)]
    with pytest.raises(DataError) as err:
        PromptDataset(rows, tokenizer, max_prompt_len=4)
    assert str(err.value).startswith("no usable prompts: all 2 rows are longer than 4 tokens (first: "
                                     "p.jsonl, row 1)")
    assert "raise --data.max_len" in str(err.value)
