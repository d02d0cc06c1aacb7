import json

import pytest

from posttrain.data import DataError, SFTDataset, load_rows


def trained_text(tok, item):
    return tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])


def untrained_text(tok, item):
    return tok.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if not m])


ROWS = [
    {"prompt": "What is 2 + 3?", "response": "5"},
    {"prompt": "What is 10 + 31?", "response": "The answer is 41"},
]


def test_response_only_masking_with_input_template(tokenizer):
    ds = SFTDataset(
        ROWS, tokenizer, 64, input_key="prompt", output_key="response", input_template="User: {}\nAssistant: "
    )
    for row, item in zip(ROWS, ds):
        assert len(item["input_ids"]) == len(item["loss_mask"]) and item["loss_mask"][0] == 0
        assert trained_text(tokenizer, item) == row["response"] + "<|im_end|>"
        assert untrained_text(tokenizer, item) == f"User: {row['prompt']}\nAssistant: "
        # the prompt tokens are exactly the prompt tokenised on its own (what a generator sees)
        prompt_ids = tokenizer.encode(f"User: {row['prompt']}\nAssistant: ")
        assert (
            item["input_ids"][: len(prompt_ids)] == prompt_ids
            and item["input_ids"][-1] == tokenizer.eos_token_id
        )
    assert ds.num_dropped == 0 and ds.num_truncated == 0 and ds.lengths == [len(x["input_ids"]) for x in ds]


def test_eos_not_duplicated_when_response_ends_with_it(tokenizer):
    rows = [{"prompt": "hi", "response": "5<|im_end|>"}]
    item = SFTDataset(rows, tokenizer, 64, input_key="prompt", output_key="response")[0]
    assert trained_text(tokenizer, item) == "5<|im_end|>"


def test_chat_template_masking(tokenizer, tokenizer_eot):
    rows = [{"prompt": "What is 2 + 3?", "response": "5"}]
    item = SFTDataset(
        rows, tokenizer, 64, input_key="prompt", output_key="response", apply_chat_template=True
    )[0]
    assert (
        untrained_text(tokenizer, item)
        == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    # eos (<|im_end|>) already closes the turn: nothing appended after the trailing newline
    assert trained_text(tokenizer, item) == "5<|im_end|>\n"
    # with a distinct eos it is appended and trained
    item = SFTDataset(
        rows, tokenizer_eot, 64, input_key="prompt", output_key="response", apply_chat_template=True
    )[0]
    assert trained_text(tokenizer_eot, item) == "5<|im_end|>\n<|endoftext|>"


def test_chat_messages_without_output_key_train_last_assistant(tokenizer):
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"},
            ]
        }
    ]
    item = SFTDataset(rows, tokenizer, 64, input_key="messages", apply_chat_template=True)[0]
    assert trained_text(tokenizer, item) == "2<|im_end|>\n"
    assert untrained_text(tokenizer, item).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_pretrain_mode_trains_every_token_but_first(tokenizer):
    rows = [{"text": "the quick brown fox"}]
    item = SFTDataset(rows, tokenizer, 64, input_key="text", pretrain_mode=True)[0]
    assert item["loss_mask"] == [0] + [1] * (len(item["input_ids"]) - 1)
    assert tokenizer.decode(item["input_ids"]) == "the quick brown fox<|im_end|>"


def test_multiturn_trains_exactly_the_assistant_turns(tokenizer):
    conv = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "The answer is 8"},
    ]
    item = SFTDataset(
        [{"conv": conv}], tokenizer, 256, input_key="conv", apply_chat_template=True, multiturn=True
    )[0]
    assert tokenizer.decode(item["input_ids"]) == tokenizer.apply_chat_template(conv, tokenize=False)
    spans, cur = [], []
    for t, m in zip(item["input_ids"], item["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur))
    assert spans == ["3<|im_end|>\n", "The answer is 8<|im_end|>\n"]


def test_truncation_and_dropped_count(tokenizer):
    long_prompt = " ".join(["the quick brown fox"] * 20)
    rows = [
        {"p": "hi", "r": "the quick brown fox jumps over the lazy dog"},
        {"p": long_prompt, "r": "5"},
        {"p": "x", "r": "y"},
    ]
    ds = SFTDataset(rows, tokenizer, 8, input_key="p", output_key="r")
    assert len(ds) == 2 and ds.num_dropped == 1 and ds.dropped == ["<rows>, row 2"]
    assert ds.num_truncated == 2  # row 1 cut, row 2 cut then dropped
    assert len(ds[0]["input_ids"]) == 8 and ds.sample_rows == ["<rows>, row 1", "<rows>, row 3"]
    with pytest.raises(DataError, match="all 1 samples were dropped.*max_len"):
        SFTDataset(rows[1:2], tokenizer, 8, input_key="p", output_key="r")


# ---- bad rows: every message names the file, the row and the key ------------------------------


def _file_rows(tmp_path, rows):
    p = tmp_path / "train_data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_rows(str(p), None, "train", 0, None)


GOOD = {"prompt": "What is 1 + 1?", "response": "2"}
GOOD_MULTI = {
    "prompt": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}],
    "response": "ok",
}


@pytest.mark.parametrize(
    "bad, kwargs, pattern",
    [
        (
            {"question": "q", "response": "2"},
            {},
            r"row 2: missing key 'prompt' \(the row has keys \['question', 'response'\]\).*--data\.input_key",
        ),
        ({"prompt": "q", "answer": "2"}, {}, r"row 2: missing key 'response'.*--data\.output_key"),
        (
            {"prompt": "q", "Response": "2"},
            {},
            r"row 2: missing key 'response' \(the row has keys \['Response', 'prompt'\]\)\. Did you mean "
            r"'Response'\? .*--data\.output_key",
        ),
        ({"prompt": "q", "response": 2}, {}, r"row 2: key 'response' must be text \(a string\), got int 2"),
        ({"prompt": "  ", "response": "2"}, {}, r"row 2: key 'prompt' is empty text"),
        (
            {"prompt": [{"role": "user"}], "response": "2"},
            {"apply_chat_template": True},
            r"row 2: key 'prompt', message 0 must be a dict with string 'role' and 'content'",
        ),
        (
            {"prompt": {"role": "user"}, "response": "2"},
            {"apply_chat_template": True},
            r"row 2: key 'prompt' must be text or a list of \{role, content\} messages, got dict",
        ),
        (
            {"prompt": "q", "response": "2"},
            {"apply_chat_template": True, "multiturn": True},
            r"row 2: key 'prompt' must be a list of",
        ),
        (
            {"prompt": [{"role": "user", "content": "q"}]},
            {"apply_chat_template": True, "multiturn": True, "output_key": None},
            r"row 2: key 'prompt' has no assistant message",
        ),
    ],
)
def test_bad_rows_name_file_row_and_key(tmp_path, tokenizer, bad, kwargs, pattern):
    good = GOOD_MULTI if kwargs.get("multiturn") else GOOD
    rows = _file_rows(tmp_path, [good, bad])
    opts = {"input_key": "prompt", "output_key": "response", **kwargs}
    with pytest.raises(DataError, match=r"train_data\.jsonl, " + pattern):
        SFTDataset(rows, tokenizer, 64, **opts)


def test_rows_are_validated_before_tokenising(tmp_path, tokenizer, monkeypatch):
    rows = _file_rows(tmp_path, [GOOD] * 3 + [{"prompt": "q"}])
    calls = []
    monkeypatch.setattr(type(tokenizer), "encode", lambda self, *a, **k: calls.append(1) or [1])
    with pytest.raises(DataError, match="row 4: missing key 'response'"):
        SFTDataset(rows, tokenizer, 64, input_key="prompt", output_key="response")
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"input_template": "User: Assistant:"}, r"input_template.*exactly one '\{\}'"),
        ({"input_template": "User: {x}"}, r"input_template.*not a valid format string"),
        ({"multiturn": True}, r"--data\.multiturn requires --data\.apply_chat_template"),
        ({"output_key": None}, r"--data\.output_key is required"),
        ({"apply_chat_template": True, "input_template": "U: {}"}, "exclusive"),
    ],
)
def test_bad_options(tokenizer, kwargs, pattern):
    opts = {"input_key": "prompt", "output_key": "response", **kwargs}
    with pytest.raises(DataError, match=pattern):
        SFTDataset([GOOD], tokenizer, 64, **opts)


def test_missing_chat_template_says_which_flag(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(DataError, match="--data.tokenizer_chat_template"):
        SFTDataset([GOOD], tok, 64, input_key="prompt", output_key="response", apply_chat_template=True)


def test_set_chat_template_overrides(tokenizer, tmp_path):
    import copy

    from posttrain.data import set_chat_template

    tok = copy.deepcopy(tokenizer)
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    set_chat_template(tok, str(path))
    item = SFTDataset([GOOD], tok, 64, input_key="prompt", output_key="response", apply_chat_template=True)[0]
    assert tok.decode(item["input_ids"]) == "[user] What is 1 + 1?\n[assistant] 2\n<|im_end|>"
    with pytest.raises(DataError, match="neither an existing file nor a Jinja"):
        set_chat_template(tok, "no-template-here")


def test_prefix_unstable_chat_template_is_rejected(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)  # the header depends on the number of messages: prefixes do not match
    tok.chat_template = "{{ messages|length }} turns\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    conv = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
    with pytest.raises(DataError, match=r"<rows>, row 1: the chat template is not prefix-stable"):
        SFTDataset([{"c": conv}], tok, 64, input_key="c", apply_chat_template=True, multiturn=True)
    with pytest.raises(DataError, match=r"<rows>, row 1: the chat template is not prefix-stable"):
        SFTDataset([{"c": conv}], tok, 64, input_key="c", apply_chat_template=True)


@pytest.mark.parametrize("chat", [False, True])
def test_one_bos_rule_for_sft_preference_and_ppo_prompts(tokenizer_bos, chat):
    """A BOS-adding tokenizer: SFT samples, preference pairs and PPO prompts all tokenise without
    the automatic BOS (OpenRLHF's add_special_tokens=False), so the prompt an SFT model learned is
    token for token the prompt PPO samples from."""
    from posttrain.data import PreferenceDataset, PromptDataset

    tok = tokenizer_bos
    row = {"prompt": "What is 2 + 3?", "response": "5", "chosen": "5", "rejected": "7"}
    kw = dict(apply_chat_template=True) if chat else dict(input_template="User: {}\nAssistant: ")
    prompt = PromptDataset([row], tok, input_key="prompt", **kw)[0].token_ids
    sft = SFTDataset([row], tok, 64, input_key="prompt", output_key="response", **kw)[0]["input_ids"]
    pair = PreferenceDataset([row], tok, 64, prompt_key="prompt", **kw)[0]["chosen_ids"]
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    assert prompt[0] != bos and sft[0] != bos and pair[0] != bos
    assert sft[:len(prompt)] == prompt and pair[:len(prompt)] == prompt


def test_huge_text_fields_are_cut_before_tokenising_and_the_samples_do_not_change(tokenizer, monkeypatch):
    """A field far longer than --data.max_len can use is cut to 2 x max_len x the longest token's
    characters before tokenisation (counted in num_capped); the samples are those of the whole text."""
    import posttrain.data.capping as capping
    import posttrain.data.sft_dataset as sft_dataset
    from posttrain.data import PreferenceDataset, PromptDataset

    words = " ".join(f"w{i % 97} {i}" for i in range(40_000))  # ~350k characters
    rows = [{"prompt": "What?", "response": words}, {"prompt": words, "response": "5"}, ROWS[0]]
    limit = capping.text_limit(32, tokenizer)
    assert limit == 64 * capping.chars_per_token(tokenizer) < len(words) // 100
    ds = SFTDataset(rows, tokenizer, 32, input_key="prompt", output_key="response")
    assert ds.num_capped == 2 and ds.num_truncated == 2 and ds.num_dropped == 1
    monkeypatch.setattr(sft_dataset, "cap_text_fields", lambda rows, keys, max_len, tok: (rows, 0))
    whole = SFTDataset(rows, tokenizer, 32, input_key="prompt", output_key="response")
    assert [s["input_ids"] for s in ds] == [s["input_ids"] for s in whole]
    assert [s["loss_mask"] for s in ds] == [s["loss_mask"] for s in whole] and whole.dropped == ds.dropped
    pairs = PreferenceDataset([{"prompt": "Q", "chosen": words, "rejected": "no", "label": words}], tokenizer,
                              32, prompt_key="prompt")
    assert pairs.num_capped == 1 and len(pairs[0]["chosen_ids"]) == 32
    prompts = PromptDataset([{"input": words, "label": words}, {"input": "hi", "label": "x"}], tokenizer,
                            label_key="label", max_prompt_len=16)
    assert prompts.num_capped == 1 and len(prompts.dropped) == 1 and prompts[0].label == "x"


def test_a_rows_tools_are_rendered_into_its_conversation(tokenizer):
    """A `tools` key (TRL's SFT data) goes to the chat template: the tools' system turn is context, the
    assistant's tool call is trained, the tool message is context."""
    import copy

    from posttrain.models.tiny_tokenizer import CHATML_TEMPLATE

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = CHATML_TEMPLATE  # the tiny models' template, which renders tools
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    conv = [{"role": "user", "content": "1 + 2?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3"}]
    item = SFTDataset([{"conv": conv, "tools": tools}], tokenizer, 4096, input_key="conv",
                      apply_chat_template=True, multiturn=True)[0]
    text = tokenizer.apply_chat_template(conv, tools=tools, tokenize=False)
    assert "<tools>" in text and tokenizer.decode(item["input_ids"]) == text
    trained = tokenizer.decode([t for t, m in zip(item["input_ids"], item["loss_mask"]) if m])
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert trained == f"{call}<|im_end|>\n3<|im_end|>\n"
    with pytest.raises(DataError, match="key 'tools' must be a list of function schemas"):
        SFTDataset([{"conv": conv, "tools": "add"}], tokenizer, 512, input_key="conv",
                   apply_chat_template=True, multiturn=True)
