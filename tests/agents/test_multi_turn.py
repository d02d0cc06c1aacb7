"""Multi-turn agent episodes (agents/agent_api.py, agents/multi_turn.py, rollout/async_engine.py):
exact token traces, the budget across turns, failures, and concurrency that does not change samples."""
from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import pytest
import torch

from posttrain.agents.agent_api import AgentInstanceBase, MultiTurnAgentExecutor
from posttrain.agents.multi_turn import AgentError, AgentRunner
from posttrain.data import Prompt
from posttrain.rollout import HFRolloutEngine, RolloutOutput, SamplingParams
from posttrain.trainers.rl.experience import build_experience


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


class ScriptedEngine:
    """A batch engine that answers a request whose context has `L` tokens with `script[turns[L]]` =
    (tokens, log-probs, finish reason), cut to the request's budget (then finish "length"); records
    every batch."""

    def __init__(self, script):
        self.script, self.batches, self.turns = script, [], {}

    def generate(self, prompts, params, max_new_tokens=None, seeds=None):
        self.batches.append([list(p) for p in prompts])
        outs = []
        for prompt, budget in zip(prompts, max_new_tokens):
            k = self.turn_of(prompt)
            tokens, lps, finish = self.script[k]
            if len(tokens) > budget:
                tokens, lps, finish = tokens[:budget], lps[:budget], "length"
            outs.append([RolloutOutput(list(prompt), list(tokens), list(lps), finish)])
        return outs

    def turn_of(self, prompt):
        return self.turns.get(len(prompt), 0)


def two_turn_env(feedback_texts, rewards, calls=None):
    class Env(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            self.turn = 0

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states, **kwargs):
            if calls is not None:
                calls.append(dict(states))
            k = self.turn
            self.turn += 1
            return {"rewards": torch.tensor(rewards[k]), "scores": torch.tensor(float(k)),
                    "environment_feedback": feedback_texts[k], "done": k == len(feedback_texts) - 1,
                    "sampling_params": states["sampling_params"],
                    "extra_logs": {"turn": torch.tensor(float(k))}}
    return Env


def prompt(tok, text="Q: 3+4?"):
    return Prompt(text=text, token_ids=tok(text, add_special_tokens=False)["input_ids"], label="7",
                  source="test")


def test_a_two_turn_episode_is_the_exact_token_trace(tok):
    p = prompt(tok)
    obs = p.token_ids
    fb1 = tok(" wrong, again:", add_special_tokens=False)["input_ids"]
    a1, a2 = [11, 12, 13], [21, 2]
    engine = ScriptedEngine({0: (a1, [-0.5, -0.25, -1.0], "stop"), 1: (a2, [-2.0, -0.125], "stop")})
    engine.turns = {len(obs): 0, len(obs) + 3 + len(fb1): 1}
    calls = []
    runner = AgentRunner(MultiTurnAgentExecutor(two_turn_env([" wrong, again:", ""], [0.25, 1.0], calls)),
                         engine, tok, None, max_len=64, timeout=30, max_failure_frac=0.0)
    batch = runner.run([p], SamplingParams(temperature=1.0, n=1, seed=3))
    r = batch.rollouts[0]
    assert r.prompt_ids == obs
    assert r.output_ids == a1 + fb1 + a2  # actions as sampled, feedback as tokenised, nothing re-tokenised
    assert r.action_mask == [1, 1, 1] + [0] * len(fb1) + [1, 1]
    assert r.rollout_logprobs == [-0.5, -0.25, -1.0] + [0.0] * len(fb1) + [-2.0, -0.125]
    assert (r.turns, r.env_tokens, r.finish_reason) == (2, len(fb1), "stop")
    assert batch.rewards.tolist() == [1.25]  # rewards add up over turns (OpenRLHF)
    assert batch.scores.tolist() == [1.0]  # the last step's score
    assert batch.extra_logs["turn"].tolist() == [1.0]
    # the environment saw the texts OpenRLHF passes: observation so far, the action's text, the label
    # (a1 ended on its stop token 13: as vLLM's `.text`, the action text leaves it out; the tokens keep it)
    assert calls[0]["observation_text"] == p.text and calls[0]["action_text"] == tok.decode(a1[:-1])
    assert (calls[1]["observation_text"] == p.text + tok.decode(a1[:-1]) + " wrong, again:"
            and calls[1]["label"] == "7")
    # the second request's context is the first turn's exact tokens
    assert engine.batches[1] == [obs + a1 + fb1]

    exp = build_experience(batch.rollouts, batch.rewards, pad_id=0)
    P = len(obs)
    assert exp.sequences[0].tolist() == obs + a1 + fb1 + a2
    assert exp.action_mask[0, P - 1:].tolist() == [1.0] * 3 + [0.0] * len(fb1) + [1.0] * 2
    assert exp.rollout_logp[0, P - 1:].tolist() == [-0.5, -0.25, -1.0] + [0.0] * len(fb1) + [-2.0, -0.125]


def test_environment_tokens_get_no_gradient(tok):
    """A probe: the policy loss of a multi-turn sample has zero gradient at every environment position."""
    from posttrain.algorithms.losses import policy_loss

    p = prompt(tok)
    fb = tok(" no", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine({0: ([5, 6], [-1.0, -1.0], "stop"), 1: ([7], [-1.0], "stop")})
    engine.turns = {len(p.token_ids): 0, len(p.token_ids) + 2 + len(fb): 1}
    runner = AgentRunner(MultiTurnAgentExecutor(two_turn_env([" no", ""], [0.0, 1.0])), engine, tok, None,
                         max_len=64, timeout=30, max_failure_frac=0.0)
    exp = build_experience(runner.run([p], SamplingParams(n=1, seed=1)).rollouts, torch.ones(1), pad_id=0)
    logp = torch.full_like(exp.rollout_logp, -1.0, requires_grad=True)
    adv = torch.ones_like(logp)
    loss = policy_loss(logp, exp.rollout_logp, adv, exp.action_mask)
    loss = loss[0] if isinstance(loss, tuple) else loss
    loss.backward()
    env = (exp.action_mask == 0)
    assert torch.all(logp.grad[env] == 0)
    assert torch.all(logp.grad[exp.action_mask == 1] != 0)


def test_the_budget_spans_all_turns_and_the_last_turn_is_cut_to_fit(tok):
    p = prompt(tok)
    P = len(p.token_ids)
    fb = tok(" try again please", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine({0: ([5, 6, 7], [-1.0] * 3, "stop"), 1: ([8] * 10, [-0.5] * 10, "stop")})
    engine.turns = {P: 0, P + 3 + len(fb): 1}
    env = two_turn_env([" try again please", " more", ""], [0.0, 0.0, 1.0])
    runner = AgentRunner(MultiTurnAgentExecutor(env), engine, tok, None, max_len=P + 3 + len(fb) + 4,
                         timeout=30, max_failure_frac=0.0)
    r = runner.run([p], SamplingParams(n=1, seed=1)).rollouts[0]
    assert len(r.prompt_ids) + len(r.output_ids) == P + 3 + len(fb) + 4  # never beyond --data.max_len
    assert r.output_ids[-4:] == [8] * 4 and r.finish_reason == "length"  # truncated flag set
    # feedback that does not fit is cut and ends the episode
    engine2 = ScriptedEngine({0: ([5, 6, 7], [-1.0] * 3, "stop")})
    engine2.turns = {P: 0}
    cut = AgentRunner(MultiTurnAgentExecutor(env), engine2, tok, None, max_len=P + 3 + 1, timeout=30,
                      max_failure_frac=0.0).run([p], SamplingParams(n=1, seed=1)).rollouts[0]
    assert (cut.output_ids == [5, 6, 7, fb[0]] and cut.action_mask == [1, 1, 1, 0]
            and cut.finish_reason == "length")


class Broken(AgentInstanceBase):
    mode = "raise"

    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        label = states["label"]
        if label == "raise":
            raise RuntimeError("the simulator crashed")
        if label == "hang":
            await asyncio.sleep(3600)  # cancelled when the episode times out
        if label == "malformed":
            return {"rewards": 1.0, "done": True}
        return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True}


def quick_episodes_timeout(runner, prompts) -> float:
    """A timeout that the quick ("ok") episodes meet however loaded the machine is, set on `runner` and
    returned: 50 times what a batch of as many "ok" episodes takes now, on this runner (so under the
    same load; the second of two, past the first call's warm-up), and at least 0.5 s. A fixed 1 s did
    not hold on a busy 2-core machine."""
    import time

    ok = [replace(p, label="ok") for p in prompts]
    runner.timeout = 600
    for _ in range(2):
        start = time.monotonic()
        assert not runner.run(ok, SamplingParams(n=1, seed=1)).skipped.any()
    runner.timeout = max(0.5, round(50 * (time.monotonic() - start), 1))
    return runner.timeout


def test_failing_episodes_are_counted_skipped_and_stop_the_run_past_the_threshold(tok, capsys):
    engine = ScriptedEngine({0: ([5], [-1.0], "stop")})
    engine.turns = {}
    prompts = [Prompt(text=f"Q{i}", token_ids=[30 + i], label=label, source="test")
               for i, label in enumerate(["ok", "raise", "hang", "malformed", "ok"])]
    runner = AgentRunner(MultiTurnAgentExecutor(Broken), engine, tok, None, max_len=16, timeout=0,
                         max_failure_frac=0.75)
    timeout = quick_episodes_timeout(runner, prompts)
    capsys.readouterr()
    batch = runner.run(prompts, SamplingParams(n=1, seed=1))
    assert batch.skipped.tolist() == [False, True, True, True, False]
    errors = [r.error for r in batch.rollouts]
    assert errors[1] == "RuntimeError: the simulator crashed"
    assert errors[2] == f"timed out after {timeout:g} s (--agent.timeout)"
    assert "lacks 'environment_feedback'" in errors[3]
    assert batch.rollouts[1].output_ids == [] and batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert "agent episode failed: RuntimeError: the simulator crashed" in capsys.readouterr().err
    strict = AgentRunner(MultiTurnAgentExecutor(Broken), engine, tok, None, max_len=16, timeout=timeout,
                         max_failure_frac=0.5)
    with pytest.raises(AgentError, match=r"3 of 5 agent episodes failed .*first: RuntimeError: the simulator "
                                         r"crashed"):
        strict.run(prompts, SamplingParams(n=1, seed=1))


def test_an_engine_error_stops_the_run_instead_of_failing_episodes(tok):
    class Dead:
        def generate(self, *a, **k):
            raise ConnectionError("rollout engine rank 0 died")

    runner = AgentRunner(MultiTurnAgentExecutor(Broken), Dead(), tok, None, max_len=16, timeout=5,
                         max_failure_frac=1.0)
    with pytest.raises(ConnectionError, match="rank 0 died"):
        runner.run([Prompt(text="Q", token_ids=[30], label="ok", source="test")], SamplingParams(n=1, seed=1))


def test_64_concurrent_episodes_equal_sequential_ones_with_the_same_seeds(tok, tiny_model_dir):
    from posttrain.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, dtype="fp32").eval()
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)

    from tests.agents.three_turns import ThreeTurns

    class Guess(ThreeTurns):
        reward = staticmethod(lambda action_text: float(len(action_text) % 2))

    prompts = [Prompt(text=f"Q{i}:", token_ids=tok(f"Q{i}:", add_special_tokens=False)["input_ids"],
                      label=None, source="test") for i in range(16)]
    params = SamplingParams(temperature=1.0, n=4, seed=11, max_new_tokens=6)
    class Counting:
        calls = 0

        def generate(self, *args, **kwargs):
            Counting.calls += 1
            return engine.generate(*args, **kwargs)

    runner = AgentRunner(MultiTurnAgentExecutor(Guess), Counting(), tok, None, max_len=40, timeout=60,
                         max_failure_frac=0, turn_cap=6)
    together = runner.run(prompts, params)
    batched_calls = Counting.calls
    assert len(together.rollouts) == 64
    # one episode at a time: prompt g alone, its n samples alone, with the same seeds (group offsets)
    alone = []
    for g, p in enumerate(prompts):
        alone += runner.run([p], params, group_offset=g).rollouts
    for a, b in zip(together.rollouts, alone):
        assert a.output_ids == b.output_ids and a.action_mask == b.action_mask
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
    assert together.rollouts[0].turns == 3
    # the concurrent run shared engine calls (requests of many episodes per batch): 3 turns of 64 episodes
    assert batched_calls <= 6 < 64 * 3

    class Streamed:  # the HF engine itself: continuous batching on its decode thread
        def stream(self, max_rows):
            self.server = engine.stream(max_rows)
            return self.server

    streamed_engine = Streamed()
    streamed = AgentRunner(MultiTurnAgentExecutor(Guess), streamed_engine, tok, None, max_len=40, timeout=60,
                           max_failure_frac=0, turn_cap=6).run(prompts, params)
    for a, b in zip(streamed.rollouts, alone):
        assert a.output_ids == b.output_ids and a.action_mask == b.action_mask
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
    # episodes decoded together, joining the running batch turn by turn
    assert streamed_engine.server.max_live > 16 and streamed_engine.server.steps < 64 * 3


def test_an_agents_stop_ids_are_added_to_the_engines_eos_as_vllm_does(tok):
    class Recording(ScriptedEngine):
        eos_token_ids = [2, 0]

        def generate(self, prompts, params, **kwargs):
            self.params = params
            return super().generate(prompts, params, **kwargs)

    class StopAtNewline(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            pass

        async def step(self, states, **kwargs):
            return {"rewards": 1.0, "environment_feedback": "", "done": True}

    class Executor(MultiTurnAgentExecutor):
        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                          images=None):
            sampling_params.stop_token_ids = [7, 2]
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)

    engine = Recording({0: ([5], [-1.0], "stop")})
    AgentRunner(Executor(StopAtNewline), engine, tok, None, max_len=16, timeout=5, max_failure_frac=0).run(
        [Prompt(text="Q", token_ids=[30], label=None, source="test")], SamplingParams(n=1, seed=1))
    assert engine.params.stop_token_ids == (2, 0, 7)


def test_a_prompt_length_outside_the_observation_fails_the_episode(tok):
    from posttrain.agents.multi_turn import EpisodeFailed, episode_to_rollout

    prompt = Prompt(text="Q", token_ids=[30], label=None, source="test")
    result = {"observation_tokens": [30, 5], "action_ranges": [(1, 2)], "rollout_log_probs": [0.0, -1.0],
              "prompt_length": 0}
    with pytest.raises(EpisodeFailed, match="prompt_length'] 0 must be between 1 and the 2 observation "
                                            "tokens"):
        episode_to_rollout(result, prompt, 0, 16, tok)
    assert episode_to_rollout(dict(result, prompt_length=1), prompt, 0, 16, tok).output_ids == [5]


class RecordingEngine(ScriptedEngine):
    eos_token_ids = [2, 0]

    def generate(self, prompts, params, **kwargs):
        self.params = params
        return super().generate(prompts, params, **kwargs)


class OneStep(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


def _one_episode(executor, engine, tok, params, max_len=16):
    return AgentRunner(executor, engine, tok, None, max_len=max_len, timeout=5, max_failure_frac=0).run(
        [Prompt(text="Q", token_ids=[30], label=None, source="test")], params)


@pytest.mark.parametrize("run_ids,agent_adds,expected", [
    (None, None, None),  # the engine's EOS ids
    ([9], None, (9,)),  # the run's ids replace the EOS, as in a single-turn run
    ([], None, ()),  # no ids: only the budget ends a turn
    ([9], [7], (9, 7)),  # an agent adding to the run's ids keeps them replacing the EOS
])
def test_the_runs_stop_ids_replace_the_eos_in_agent_turns_as_in_single_turn(tok, run_ids, agent_adds,
                                                                            expected):
    class Executor(MultiTurnAgentExecutor):
        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                          images=None):
            if agent_adds:
                sampling_params.stop_token_ids = list(sampling_params.stop_token_ids) + agent_adds
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)

    engine = RecordingEngine({0: ([5], [-1.0], "stop")})
    _one_episode(Executor(OneStep), engine, tok, SamplingParams(n=1, seed=1, stop_token_ids=run_ids))
    assert engine.params.stop_token_ids == expected


def test_min_tokens_reaches_the_engine_from_the_run_and_from_the_agent(tok):
    class Executor(MultiTurnAgentExecutor):
        async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                          images=None):
            assert sampling_params.min_tokens == 1  # OpenRLHF's default, as the run's SamplingParams
            sampling_params.min_tokens = 5
            return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)

    engine = RecordingEngine({0: ([5], [-1.0], "stop")})
    _one_episode(Executor(OneStep), engine, tok, SamplingParams(n=1, seed=1))
    assert engine.params.min_tokens == 5


def test_the_action_text_ends_before_a_stop_token_that_is_not_special(tok):
    """vLLM's `.text` leaves out the stop id a turn ended on (special or not); ids and log-probs keep it."""
    close = tok("</tool_call>", add_special_tokens=False)["input_ids"][-1]
    assert close not in tok.all_special_ids
    calls = []
    engine = RecordingEngine({0: ([5, 6, close], [-1.0] * 3, "stop")})
    _one_episode(MultiTurnAgentExecutor(two_turn_env([""], [1.0], calls)), engine, tok,
                 SamplingParams(n=1, seed=1, stop_token_ids=[close]))
    assert calls[0]["action_text"] == tok.decode([5, 6])
    length = RecordingEngine({0: ([5, 6, close], [-1.0] * 3, "length")})  # ran out of budget on that token
    calls.clear()
    _one_episode(MultiTurnAgentExecutor(two_turn_env([""], [1.0], calls)), length, tok,
                 SamplingParams(n=1, seed=1))
    assert calls[0]["action_text"] == tok.decode([5, 6, close])


@pytest.mark.parametrize("feedback_extra", [0, 1])
def test_an_episode_ended_by_the_budget_is_truncated_when_the_feedback_fills_it_exactly(tok, feedback_extra):
    """Feedback that exactly fills the remaining budget ends the episode by the budget, as one
    token more does."""
    p = prompt(tok)
    P = len(p.token_ids)
    fb = tok(" try again please", add_special_tokens=False)["input_ids"]
    engine = ScriptedEngine({0: ([5, 6, 7], [-1.0] * 3, "stop")})
    engine.turns = {P: 0}
    env = two_turn_env([" try again please", ""], [0.0, 1.0])
    r = AgentRunner(MultiTurnAgentExecutor(env), engine, tok, None, max_len=P + 3 + len(fb) - feedback_extra,
                    timeout=30, max_failure_frac=0.0).run([p], SamplingParams(n=1, seed=1)).rollouts[0]
    assert r.finish_reason == "length"


def test_an_action_that_fills_the_budget_with_empty_feedback_is_truncated_unless_done(tok):
    p = prompt(tok)
    P = len(p.token_ids)
    engine = ScriptedEngine({0: ([5, 6, 7], [-1.0] * 3, "stop")})
    engine.turns = {P: 0}
    not_done = two_turn_env(["", ""], [0.0, 1.0])  # the first step is not done
    r = AgentRunner(MultiTurnAgentExecutor(not_done), engine, tok, None, max_len=P + 3, timeout=30,
                    max_failure_frac=0.0).run([p], SamplingParams(n=1, seed=1)).rollouts[0]
    assert r.finish_reason == "length"
    done = two_turn_env([""], [1.0])  # the environment ends it: not truncated
    r = AgentRunner(MultiTurnAgentExecutor(done), engine, tok, None, max_len=P + 3, timeout=30,
                    max_failure_frac=0.0).run([p], SamplingParams(n=1, seed=1)).rollouts[0]
    assert r.finish_reason == "stop"


def test_extra_logs_that_are_not_numbers_are_skipped_with_a_warning_and_the_reward_kept(tok, capsys):
    class Logging(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            pass

        async def step(self, states, **kwargs):
            return {"rewards": 0.75, "environment_feedback": "", "done": True,
                    "extra_logs": {"acc": [1.0], "hits": torch.tensor([3.0]), "n": 2, "tag": "ok",
                                   "several": torch.tensor([1.0, 2.0]), "empty": []}}

    batch = _one_episode(MultiTurnAgentExecutor(Logging), ScriptedEngine({0: ([5], [-1.0], "stop")}), tok,
                         SamplingParams(n=1, seed=1))
    assert batch.rewards.tolist() == [0.75] and not batch.skipped.any()
    assert {k: v.tolist() for k, v in batch.extra_logs.items()} == {"acc": [1.0], "hits": [3.0], "n": [2.0]}
    err = capsys.readouterr().err
    for key in ("tag", "several", "empty"):
        assert f"extra_logs['{key}']" in err


class Blocking(AgentInstanceBase):
    """`label` "block": step() blocks its thread (a threading.Event wait, which asyncio cannot interrupt)
    until `release` is set, then sets `returned`; "exit": step() calls sys.exit(0)."""

    release, returned = threading.Event(), threading.Event()

    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states, **kwargs):
        import sys

        if states["label"] == "block":
            Blocking.release.wait(600)
            Blocking.returned.set()
        if states["label"] == "exit":
            sys.exit(0)
        return {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True}


def test_a_step_that_blocks_its_thread_times_out_and_the_others_finish(tok, capsys):
    engine = ScriptedEngine({0: ([5], [-1.0], "stop")})
    prompts = [Prompt(text=f"Q{i}", token_ids=[30 + i], label=label, source="test")
               for i, label in enumerate(["ok", "block", "ok"])]
    runner = AgentRunner(MultiTurnAgentExecutor(Blocking), engine, tok, None, max_len=16, timeout=0,
                         max_failure_frac=0.5)
    timeout = quick_episodes_timeout(runner, prompts)
    Blocking.release.clear()
    Blocking.returned.clear()
    try:
        batch = runner.run(prompts, SamplingParams(n=1, seed=1))
        assert not Blocking.returned.is_set()  # the run ended while the step still blocked its thread
    finally:
        Blocking.release.set()
    assert batch.skipped.tolist() == [False, True, False]
    assert batch.rollouts[1].error == f"timed out after {timeout:g} s (--agent.timeout)"
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0]
    assert f"agent episode failed: timed out after {timeout:g} s (--agent.timeout)" in capsys.readouterr().err


def test_sys_exit_in_step_stops_the_run_with_an_error_naming_the_file(tok):
    engine = ScriptedEngine({0: ([5], [-1.0], "stop")})
    runner = AgentRunner(MultiTurnAgentExecutor(Blocking), engine, tok, None, max_len=16, timeout=5,
                         max_failure_frac=1.0)
    with pytest.raises(AgentError, match=r"called sys.exit\(0\) at .*test_multi_turn.py:\d+"):
        runner.run([Prompt(text="Q", token_ids=[30], label="exit", source="test")],
                   SamplingParams(n=1, seed=1))


def test_episodes_scored_by_the_reward_source_log_its_terms(tok, tmp_path):
    """An episode without its own reward is scored by the run's reward source: a two-term CompositeReward's
    `reward/<term>` and `reward/<term>/<key>` metrics are logged over those episodes (NaN, left out of the
    mean, for the episode that brought its own reward)."""
    from posttrain.rewards import CompositeReward, function_terms
    from posttrain.trainers.rl.experience_maker import rollout_metrics

    (tmp_path / "first.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    return {'rewards': [1.0] * len(queries), 'extra_logs': {'hits': [2.0] * len(queries)}}\n")
    (tmp_path / "second.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n    return [0.25] * len(queries)\n")
    source = CompositeReward(function_terms([str(tmp_path / "first.py"), str(tmp_path / "second.py")],
                                            [1.0, 2.0]))

    class OwnRewardFor9(AgentInstanceBase):
        def __init__(self, *args, **kwargs):
            pass

        async def step(self, states, **kwargs):
            return {"rewards": 0.75 if states["label"] == "9" else None, "environment_feedback": "",
                    "done": True, "extra_logs": {"turn": 1.0}}

    prompts = [prompt(tok), replace(prompt(tok, "Q: 4+5?"), label="9"), prompt(tok, "Q: 1+6?")]
    engine = ScriptedEngine({0: ([11, 2], [-0.5, -0.5], "stop")})
    runner = AgentRunner(MultiTurnAgentExecutor(OwnRewardFor9), engine, tok, source, max_len=64, timeout=30,
                         max_failure_frac=0.0)
    batch = runner.run(prompts, SamplingParams(n=1, seed=1))
    assert batch.rewards.tolist() == [1.5, 0.75, 1.5]
    logs = {k: v.tolist() for k, v in batch.extra_logs.items()}
    assert logs["turn"] == [1.0, 1.0, 1.0]
    for key, value in (("first", 1.0), ("second", 0.25), ("first/hits", 2.0)):
        assert logs[key][0] == logs[key][2] == value and logs[key][1] != logs[key][1]  # NaN
    metrics = rollout_metrics(batch, 1)
    assert [metrics[f"reward/{k}"] for k in ("first", "second", "first/hits")] == [1.0, 0.25, 2.0]
