"""PreferenceDataset: the tokens and masks of each side, the three data formats, margins, pair_sides,
truncation, and clear errors naming the row for bad pairs."""
import pytest

from posttrain.data import DataError, pack_collate, pad_collate
from posttrain.data.preference_dataset import PreferenceDataset, pair_sides
from posttrain.data.synthetic import make_preference_rows


def text(tok, ids, mask, want):
    return tok.decode([t for t, m in zip(ids, mask) if m == want])


def test_prompt_key_plain_text_masks_only_the_responses(tokenizer):
    rows = [{"q": "What is 2 + 3?", "good": "5", "bad": "7"}]
    ds = PreferenceDataset(rows, tokenizer, 64, prompt_key="q", chosen_key="good", rejected_key="bad",
                           input_template="User: {}\nAssistant: ")
    item = ds[0]
    prompt_ids = tokenizer.encode("User: What is 2 + 3?\nAssistant: ")
    for side, answer in (("chosen", "5"), ("rejected", "7")):
        ids, mask = item[f"{side}_ids"], item[f"{side}_mask"]
        assert ids[: len(prompt_ids)] == prompt_ids and ids[-1] == tokenizer.eos_token_id
        assert mask == [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))
        assert text(tokenizer, ids, mask, 1) == answer + "<|im_end|>"
    assert item["margin"] == 0.0 and ds.pair_rows == ["<rows>, row 1"] and ds.num_dropped == 0


def test_chat_conversations_without_prompt_key_share_the_prompt(tokenizer):
    row = make_preference_rows(1, seed=4)[0]
    ds = PreferenceDataset([row], tokenizer, 64, chosen_key="chosen_messages",
                           rejected_key="rejected_messages", apply_chat_template=True)
    item = ds[0]
    head = f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    for side, answer in (("chosen", row["chosen"]), ("rejected", row["rejected"])):
        assert text(tokenizer, item[f"{side}_ids"], item[f"{side}_mask"], 0) == head
        # each side ends at EOS, as a generated response does (the template's trailing newline is dropped)
        assert text(tokenizer, item[f"{side}_ids"], item[f"{side}_mask"], 1) == f"{answer}<|im_end|>"
        assert item[f"{side}_ids"][-1] == tokenizer.eos_token_id
    # same rows with --data.prompt_key and plain responses give the same tokens
    same = PreferenceDataset([row], tokenizer, 64, prompt_key="prompt", apply_chat_template=True)[0]
    assert same == item


def test_plain_text_without_prompt_trains_every_token_but_the_first(tokenizer):
    ds = PreferenceDataset([{"chosen": "the quick fox", "rejected": "the lazy dog"}], tokenizer, 64)
    ids, mask = ds[0]["chosen_ids"], ds[0]["chosen_mask"]
    assert mask == [0] + [1] * (len(ids) - 1) and ids[-1] == tokenizer.eos_token_id


def test_margin_is_read_when_asked(tokenizer):
    rows = [{"chosen": "a", "rejected": "b", "margin": 2}, {"chosen": "c", "rejected": "d", "margin": -0.5}]
    assert [p["margin"] for p in PreferenceDataset(rows, tokenizer, 16, margin_key="margin")] == [2.0, -0.5]
    with pytest.raises(DataError, match=r"row 2.*'margin' must be a number.*margin_loss_enable"):
        PreferenceDataset([rows[0], {"chosen": "c", "rejected": "d", "margin": "big"}], tokenizer, 16,
                          margin_key="margin")
    with pytest.raises(DataError, match=r"row 1: missing key .margin.*drop --model.margin_loss_enable"):
        PreferenceDataset([{"chosen": "c", "rejected": "d"}], tokenizer, 16, margin_key="margin")


def test_pair_sides_puts_chosen_first_and_collates(tokenizer):
    ds = PreferenceDataset(make_preference_rows(3, seed=1), tokenizer, 64, prompt_key="prompt",
                           input_template="{} ")
    items = [ds[i] for i in range(3)]
    sides = pair_sides(items)
    assert ([s["input_ids"] for s in sides] == [it["chosen_ids"] for it in items]
            + [it["rejected_ids"] for it in items])
    padded = pad_collate(sides, tokenizer.pad_token_id)
    assert padded["input_ids"].shape[0] == 6
    assert padded["attention_mask"].sum(-1).tolist() == [len(s["input_ids"]) for s in sides]
    assert pack_collate(sides)["seq_lens"] == [len(s["input_ids"]) for s in sides]


def test_long_sides_are_cut_and_end_with_eos(tokenizer):
    rows = [{"prompt": "hi", "chosen": "the quick brown fox jumps over a lazy dog", "rejected": "no"}]
    ds = PreferenceDataset(rows, tokenizer, 6, prompt_key="prompt")
    assert len(ds[0]["chosen_ids"]) == 6 and ds[0]["chosen_ids"][-1] == tokenizer.eos_token_id
    assert ds.num_truncated == 1


def test_pairs_whose_prompt_fills_max_len_are_dropped_and_counted(tokenizer):
    rows = [{"prompt": "the quick brown fox jumps over a lazy dog " * 3, "chosen": "a", "rejected": "b"},
            {"prompt": "hi", "chosen": "a", "rejected": "b"}]
    ds = PreferenceDataset(rows, tokenizer, 8, prompt_key="prompt")
    assert len(ds) == 1 and ds.dropped == ["<rows>, row 1"] and ds.pair_rows == ["<rows>, row 2"]
    with pytest.raises(DataError, match=r"all 1 pairs were dropped.*--data.max_len"):
        PreferenceDataset(rows[:1], tokenizer, 8, prompt_key="prompt")


@pytest.mark.parametrize("row, kwargs, message", [
    ({"prompt": "p", "rejected": "b"}, {}, r"row 2.*'chosen'.*--data.chosen_key"),
    ({"prompt": "p", "chosen": "a"}, {}, r"row 2.*'rejected'.*--data.rejected_key"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, {}, r"row 2.*identical"),
    ({"prompt": "p", "chosen": "", "rejected": "b"}, {}, r"row 2.*'chosen'.*empty"),
    ({"prompt": "p", "chosen": "a", "rejected": " "}, {"apply_chat_template": True},
     r"row 2.*'rejected'.*empty"),
    ({"chosen": "a", "rejected": "b"}, {}, r"row 2.*'prompt'.*--data.prompt_key"),
])
def test_bad_pairs_raise_naming_the_row(tokenizer, row, kwargs, message):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    with pytest.raises(DataError, match=message):
        PreferenceDataset([good, row], tokenizer, 32, prompt_key="prompt", **kwargs)


def test_conversations_with_different_prompts_are_rejected(tokenizer):
    a = make_preference_rows(2, seed=1)
    row = {"chosen": a[0]["chosen_messages"], "rejected": a[1]["rejected_messages"]}
    with pytest.raises(DataError, match=r"row 1.*different prompts"):
        PreferenceDataset([row], tokenizer, 64, apply_chat_template=True)


def test_a_side_that_is_a_tool_call_without_content_is_a_response(tokenizer):
    """An assistant turn with `tool_calls` and no `content` key (OpenAI's format) is a response, not a
    KeyError; a turn with neither text nor calls is an empty response."""
    import copy

    from posttrain.models.tiny_tokenizer import CHATML_TEMPLATE

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHATML_TEMPLATE  # the tiny models' template, which renders tool calls
    call = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}
    row = {"prompt": "1 + 2?", "chosen": [call], "rejected": "4"}
    item = PreferenceDataset([row], tokenizer, 256, prompt_key="prompt", apply_chat_template=True)[0]
    trained = text(tokenizer, item["chosen_ids"], item["chosen_mask"], 1)
    assert trained == '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
    empty = {"prompt": "1 + 2?", "chosen": [{"role": "assistant", "content": None, "tool_calls": []}],
             "rejected": "4"}
    with pytest.raises(DataError, match=r"row 1: key 'chosen', message 0 must be a dict .*'content'"):
        PreferenceDataset([empty], tokenizer, 256, prompt_key="prompt", apply_chat_template=True)
    with pytest.raises(DataError, match=r"row 1: key 'chosen' has an empty response"):
        PreferenceDataset([dict(empty, chosen=[{"role": "assistant", "content": "", "tool_calls": []}])],
                          tokenizer, 256, prompt_key="prompt", apply_chat_template=True)
