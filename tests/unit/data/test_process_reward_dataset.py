"""ProcessRewardDataset (`posttrain prm`'s rows): OpenRLHF's text + labels and TRL's stepwise layout give the
same item, string labels as reward-token indices (or vocabulary ids without reward tokens), soft labels,
truncation dropping the cut placeholders' labels, and one DataError naming the row for each bad row."""
import pytest

from posttrain.data import DataError
from posttrain.data.process_reward_dataset import ProcessRewardDataset
from posttrain.data.synthetic import make_prm_rows

TEXT = "Q: 3+4+5?\n3+4=7 @\n7+5=13 @"  # "@" is one token of the tiny tokenizer; " @" is " " then "@"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def dataset(tok, rows, max_len=64, reward_tokens=("+", "-"), placeholder="@", **kw):
    return ProcessRewardDataset(rows, tok, max_len, placeholder=placeholder,
                                placeholder_id=tok.convert_tokens_to_ids(placeholder),
                                reward_tokens=list(reward_tokens) if reward_tokens else None,
                                token_id=lambda t: tok.encode(t, add_special_tokens=False)[0], **kw)


def test_openrlhf_and_trl_layouts_give_the_same_item(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    openrlhf = dataset(tok, [{"input": TEXT, "label": ["+", "-"]}])
    trl = dataset(tok, [{"prompt": "Q: 3+4+5?\n", "completions": ["3+4=7", "7+5=13"],
                         "labels": [True, False]}])
    want = {"input_ids": ids, "loss_mask": [0] * len(ids), "step_labels": [0, 1]}
    assert openrlhf[0] == want and trl[0] == want and not openrlhf.soft
    at = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("@")]
    assert len(at) == 2 and tok.decode(ids[at[0] - 1:at[0] + 1]) == " @"
    # other keys, another separator (TRL's layout)
    custom = dataset(tok, [{"q": TEXT, "ok": ["-", "+"]}], input_key="q", label_key="ok")
    assert custom[0]["step_labels"] == [1, 0]
    two_lines = dataset(tok, [{"prompt": "", "completions": ["a", "b"], "labels": [True, True]}],
                        separator="\n\n")
    assert tok.decode(two_lines[0]["input_ids"]) == "a @\n\nb @"


def test_soft_labels_and_labels_over_the_whole_vocabulary(tok):
    soft = dataset(tok, [{"input": TEXT, "label": [0.75, 0]}])
    assert soft.soft and soft[0]["step_labels"] == [0.75, 0.0]
    vocab = dataset(tok, [{"input": TEXT, "label": ["+", "x"]}], reward_tokens=None)
    assert vocab[0]["step_labels"] == [tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("x")]


def test_a_cut_text_drops_the_labels_of_the_cut_placeholders_and_rows_left_without_one(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    first = ids.index(tok.convert_tokens_to_ids("@"))
    rows = [{"input": TEXT, "label": ["+", "-"]}, {"input": "Q?\n" + "1+1=2 @", "label": ["+"]},
            {"input": "Q: " + "9" * 40 + " @", "label": ["-"]}]
    data = dataset(tok, rows, max_len=first + 1)
    assert [it["step_labels"] for it in data] == [[0], [0]] and len(data[0]["input_ids"]) == first + 1
    assert data.rows_cut == 2 and data.labels_cut == 2 and data.dropped == ["<rows>, row 3"]
    with pytest.raises(DataError, match="all 1 rows were dropped.*Raise --data.max_len"):
        dataset(tok, rows[2:], max_len=4)


def test_the_synthetic_chains_read_as_steps(tok):
    rows = make_prm_rows(64, seed=1)
    data = dataset(tok, rows)
    assert len(data) == 64 and [len(it["step_labels"]) for it in data] == [len(r["label"]) for r in rows]
    labels = [v for it in data for v in it["step_labels"]]
    assert 0.2 < sum(labels) / len(labels) < 0.5  # "-" steps: the wrong step and those after it
    assert make_prm_rows(64, seed=1) == rows


@pytest.mark.parametrize("row,message", [
    ({"input": TEXT, "label": ["+"]}, "2 placeholders '@' in the text but 1 labels under 'label'"),
    ({"input": TEXT}, "missing key 'label'"),
    ({"text": TEXT, "label": ["+", "-"]}, "missing key 'input'"),
    ({"input": TEXT, "label": []}, "key 'label' must be a non-empty list"),
    ({"input": TEXT, "label": ["+", "*"]}, "label '*' under 'label' is not one of --model.reward_tokens + -"),
    ({"input": TEXT, "label": ["+", 0.5]}, "mixes label tokens and probabilities"),
    ({"input": TEXT, "label": [1.5, 0.5]}, "must hold label tokens (strings) or probabilities in [0, 1]"),
    ({"input": TEXT, "label": [True, False]}, "must hold label tokens (strings) or probabilities"),
    ({"prompt": "Q", "completions": [], "labels": []}, "key 'completions' must be a non-empty list"),
    ({"prompt": "Q", "completions": ["a"], "labels": [True, False]}, "one true / false per step"),
    ({"prompt": "Q", "completions": ["a"], "labels": ["+"]}, "one true / false per step"),
    ({"completions": ["a"], "labels": [True]}, "missing key 'prompt'"),
    ({"prompt": "Q", "completions": ["a @"], "labels": [True]}, "2 placeholders '@' in the text but 1"),
])
def test_bad_rows_name_the_row(tok, row, message):
    good = {"input": TEXT, "label": ["+", "-"]}
    with pytest.raises(DataError) as e:
        dataset(tok, [good, row])
    assert str(e.value).startswith("<rows>, row 2: ") and message in str(e.value), str(e.value)


def test_a_placeholder_merged_with_its_neighbour_is_refused(tok):
    """"#" is one token, but " #" is another: a text whose placeholder follows a space loses it."""
    text = "Q\n1+1=2 #\n2+1=3#"
    assert tok.encode(text, add_special_tokens=False).count(tok.convert_tokens_to_ids("#")) == 1
    with pytest.raises(DataError, match="row 1: the placeholder '#' occurs 2 times in the text but is "
                                        r"token \d+ only 1 times after tokenising it \(merged with its"):
        dataset(tok, [{"input": text, "label": ["+", "+"]}], placeholder="#")


def test_labels_the_reward_tokens_cannot_hold(tok):
    with pytest.raises(DataError, match="row 1: key 'label' holds probabilities.*exactly two reward tokens"):
        dataset(tok, [{"input": TEXT, "label": [0.5, 1.0]}], reward_tokens=("+", "-", "0"))
    with pytest.raises(DataError, match="row 1: TRL's stepwise layout .* --model.reward_tokens GOOD BAD"):
        dataset(tok, [{"prompt": "", "completions": ["a"], "labels": [True]}], reward_tokens=None)
    with pytest.raises(DataError, match=r"row 2: its step labels are probabilities but those of <rows>, "
                                        "row 1 are label tokens"):
        dataset(tok, [{"input": TEXT, "label": ["+", "-"]}, {"input": TEXT, "label": [1.0, 0.0]}])
