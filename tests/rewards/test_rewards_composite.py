"""CompositeReward (`--reward.func_path` with weights, beside a reward model or server): the weighted sum
per sample, each term kept for its `reward/<name>` metric, TRL's keyword arguments and dataset columns,
named terms from a dict, None as "does not apply"."""
import math
import textwrap

import pytest
import torch
from rewards_http import in_thread_server

from posttrain.rewards import (
    CompositeReward,
    PythonRewardFunction,
    RewardError,
    RewardModelSource,
    combine,
    function_terms,
    make_reward_source,
)
from posttrain.rollout.single_turn import Rollout, score_rollouts

PROMPTS = ["Q: 2+3=", "Q: 4*4=", "Q: 9-1=", "Q: 7+0="]
RESPONSES = [" 5", " 15 or so", " 8", " seven"]
LABELS = ["5", "16", "8", "7"]


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture
def files(tmp_path):
    correct = write(tmp_path, "correct.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": [1.0 if q[len(p):].split()[:1] == [str(a)] else 0.0
                                for q, p, a in zip(queries, prompts, labels)],
                    "extra_logs": {"accuracy": 0.5}}
    """)
    length = write(tmp_path, "length.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return [0.1 * (len(q) - len(p)) for q, p in zip(queries, prompts)]
    """)
    return correct, length


def batch():
    return [p + r for p, r in zip(PROMPTS, RESPONSES)], PROMPTS, LABELS


def test_weights_one_and_zero_give_exactly_the_first_function_alone(files):
    correct, length = files
    alone = PythonRewardFunction(correct).score(*batch())
    both = CompositeReward(function_terms([correct, length], [1.0, 0.0])).score(*batch())
    assert torch.equal(both.rewards, alone.rewards) and torch.equal(both.scores, alone.scores)
    assert both.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    # each term logged unweighted beside the sum; a function's own logs under its name
    assert both.extra_logs["correct"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert both.extra_logs["length"].tolist() == pytest.approx([0.2, 0.9, 0.2, 0.6])
    assert both.extra_logs["correct/accuracy"] == 0.5


def test_weights_scale_each_term_and_the_sum_is_per_sample(files):
    correct, length = files
    terms = function_terms([correct, length], [2.0, -1.0])
    out = CompositeReward(terms).score(*batch())
    each = [PythonRewardFunction(f).score(*batch()).rewards for f in files]
    assert torch.equal(out.rewards, each[0] * 2.0 + each[1] * -1.0)


def _rollouts(tokenizer, columns=None):
    out = []
    for i, (p, r, a) in enumerate(zip(PROMPTS, RESPONSES, LABELS)):
        out.append(Rollout(prompt_ids=tokenizer(p, add_special_tokens=False)["input_ids"],
                           output_ids=tokenizer(r, add_special_tokens=False)["input_ids"],
                           rollout_logprobs=[], finish_reason="stop", prompt_text=p, response_text=r,
                           label=a, group=i,
                           columns=None if columns is None else columns[i]))
    return out


def test_reward_model_and_a_rule_with_weights_one_one_give_their_per_sample_sum(tiny_score_model_dir, files):
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_score_model_dir)
    rm = RewardModelSource(tiny_score_model_dir, tokenizer=tok)
    source = combine(function_terms([files[0]], [1.0]), rm, "model", 1.0)
    assert source.needs_token_ids
    rollouts = _rollouts(tok)
    got = score_rollouts(source, tok, rollouts)
    model = rm.score_tokens([r.prompt_ids + r.output_ids for r in rollouts]).rewards
    rule = torch.tensor([1.0, 0.0, 1.0, 0.0])
    assert not torch.equal(model, torch.zeros(4))
    assert torch.equal(got.rewards, model + rule)  # the sampled token ids scored, per sample
    assert torch.equal(got.extra_logs["model"], model) and torch.equal(got.extra_logs["correct"], rule)


def test_dataset_columns_and_trl_arguments_reach_the_functions(tmp_path, tiny_model_dir):
    from posttrain.data.prompts import PromptDataset
    from posttrain.models import load_tokenizer

    trl = write(tmp_path, "trl_style.py", """
        SEEN = {}
        def reward_func(prompts, completions, completion_ids, solution, **kwargs):
            SEEN.update(prompts=prompts, completion_ids=completion_ids, kwargs=sorted(kwargs))
            return [1.0 if c.strip() == s else None for c, s in zip(completions, solution)]
    """)
    openrlhf = write(tmp_path, "openrlhf_style.py", """
        def reward_func(queries, prompts, labels, difficulty):
            return [float(d) for d in difficulty]
    """)
    tok = load_tokenizer(tiny_model_dir)
    rows = [{"prompt": p, "answer": a, "solution": s, "difficulty": d, "__source__": "f.jsonl", "__row__": i}
            for i, (p, a, s, d) in enumerate(zip(PROMPTS, LABELS, ["5", "16", "8", "7"], [1, 2, 3, 4]))]
    data = PromptDataset(rows, tok, input_key="prompt", label_key="answer", extra_columns=True)
    # not the input or the loader's; the label column under its own name, as TRL passes it
    assert data[0].columns == {"answer": "5", "solution": "5", "difficulty": 1}
    assert PromptDataset(rows, tok, input_key="prompt", label_key="answer")[0].columns is None
    source = CompositeReward(function_terms([trl, openrlhf], [1.0, 0.5]))
    rollouts = _rollouts(tok, [p.columns for p in data])
    out = score_rollouts(source, tok, rollouts)
    seen = source.terms[0].source.fn.__globals__["SEEN"]
    assert seen["prompts"] == PROMPTS and seen["completion_ids"] == [r.output_ids for r in rollouts]
    assert seen["kwargs"] == ["answer", "difficulty", "labels", "queries"]
    # None: "does not apply": adds nothing, and its metric is the mean of the others
    assert out.rewards.tolist() == [1.5, 1.0, 2.5, 2.0]
    logs = out.extra_logs["trl_style"]
    assert logs[0] == 1.0 and math.isnan(logs[1]) and math.isnan(logs[3])
    assert out.extra_logs["openrlhf_style"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_dict_return_gives_named_terms_weighted_by_the_function(tmp_path):
    named = write(tmp_path, "named.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            n = len(queries)
            return {"format": [1.0] * n, "answer": [float(i) for i in range(n)]}
    """)
    out = CompositeReward(function_terms([named], [2.0])).score(*batch())
    assert out.rewards.tolist() == [2.0, 4.0, 6.0, 8.0]
    assert out.extra_logs["format"].tolist() == [1.0] * 4
    assert out.extra_logs["answer"].tolist() == [0, 1, 2, 3]
    clash = write(tmp_path, "clash.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return {"format": [0.0] * len(queries)}
    """)
    with pytest.raises(RewardError, match="two reward terms are named 'format'"):
        CompositeReward(function_terms([named, clash])).score(*batch())


def test_function_errors_keep_the_on_error_policy(tmp_path, files):
    nan = write(tmp_path, "nan.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return [float("nan")] + [1.0] * (len(queries) - 1)
    """)
    with pytest.raises(RewardError, match=r"nan\.py: reward 0 is NaN"):
        CompositeReward(function_terms([files[0], nan])).score(*batch())
    out = CompositeReward(function_terms([files[0], nan], on_error="skip")).score(*batch())
    assert out.skipped.tolist() == [True, False, False, False]
    assert out.rewards.tolist() == [0.0, 1.0, 2.0, 1.0]


def test_a_named_function_of_a_file(tmp_path):
    two = write(tmp_path, "two.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return [1.0] * len(queries)
        def short(completions, **kwargs):
            return [float(len(c) < 4) for c in completions]
    """)
    out = CompositeReward(function_terms([two, f"{two}:short"])).score(*batch(), completions=RESPONSES)
    assert out.rewards.tolist() == [2.0, 1.0, 2.0, 1.0] and sorted(out.extra_logs) == ["short", "two"]


class _Counting:
    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def score(self, queries, prompts, labels=None, **kwargs):
        self.seen.append(len(queries))
        return self.inner.score(queries, prompts, labels)

    def close(self):
        self.inner.close()


def test_comma_separated_servers_stay_one_sharded_term(files):
    first, second = (_Counting(PythonRewardFunction(files[1])) for _ in range(2))
    with in_thread_server(first) as a, in_thread_server(second) as b:
        remote = make_reward_source(f"{a}/get_reward,{b}/get_reward", retries=1, timeout=20)
        out = combine(function_terms([files[0]]), remote, "remote", 10.0).score(*batch())
    assert first.seen == [2] and second.seen == [2]  # the batch shared by the two servers
    assert out.rewards.tolist() == pytest.approx([1 + 2.0, 9.0, 1 + 2.0, 6.0])
    assert sorted(out.extra_logs) == ["correct", "correct/accuracy", "remote"]


class _TokensOnly:
    """What a Ray reward-model group offers (`RewardGroup`): score_tokens and close, no score."""

    def __init__(self):
        self.seen = []

    def score_tokens(self, sequences):
        from posttrain.rewards import RewardResult

        self.seen.append(sequences)
        return RewardResult(torch.tensor([float(len(s)) for s in sequences]))

    def close(self):
        pass


def test_a_reward_group_joins_the_functions_through_the_sampled_token_ids(tiny_model_dir, files):
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    group = _TokensOnly()
    rollouts = _rollouts(tok)
    out = score_rollouts(combine(function_terms([files[0]]), group, "model", 0.5), tok, rollouts)
    ids = [r.prompt_ids + r.output_ids for r in rollouts]
    assert group.seen == [ids]
    assert out.rewards.tolist() == [1.0 * c + 0.5 * len(s) for c, s in zip([1.0, 0.0, 1.0, 0.0], ids)]


def test_a_weight_zero_term_that_skips_costs_no_sample_its_reward(tmp_path, files):
    nan = write(tmp_path, "nan.py", """
        def reward_func(queries, prompts, labels, **kwargs):
            return [float("nan")] + [1.0] * (len(queries) - 1)
    """)
    out = CompositeReward(function_terms([files[0], nan], [1.0, 0.0], on_error="skip")).score(*batch())
    assert out.skipped.tolist() == [False] * 4 and out.skip_reasons == []  # logged only: no skip
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    logs = out.extra_logs["nan"]
    assert math.isnan(logs[0]) and logs[1:].tolist() == [1.0] * 3  # its own metric leaves the skip out


class _Answers:
    """An engine answering prompt g with `answers[g]` (token ids), finish "stop"."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, prompts, params, max_new_tokens=None, seeds=None):
        from posttrain.rollout import RolloutOutput

        return [[RolloutOutput(list(p), list(a), [0.0] * len(a), "stop")]
                for p, a in zip(prompts, self.answers)]


def test_trl_reward_functions_get_chat_prompts_and_completions_as_trl_passes_them(tmp_path, tiny_model_dir):
    """Written as TRL's `accuracy_reward` / `think_format_reward` (`completion[0]["content"]`, the
    `solution` column): with message-list rows under the chat template they get the messages and
    `[{"role": "assistant", "content": text}]`; the label column comes under its own name; an
    OpenRLHF-style function keeps its texts."""
    from posttrain.data.prompts import PromptDataset
    from posttrain.models import load_tokenizer
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.single_turn import SingleTurnSampler

    trl = write(tmp_path, "trl_rewards.py", """
        import re
        SEEN = {}
        def accuracy_reward(completions, solution, **kwargs):
            SEEN.update(prompts=kwargs["prompts"], completions=completions)
            return [float(c[0]["content"].split()[-1] == s) for c, s in zip(completions, solution)]
        def think_format_reward(completions, **kwargs):
            pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
            return [float(bool(re.match(pattern, c[0]["content"], re.DOTALL))) for c in completions]
    """)
    openrlhf = write(tmp_path, "openrlhf_style.py", """
        SEEN = {}
        def reward_func(queries, prompts, labels, **kwargs):
            SEEN.update(prompts=prompts, completions=kwargs["completions"], labels=labels)
            return [0.0] * len(queries)
    """)
    tok = load_tokenizer(tiny_model_dir)
    chats = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "4*4?"}]]
    rows = [{"messages": m, "solution": s, "level": i} for i, (m, s) in enumerate(zip(chats, ["5", "16"]))]
    data = PromptDataset(rows, tok, input_key="messages", label_key="solution", apply_chat_template=True,
                         extra_columns=True)
    assert data[0].columns == {"solution": "5", "level": 0} and data[0].messages == chats[0]
    texts = ["<think>2 and 3</think> 5", " 15"]
    answers = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    source = CompositeReward(function_terms([f"{trl}:accuracy_reward", f"{trl}:think_format_reward",
                                             openrlhf], [1.0, 0.5, 1.0]))
    out = SingleTurnSampler(_Answers(answers), source, tok).run(list(data), SamplingParams(n=1))
    decoded = [tok.decode(a, skip_special_tokens=True) for a in answers]
    seen = source.terms[0].source.fn.__globals__["SEEN"]
    assert seen["prompts"] == chats
    assert seen["completions"] == [[{"role": "assistant", "content": d}] for d in decoded]
    assert out.extra_logs["accuracy_reward"].tolist() == [1.0, 0.0]
    assert out.extra_logs["think_format_reward"].tolist() == [1.0, 0.0]
    assert out.rewards.tolist() == [1.5, 0.0]
    plain = source.terms[2].source.fn.__globals__["SEEN"]
    assert plain == {"prompts": [p.text for p in data], "completions": decoded, "labels": ["5", "16"]}
