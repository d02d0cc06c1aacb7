"""The OpenAI-compatible agent server (agents/openai_server.py): an agent program talking HTTP (or the
official `openai` client) drives episodes; its calls' tokens are stitched into exact samples; bad
requests are refused with a reason; a history that re-renders differently is never trained on. Every
test runs on the HF engine and on real vLLM (`engine`), as does an `agent_func.py` executor's."""
from __future__ import annotations

import asyncio

import pytest
import requests

from posttrain.agents.multi_turn import AgentRunner
from posttrain.agents.openai_server import OpenAIServerAgentExecutor
from posttrain.data import Prompt
from posttrain.rollout import HFRolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from posttrain.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module",
                params=["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.e2e])])
def engine(request, tiny_model_dir, tok):
    """The HF engine, and real vLLM over AsyncLLM (each model call its own request, as on a Ray rollout
    engine of an agent run; its engine core is a process of its own): the server drives both alike."""
    if request.param == "hf":
        from posttrain.models import load_causal_lm

        yield HFRolloutEngine(load_causal_lm(tiny_model_dir, dtype="fp32").eval(), tok,
                              pad_token_id=tok.pad_token_id)
        return
    from posttrain.config.backends import vllm_unavailable
    from posttrain.rollout.hf_engine import resolve_eos_ids
    from posttrain.rollout.vllm_async_engine import VLLMAsyncRolloutEngine

    if vllm_unavailable():
        pytest.skip(f"real vLLM: {vllm_unavailable()}")
    engine = VLLMAsyncRolloutEngine(tiny_model_dir, eos_token_ids=resolve_eos_ids(tok), dtype="float32",
                                    enforce_eager=True, max_model_len=256)
    yield engine
    engine.close()


def post(session, path, body, key=None):
    return requests.post(session.base_url.removesuffix("/v1") + path, json=body, timeout=30,
                         headers={"Authorization": f"Bearer {key or session.api_key}"})


class TwoTurnHTTP(OpenAIServerAgentExecutor):
    """Asks, shows the answer back as a tool result, asks again (plain HTTP through `requests`)."""

    seen: list = []

    async def run_agent(self, prompt, label, session):
        messages = [{"role": "user", "content": prompt}]
        first = (await asyncio.to_thread(post, session, "/v1/chat/completions",
                                         {"messages": messages, "max_tokens": 5, "logprobs": True})).json()
        answer = first["choices"][0]["message"]["content"]
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "check: wrong"}]
        second = (await asyncio.to_thread(post, session, "/v1/chat/completions",
                                          {"messages": messages, "max_tokens": 4})).json()
        TwoTurnHTTP.seen.append((first, second))
        return {"reward": 1.0 if second["choices"][0]["finish_reason"] == "stop" else 0.0}


def prompts(tok, k):
    return [Prompt(text=f"What is {i}+{i}?",
                   token_ids=tok(f"What is {i}+{i}?", add_special_tokens=False)["input_ids"],
                   label=str(2 * i), source="test") for i in range(k)]


def run_batch(executor, engine, tok, *, max_len, k, params, max_failure_frac=0.0):
    """One rollout batch of `k` prompts through `executor`, its server stopped afterwards."""
    runner = AgentRunner(executor, engine, tok, None, max_len=max_len, timeout=60,
                         max_failure_frac=max_failure_frac)
    try:
        return runner.run(prompts(tok, k), params)
    finally:
        executor.close()


def test_http_agent_episodes_are_stitched_from_the_exact_tokens(tok, engine):
    batch = run_batch(TwoTurnHTTP(), engine, tok, max_len=200, k=3,
                      params=SamplingParams(temperature=1.0, n=2, seed=5))
    assert len(batch.rollouts) == 6 and not batch.skipped.any()
    for r in batch.rollouts:  # the calls of this sample's episode (episodes finish in any order)
        first, second = next((f, s) for f, s in TwoTurnHTTP.seen if s["token_ids"]["prompt_token_ids"]
                             + s["token_ids"]["completion_token_ids"] == r.prompt_ids + r.output_ids)
        p1, c1 = first["token_ids"]["prompt_token_ids"], first["token_ids"]["completion_token_ids"]
        p2, c2 = second["token_ids"]["prompt_token_ids"], second["token_ids"]["completion_token_ids"]
        assert p2[: len(p1) + len(c1)] == p1 + c1  # delta tokenisation: the sampled tokens are kept
        assert r.prompt_ids == p1 and r.output_ids == p2[len(p1):] + c2
        mask = [1] * len(c1) + [0] * (len(p2) - len(p1) - len(c1)) + [1] * len(c2)
        assert r.action_mask == mask and r.turns == 2
        lps = [x["logprob"] for x in first["choices"][0]["logprobs"]["content"]]
        assert r.rollout_logprobs[: len(c1)] == pytest.approx(lps)
        assert all(lp == 0.0 for lp, m in zip(r.rollout_logprobs, mask) if not m)
        assert first["usage"]["completion_tokens"] == len(c1) <= 5 and len(c2) <= 4
    # the same seeds give the same samples on a second run (episodes interleave differently)
    second_run = run_batch(TwoTurnHTTP(), engine, tok, max_len=200, k=3,
                           params=SamplingParams(temperature=1.0, n=2, seed=5))
    assert [r.output_ids for r in second_run.rollouts] == [r.output_ids for r in batch.rollouts]


class Probe(OpenAIServerAgentExecutor):
    """Sends bad requests, records the answers, then makes one good call."""

    answers: dict = {}

    async def run_agent(self, prompt, label, session):
        def call(path, body, key=None, method="post"):
            if method == "get":
                r = requests.get(session.base_url.removesuffix("/v1") + path, timeout=30,
                                 headers={} if key == ""
                                 else {"Authorization": f"Bearer {key or session.api_key}"})
            else:
                r = post(session, path, body, key)
            return r.status_code, r.json()
        good = [{"role": "user", "content": prompt}]
        cases = {
            "no_auth": lambda: call("/v1/models", None, key="", method="get"),
            "wrong_key": lambda: call("/v1/chat/completions", {"messages": good}, key="nope"),
            "no_messages": lambda: call("/v1/chat/completions", {"messages": []}),
            "bad_message": lambda: call("/v1/chat/completions", {"messages": [{"role": "user"}]}),
            "stream": lambda: call("/v1/chat/completions", {"messages": good, "stream": "yes"}),
            "n2": lambda: call("/v1/chat/completions", {"messages": good, "n": 2}),
            "temperature": lambda: call("/v1/chat/completions", {"messages": good, "temperature": "hot"}),
            "too_long": lambda: call("/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": "x " * 400}]}),
            "models": lambda: call("/v1/models", None, method="get"),
            "health": lambda: call("/health", None, method="get"),
            "tokenize": lambda: call("/tokenize", {"messages": good}),
        }
        for name, fn in cases.items():
            Probe.answers[name] = await asyncio.to_thread(fn)
        Probe.answers["ok"] = await asyncio.to_thread(call, "/v1/chat/completions",
                                                      {"messages": good, "max_tokens": 3})
        return {"reward": 0.5}


def test_bad_requests_are_refused_with_a_reason(tok, engine):
    batch = run_batch(Probe(), engine, tok, max_len=64, k=1, params=SamplingParams(n=1, seed=1))
    a = Probe.answers
    assert a["no_auth"][0] == 401 and "missing Authorization" in a["no_auth"][1]["error"]["message"]
    assert a["wrong_key"][0] == 401 and "unknown bearer token" in a["wrong_key"][1]["error"]["message"]
    assert a["no_messages"] == (400, {"error": {"message": "'messages' must be a non-empty list of {role, "
                                                           "content} objects",
                                                "type": "invalid_request_error"}})
    assert a["bad_message"][0] == 400 and "messages[0]" in a["bad_message"][1]["error"]["message"]
    assert a["stream"][0] == 400 and a["n2"][0] == 400
    assert (a["temperature"][0] == 400
            and "'temperature' must be a number" in a["temperature"][1]["error"]["message"])
    assert a["too_long"][0] == 413 and "--data.max_len 64" in a["too_long"][1]["error"]["message"]
    assert a["models"] == (200,
                           {"object": "list",
                            "data": [{"id": "policy", "object": "model", "owned_by": "posttrain"}]})
    assert a["health"][0] == 200 and a["tokenize"][1]["count"] == len(a["tokenize"][1]["tokens"]) > 0
    # only the good call
    assert a["ok"][0] == 200 and batch.rewards.tolist() == [0.5] and batch.rollouts[0].turns == 1


class RewritesHistory(OpenAIServerAgentExecutor):
    async def run_agent(self, prompt, label, session):
        messages = [{"role": "user", "content": prompt}]
        await asyncio.to_thread(post, session, "/v1/chat/completions",
                                {"messages": messages, "max_tokens": 3})
        messages += [{"role": "assistant", "content": "something it never said"},
                     {"role": "user", "content": "ok?"}]
        r = await asyncio.to_thread(post, session, "/v1/chat/completions",
                                    {"messages": messages, "max_tokens": 3})
        assert r.status_code == 200  # the agent is still served...
        return {"reward": 1.0}


def test_a_history_that_diverges_from_the_sampled_tokens_is_counted_and_not_trained(tok, engine):
    executor = RewritesHistory()
    batch = run_batch(executor, engine, tok, max_len=128, k=2, params=SamplingParams(n=1, seed=1),
                      max_failure_frac=1.0)
    assert batch.skipped.tolist() == [True, True] and executor.divergent == 2  # ...but never trained on
    assert "session diverged: call 2: the re-rendered history differs" in batch.rollouts[0].error


class OfficialClient(OpenAIServerAgentExecutor):
    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            reply = await client.chat.completions.create(model=session.model, messages=messages, max_tokens=4)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "more"}]
        await client.close()
        return {"reward": float(len(messages))}


def test_the_official_openai_client_drives_episodes(tok, engine):
    pytest.importorskip("openai")
    batch = run_batch(OfficialClient(), engine, tok, max_len=200, k=2, params=SamplingParams(n=2, seed=3))
    assert not batch.skipped.any() and [r.turns for r in batch.rollouts] == [2] * 4
    assert batch.rewards.tolist() == [5.0] * 4


def test_content_ends_before_a_stop_token_that_is_not_special_and_the_echoed_history_still_continues(tok,
                                                                                                     engine):
    """vLLM leaves the stop token out of `message.content`; an agent echoing that content back continues the
    session from the sampled tokens (the stop token stays in the sample), with no divergence."""
    stops = [t for t in range(100, 400) if t not in tok.all_special_ids]  # frequent, not special
    TwoTurnHTTP.seen = []
    executor = TwoTurnHTTP()
    batch = run_batch(executor, engine, tok, max_len=200, k=3,
                      params=SamplingParams(temperature=1.0, n=2, seed=5, stop_token_ids=stops))
    assert not batch.skipped.any() and executor.divergent == 0
    calls = [c for pair in TwoTurnHTTP.seen for c in pair]
    ended = [c for c in calls if c["choices"][0]["finish_reason"] == "stop"]
    assert ended, "no call ended on a stop id"
    for call in calls:
        ids = call["token_ids"]["completion_token_ids"]
        shown = ids[:-1] if call["choices"][0]["finish_reason"] == "stop" else ids
        assert call["choices"][0]["message"]["content"] == tok.decode(shown, skip_special_tokens=True)
    assert all(c["token_ids"]["completion_token_ids"][-1] in stops for c in ended)


class LimitProbe(OpenAIServerAgentExecutor):
    """A small body limit: oversized /tokenize and chat bodies, and a lone surrogate, then one good call."""

    max_request_bytes = 4000
    answers: dict = {}

    async def run_agent(self, prompt, label, session):
        def call(path, body):
            r = post(session, path, body)
            return r.status_code, r.json()
        big = [{"role": "user", "content": "x" * 5000}]
        cases = {
            "tokenize_big": lambda: call("/tokenize", {"messages": big}),
            "chat_big": lambda: call("/v1/chat/completions", {"messages": big}),
            "surrogate": lambda: call("/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "a\ud800"}]}),
            "ok": lambda: call("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}],
                                                        "max_tokens": 3}),
        }
        for name, fn in cases.items():
            LimitProbe.answers[name] = await asyncio.to_thread(fn)
        return {"reward": 0.5}


def test_bodies_over_the_size_limit_are_413_and_invalid_text_is_400(tok, engine):
    batch = run_batch(LimitProbe(), engine, tok, max_len=64, k=1, params=SamplingParams(n=1, seed=1))
    a = LimitProbe.answers
    for name in ("tokenize_big", "chat_big"):
        assert a[name][0] == 413 and "request body larger than 4000 bytes" in a[name][1]["error"]["message"]
    assert a["surrogate"][0] == 400 and "lone UTF-16 surrogate" in a["surrogate"][1]["error"]["message"]
    assert a["ok"][0] == 200 and batch.rewards.tolist() == [0.5]


def test_agent_func_episodes_together_equal_each_prompt_alone(tok, engine):
    """An `agent_func.py` executor (OpenRLHF's `MultiTurnAgentExecutor`): 8 concurrent three-turn episodes
    (each model call its own request, streamed into the running batch) give exactly the samples of each
    prompt's episodes run alone with the same seeds."""
    from posttrain.agents.agent_api import MultiTurnAgentExecutor
    from tests.agents.three_turns import ThreeTurns

    runner = AgentRunner(MultiTurnAgentExecutor(ThreeTurns), engine, tok, None, max_len=40, timeout=60,
                         max_failure_frac=0, turn_cap=6)
    params = SamplingParams(temperature=1.0, n=2, seed=11, max_new_tokens=6)
    batch = prompts(tok, 4)
    together = runner.run(batch, params)
    alone = [r for g, p in enumerate(batch) for r in runner.run([p], params, group_offset=g).rollouts]
    assert len(together.rollouts) == 8 and together.rollouts[0].turns == 3
    for a, b in zip(together.rollouts, alone):
        assert a.output_ids == b.output_ids and a.action_mask == b.action_mask
        assert a.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=1e-5)
