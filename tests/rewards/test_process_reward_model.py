"""A process reward model as a reward source (`rewards.process_reward_model`): how a response is split into
steps, which response token ends each step, and the PRM's input and scores (docs/rewards.md#process-reward-
models-in-rl)."""
import pytest
import torch

from posttrain.rewards.process_reward_model import split_steps, step_end_tokens


def ends_of(pieces: list[str], separator: str = "\n") -> list[int]:
    """Step-end tokens of a response whose tokens decode to `pieces` (a decoder that joins them)."""
    ids = list(range(len(pieces)))
    text = "".join(pieces)
    spans = split_steps(text, separator)
    return step_end_tokens(ids, [e for _, e in spans], lambda part: "".join(pieces[i] for i in part))


def test_steps_are_the_non_empty_pieces_between_separators():
    assert split_steps("a\nbc\n", "\n") == [(0, 1), (2, 4)]  # a trailing separator: no empty step
    assert split_steps("a\n\nbc", "\n") == [(0, 1), (3, 5)]  # two in a row: no empty step either
    assert split_steps("one step", "\n") == [(0, 8)]
    assert split_steps("", "\n") == []
    assert split_steps("x ки y ки", " ки ") == [(0, 1), (5, 9)]  # a separator of several characters
    assert split_steps("a  \n \n\tb \n", "\n") == [(0, 1), (6, 8)]  # trailing blanks cut; blank: no step


def test_each_step_ends_on_the_token_that_holds_its_last_character():
    # "2 + 2 = 4" is split over tokens 0-2 (its last character "4" in " = 4"), the separator is token 3
    assert ends_of(["2 ", "+ 2", " = 4", "\n", "so 4"]) == [2, 4]
    assert ends_of(["ab", "c"]) == [1]  # no separator: one step, ending on the last token
    assert ends_of(["x", "y", "\n"]) == [1]  # a response ending in the separator: the separator is no step
    assert ends_of([]) == []  # an empty response has no step
    assert ends_of(["a\nb"]) == [0, 0]  # one token holds the end of two steps
    assert ends_of(["a", "\nb", "c\n"]) == [0, 2]  # a separator that starts a token is no part of the step


def test_a_step_ending_in_a_character_of_several_byte_tokens_ends_on_its_last_byte(tiny_model_dir):
    """The tiny tokenizer is byte-level: "€" (3 bytes) and "é" are several tokens, and a prefix that stops
    inside one decodes to U+FFFD; the step still ends on the token of the character's last byte."""
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    for response in ("costs 5€\nso é\nok", "€\n€€"):
        ids = tok(response, add_special_tokens=False)["input_ids"]
        assert any("\ufffd" in tok.decode(ids[:k]) for k in range(len(ids)))  # the case under test
        ends = step_end_tokens(ids, [e for _, e in split_steps(response, "\n")], tok.decode)
        for (start, end), e in zip(split_steps(response, "\n"), ends):
            assert tok.decode(ids[: e + 1]) == response[:end], (response, end)


@pytest.fixture(scope="module")
def prm(tiny_model_dir):
    """The untrained nano LM as a PRM (placeholder "@", reward tokens "+" "-"), its tokenizer the policy's."""
    from posttrain.models import load_tokenizer
    from posttrain.models.prm_spec import PRMSpec
    from posttrain.rewards.process_reward_model import ProcessRewardSource

    tok = load_tokenizer(tiny_model_dir)
    return ProcessRewardSource(tiny_model_dir, PRMSpec("@", ["+", "-"], "\n"), tok), tok


def test_the_prm_scores_the_placeholders_it_put_after_each_step(prm, tiny_model_dir):
    """Scores = P("+") among ("+", "-") at each placeholder of prompt + "1 + 1 @\\n= 2 @" (a plain forward of
    the model); an "@" the policy wrote inside a step is no step end; an empty response has no steps."""
    from posttrain.models import load_causal_lm

    src, tok = prm
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt, response, at_inside = enc("Q: 1+1?"), enc("1 + 1\n= 2\n"), enc("a@b\nc")
    got = src.score_steps([prompt, prompt, prompt], [response, [], at_inside])
    assert got.steps == [2, 0, 2] and got.dropped == [0, 0, 0]
    for ids, ends, last in zip([response, at_inside], [got.ends[0], got.ends[2]], [["1", "2"], ["b", "c"]]):
        assert [tok.decode(ids[: e + 1])[-1] for e in ends] == last  # the token holding each step's last char
        assert all(not tok.decode(ids[e:e + 1]).startswith("\n") for e in ends)
    model = load_causal_lm(tiny_model_dir, dtype="fp32").eval()
    for text, scores in (("Q: 1+1?1 + 1 @\n= 2 @", got.scores[0]), ("Q: 1+1?a@b @\nc @", got.scores[2])):
        ids = torch.tensor([enc(text)])
        with torch.no_grad():
            logits = model(ids).logits[0]
        at = [j for j, t in enumerate(ids[0].tolist()) if t == src.placeholder_id]
        at = at[-2:]  # the placeholders this rendering put there (not the "@" inside "a@b")
        want = torch.softmax(logits[at][:, src.reward_ids], -1)[:, 0]
        assert scores == pytest.approx(want.tolist(), abs=1e-5)
    assert got.ends[1] == [] and got.scores[1] == []


def test_a_prm_input_longer_than_the_limit_loses_its_first_tokens_and_steps(prm):
    src, tok = prm
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt, response = enc("Q: 1+1?"), enc("1 + 1\n= 2")
    whole = len(enc("Q: 1+1?1 + 1 @\n= 2 @"))
    limit = src.max_len
    try:
        src.max_len = whole - 2  # the prompt loses two tokens: every step kept
        assert src.score_steps([prompt], [response]).dropped == [0]
        src.max_len = len(enc("\n= 2 @"))  # only the last step's text and placeholder fit
        got = src.score_steps([prompt], [response])
    finally:
        src.max_len = limit
    assert got.steps == [2] and got.dropped == [1] and len(got.scores[0]) == 1
    assert got.ends[0] == [len(response) - 1]


def test_a_placeholder_merged_with_its_step_leaves_that_step_unscored(prm):
    """Where the PRM's tokenizer merged a rendered placeholder with the text around it (here made so: the
    first placeholder's id replaced), that step gets no score and counts as dropped; the run goes on."""
    src, tok = prm

    class Merging:
        def __init__(self, real):
            self.real = real

        def __call__(self, text, **kwargs):
            enc = dict(self.real(text, **kwargs))
            ids = list(enc["input_ids"])
            ids[ids.index(src.placeholder_id)] = tok("7", add_special_tokens=False)["input_ids"][0]
            return {**enc, "input_ids": ids}

    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    response = enc("1 + 1\n= 2")
    real, src.tokenizer = src.tokenizer, Merging(src.tokenizer)
    try:
        got = src.score_steps([enc("Q: 1+1?")], [response])
    finally:
        src.tokenizer = real
    assert got.steps == [2] and got.dropped == [1] and len(got.scores[0]) == 1
    assert got.ends[0] == [len(response) - 1]  # the second step's
