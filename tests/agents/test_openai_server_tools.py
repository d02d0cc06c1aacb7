"""Tool calling and streaming in the OpenAI-compatible agent server: the official `openai` client drives a
tool episode (tool call -> tool message -> final answer), streaming and not, on a tiny model trained in the
fixture to make the call; the trained sample is exactly the served tokens."""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import requests
import torch

from posttrain.agents.agent_api import encode_text
from posttrain.agents.examples.openai_tools_agent import TOOLS
from posttrain.agents.multi_turn import AgentRunner
from posttrain.agents.openai_server import OpenAIServerAgentExecutor
from posttrain.agents.tool_calls import render_tool_prompt
from posttrain.data import Prompt
from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.trainers.rl.experience_maker import agent_metrics

pytest.importorskip("openai")

QUESTION = "What is 2 + 3?"  # as the shipped prompts ask, the tool as the shipped agent offers it
# the call as the model learns to write it: compact arguments, keys not in the order the template renders
CALL = '<tool_call>\n{"name": "add", "arguments": {"b":3,"a":2}}\n</tool_call>'
ANSWER = "The answer is 5."


def episode_tokens(tok) -> tuple[list[int], list[int], list[int], list[int]]:
    """(first prompt, the call + stop, the tool turn and the generation prompt, the answer + stop): the
    tokens the server should feed and the model should sample, as the server builds them."""
    user = [{"role": "user", "content": QUESTION}]
    first = render_tool_prompt(tok, user, TOOLS)
    sampled = [{"role": "assistant", "content": CALL}, {"role": "tool", "tool_call_id": "x", "content": "5"}]
    tail = render_tool_prompt(tok, user + sampled, TOOLS)[len(first + CALL + "<|im_end|>"):]
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    return (encode_text(tok, first), encode_text(tok, CALL) + stop, encode_text(tok, tail),
            encode_text(tok, ANSWER) + stop)


@pytest.fixture(scope="module")
def tool_model(tiny_model_dir, tmp_path_factory):
    """The tiny model trained (a few seconds) until greedy decoding makes the call and gives the answer."""
    from posttrain.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    p1, c1, tail, c2 = episode_tokens(tok)
    ids = torch.tensor([p1 + c1 + tail + c2])
    mask = torch.tensor([[0] * (len(p1) - 1) + [1] * len(c1) + [0] * len(tail) + [1] * len(c2)],
                        dtype=torch.bool)
    torch.manual_seed(0)
    model = load_causal_lm(tiny_model_dir, dtype="fp32")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(400):
        logits = model(ids).logits[:, :-1]
        if bool((logits.detach()[mask].argmax(-1) == ids[:, 1:][mask]).all()):
            break
        loss = torch.nn.functional.cross_entropy(logits[mask], ids[:, 1:][mask])
        opt.zero_grad()
        loss.backward()
        opt.step()
    else:
        raise AssertionError("the tiny model did not learn the tool episode")
    path = tmp_path_factory.mktemp("tool-model") / "nano"
    shutil.copytree(tiny_model_dir, path)
    model.save_pretrained(path)
    return str(path), tok, model.eval()


@pytest.fixture(scope="module",
                params=["hf", pytest.param("vllm", marks=[pytest.mark.slow, pytest.mark.e2e])])
def engine(request, tool_model):
    """The HF engine over the trained model, and real vLLM over its saved copy (as test_openai_server.py)."""
    path, tok, model = tool_model
    if request.param == "hf":
        yield HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
        return
    from posttrain.config.backends import vllm_unavailable
    from posttrain.rollout.hf_engine import resolve_eos_ids
    from posttrain.rollout.vllm_async_engine import VLLMAsyncRolloutEngine

    if vllm_unavailable():
        pytest.skip(f"real vLLM: {vllm_unavailable()}")
    engine = VLLMAsyncRolloutEngine(path, eos_token_ids=resolve_eos_ids(tok), dtype="float32",
                                    enforce_eager=True, max_model_len=640)
    yield engine
    engine.close()


def run_batch(executor, engine, tok, k=1, n=1, max_failure_frac=0.0, temperature=1.0):
    prompts = [Prompt(text=QUESTION, token_ids=encode_text(tok, QUESTION), label="5", source="test")] * k
    runner = AgentRunner(executor, engine, tok, None, max_len=600, timeout=120,
                         max_failure_frac=max_failure_frac)
    try:
        return runner.run(prompts, SamplingParams(n=n, seed=1, temperature=temperature))
    finally:
        executor.close()


async def ask(client, messages, stream, **kw) -> dict:
    """One call through the official client, as a plain dict: message, finish_reason, token_ids (and the
    streamed response put back together: content joined, tool calls by index)."""
    if not stream:
        reply = await client.chat.completions.create(model="policy", messages=messages, temperature=0.0,
                                                     **kw)
        return {"message": reply.choices[0].message.model_dump(exclude_none=True),
                "finish_reason": reply.choices[0].finish_reason, "token_ids": reply.token_ids,
                "error": getattr(reply.choices[0], "tool_call_error", None),
                "usage": reply.usage.model_dump()}
    chunks = [c async for c in await client.chat.completions.create(
        model="policy", messages=messages, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, **kw)]
    content, calls, out = [], {}, {"deltas": 0}
    for c in chunks:
        if c.usage is not None:
            out["usage"] = c.usage.model_dump()
        for choice in c.choices:
            delta = choice.delta
            content += [delta.content] if delta.content else []
            out["deltas"] += bool(delta.content)
            for t in delta.tool_calls or ():
                call = calls.setdefault(t.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] += t.id or ""
                call["function"]["name"] += t.function.name or ""
                call["function"]["arguments"] += t.function.arguments or ""
            if choice.finish_reason:
                out |= {"finish_reason": choice.finish_reason, "token_ids": c.token_ids,
                        "error": getattr(choice, "tool_call_error", None)}
    message = {"role": "assistant"} | ({"content": "".join(content)} if content else {})
    message |= {"tool_calls": [calls[i] for i in sorted(calls)]} if calls else {}
    return out | {"message": message}


class ToolAgent(OpenAIServerAgentExecutor):
    """The tool episode through the official client: the call, the tool's result, the final answer."""

    stream = False
    seen: list = []

    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        first = await ask(client, messages, self.stream, tools=TOOLS)
        call = first["message"]["tool_calls"][0]
        args = json.loads(call["function"]["arguments"])
        messages += [first["message"], {"role": "tool", "tool_call_id": call["id"],
                                        "content": str(args["a"] + args["b"])}]
        second = await ask(client, messages, self.stream, tools=TOOLS)
        await client.close()
        type(self).seen.append((first, second))
        return {"reward": float(second["message"].get("content") == f"The answer is {label}.")}


class StreamingToolAgent(ToolAgent):
    stream = True
    seen: list = []


@pytest.mark.parametrize("agent", [ToolAgent, StreamingToolAgent])
def test_the_openai_client_runs_a_tool_episode_trained_on_exactly_the_served_tokens(tool_model, engine,
                                                                                    agent):
    _, tok, _ = tool_model
    agent.seen = []
    executor = agent()
    batch = run_batch(executor, engine, tok, k=2)
    assert not batch.skipped.any() and executor.divergent == 0 and batch.rewards.tolist() == [1.0, 1.0]
    p1, c1, tail, c2 = episode_tokens(tok)
    for r, (first, second) in zip(batch.rollouts, agent.seen):
        assert first["finish_reason"] == "tool_calls" and first["message"]["tool_calls"] == [
            {"id": "call_0", "type": "function",
             "function": {"name": "add", "arguments": '{"b": 3, "a": 2}'}}]
        assert "content" not in first["message"]  # content None: no text outside the call
        assert second["finish_reason"] == "stop" and second["message"]["content"] == ANSWER
        served = second["token_ids"]["prompt_token_ids"] + second["token_ids"]["completion_token_ids"]
        assert first["token_ids"] == {"prompt_token_ids": p1, "completion_token_ids": c1}
        # the call as sampled (compact JSON) stays in the history, not the client's re-serialised echo
        assert served == p1 + c1 + tail + c2 == r.prompt_ids + r.output_ids
        assert r.prompt_ids == p1 and r.action_mask == [1] * len(c1) + [0] * len(tail) + [1] * len(c2)
        assert r.turns == 2 and r.tool_call_errors == 0
    assert agent_metrics(batch.rollouts)["agent/tool_call_errors"] == 0.0
    if agent.stream:  # content came token by token; the usage chunk was sent when asked for
        assert all(second["deltas"] == len(c2) - 1 for _, second in agent.seen)
        assert agent.seen[0][1]["usage"]["completion_tokens"] == len(c2)


def test_a_streamed_call_joins_to_the_non_streamed_response(tool_model, engine):
    """The same greedy episode, streamed and not: messages, finish reasons and tokens are equal."""
    _, tok, _ = tool_model
    for agent in (ToolAgent, StreamingToolAgent):
        agent.seen = []
        run_batch(agent(), engine, tok)
    plain, streamed = ToolAgent.seen[0], StreamingToolAgent.seen[0]
    for a, b in zip(plain, streamed):
        assert {k: a[k] for k in ("message", "finish_reason", "token_ids", "usage")} == {
            k: b[k] for k in ("message", "finish_reason", "token_ids", "usage")}


class Choices(OpenAIServerAgentExecutor):
    """One call with the request fields `extra` (each case its own episode)."""

    extra: dict = {}
    stream = False
    seen: list = []

    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        Choices.seen.append(await ask(client, messages, self.stream, tools=TOOLS, **self.extra))
        await client.close()
        return {"reward": 0.0}


def one_call(engine, tok, stream, **extra):
    executor = Choices()
    executor.stream, executor.extra, Choices.seen = stream, extra, []
    batch = run_batch(executor, engine, tok)
    assert not batch.skipped.any() and executor.divergent == 0
    return Choices.seen[0], batch


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_named_required_and_a_malformed_call(tool_model, engine, stream):
    _, tok, _ = tool_model
    p1, c1, _, _ = episode_tokens(tok)
    # "none": the tools are still rendered, the reply is not parsed
    none, batch = one_call(engine, tok, stream, tool_choice="none")
    assert none["message"] == {"role": "assistant", "content": CALL} and none["finish_reason"] == "stop"
    assert none["token_ids"]["prompt_token_ids"] == p1 and batch.rollouts[0].tool_call_errors == 0
    # a named function and "required": the call's opening is prefilled as context, the model completes it
    named = {"type": "function", "function": {"name": "add"}}
    for choice, opening in ((named, '<tool_call>\n{"name": "add", "arguments": '),
                            ("required", "<tool_call>\n")):
        call, batch = one_call(engine, tok, stream, tool_choice=choice)
        assert call["finish_reason"] == "tool_calls"
        assert call["message"]["tool_calls"][0]["function"] == {"name": "add",
                                                                 "arguments": '{"b": 3, "a": 2}'}
        prefilled = encode_text(tok, tok.decode(p1, skip_special_tokens=False) + opening)
        assert call["token_ids"]["prompt_token_ids"] == prefilled
        completion = call["token_ids"]["completion_token_ids"]
        assert tok.decode(completion, skip_special_tokens=False) == CALL[len(opening):] + "<|im_end|>"
        r = batch.rollouts[0]  # the prefill is context: the action is the model's completion only
        assert r.prompt_ids == prefilled and r.output_ids == completion
        assert r.action_mask == [1] * len(completion)
    # a reply cut inside its call: plain content with a one-line error and the engine's finish reason, counted
    cut_at = len(encode_text(tok, '<tool_call>\n{"name": "a'))
    cut, batch = one_call(engine, tok, stream, max_tokens=cut_at)
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == tok.decode(c1[:cut_at])
    assert "tool_calls" not in cut["message"]
    assert cut["error"].startswith("hermes tool call 0: unterminated <tool_call> (no </tool_call>) in ")
    assert batch.rollouts[0].tool_call_errors == 1
    assert agent_metrics(batch.rollouts)["agent/tool_call_errors"] == 1.0


class ForcedFirstCall(ToolAgent):
    """The tool episode with the first call forced by name: its prefill is context in the sample."""

    seen: list = []

    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        first = await ask(client, messages, False, tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "add"}})
        call = first["message"]["tool_calls"][0]
        messages += [first["message"], {"role": "tool", "tool_call_id": call["id"], "content": "5"}]
        second = await ask(client, messages, True, tools=TOOLS)
        await client.close()
        ForcedFirstCall.seen.append((first, second))
        return {"reward": float(second["message"].get("content") == ANSWER)}


def test_a_prefilled_call_continues_the_episode_on_its_tokens(tool_model, engine):
    _, tok, _ = tool_model
    ForcedFirstCall.seen = []
    executor = ForcedFirstCall()
    batch = run_batch(executor, engine, tok)
    assert not batch.skipped.any() and executor.divergent == 0 and batch.rewards.tolist() == [1.0]
    (first, second), r = ForcedFirstCall.seen[0], batch.rollouts[0]
    p1, c1 = first["token_ids"]["prompt_token_ids"], first["token_ids"]["completion_token_ids"]
    p2, c2 = second["token_ids"]["prompt_token_ids"], second["token_ids"]["completion_token_ids"]
    assert p2[: len(p1) + len(c1)] == p1 + c1 and r.prompt_ids + r.output_ids == p2 + c2
    assert r.prompt_ids == p1
    assert r.action_mask == [1] * len(c1) + [0] * (len(p2) - len(p1) - len(c1)) + [1] * len(c2)
    assert len(p1) > len(episode_tokens(tok)[0])  # the prefilled opening: context, before the first action


def post(session, body):
    r = requests.post(session.base_url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {session.api_key}"})
    return r.status_code, r.json()


class BadToolRequests(OpenAIServerAgentExecutor):
    answers: dict = {}

    async def run_agent(self, prompt, label, session):
        user = {"role": "user", "content": prompt}
        call = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
        cases = {
            "no_id": [user, call, {"role": "tool", "content": "5"}],
            "unknown_id": [user, call, {"role": "tool", "tool_call_id": "c9", "content": "5"}],
            "tool_first": [{"role": "tool", "tool_call_id": "c1", "content": "5"}],
            "bad_call": [user, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": 3}}]}],
            "tool_parts": [user, call, {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "text", "text": "5"}, {"type": "text", "text": "!"}]}],
            "tool_image": [user, call, {"role": "tool", "tool_call_id": "c1",
                                        "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        }
        for name, messages in cases.items():
            BadToolRequests.answers[name] = await asyncio.to_thread(post, session, {"messages": messages,
                                                                                    "tools": TOOLS,
                                                                                    "max_tokens": 2})
        others = {"bad_tools": {"tools": [{"name": "add"}]},
                  "unknown_choice": {"tools": TOOLS,
                                     "tool_choice": {"type": "function", "function": {"name": "mul"}}},
                  "choice_no_tools": {"tool_choice": "required"}, "stream_str": {"stream": "yes"},
                  "choice_fn_str": {"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}},
                  "ok": {"tools": TOOLS, "max_tokens": 2}}
        for name, extra in others.items():
            BadToolRequests.answers[name] = await asyncio.to_thread(post, session,
                                                                    {"messages": [user]} | extra)
        return {"reward": 0.0}


def test_bad_tool_requests_are_400_with_one_line(tool_model, engine):
    _, tok, _ = tool_model
    run_batch(BadToolRequests(), engine, tok, max_failure_frac=1.0)  # two answered, unrelated histories
    a = {k: (s, b.get("error", {}).get("message")) for k, (s, b) in BadToolRequests.answers.items()}
    assert a["no_id"] == (400, "messages[2]: a tool message needs 'tool_call_id', the id of the assistant "
                               "tool call it answers")
    assert a["unknown_id"] == (400, "messages[2]: tool_call_id 'c9' answers no tool call of an earlier "
                                    "assistant message")
    assert a["tool_first"][0] == 400 and "answers no tool call" in a["tool_first"][1]
    assert a["bad_call"][0] == 400 and a["bad_call"][1].startswith("messages[1].tool_calls[0] must be")
    assert a["bad_tools"][0] == 400 and a["bad_tools"][1].startswith("'tools' must be a list")
    assert a["unknown_choice"] == (400, "'tool_choice' names function 'mul', which is not in 'tools'")
    assert a["choice_no_tools"] == (400, "'tool_choice' 'required' needs 'tools'")
    assert a["stream_str"] == (400, "'stream' must be true or false, got 'yes'")
    assert a["choice_fn_str"][0] == 400 and a["choice_fn_str"][1].startswith("'tool_choice' must be 'auto', ")
    # a tool message's text parts are its text (as OpenAI allows); other parts are refused
    status, body = BadToolRequests.answers["tool_parts"]
    assert status == 200 and "<tool_response>\n5!\n</tool_response>" in tok.decode(
        body["token_ids"]["prompt_token_ids"])
    assert a["tool_image"] == (400, "messages[2]: a tool message's content must be text or a list of "
                                    "{type: 'text', text} parts")
    assert a["ok"][0] == 200 and all("\n" not in m for s, m in a.values() if m)


class EditsTheCall(OpenAIServerAgentExecutor):
    """Echoes the call with other arguments: not what was sampled, so the episode is not trained on."""

    async def run_agent(self, prompt, label, session):
        client = session.openai_client()
        messages = [{"role": "user", "content": prompt}]
        first = await ask(client, messages, False, tools=TOOLS)
        call = first["message"]["tool_calls"][0]
        call["function"]["arguments"] = '{"a": 2, "b": 4}'
        messages += [first["message"], {"role": "tool", "tool_call_id": call["id"], "content": "6"}]
        await ask(client, messages, False, tools=TOOLS)
        await client.close()
        return {"reward": 1.0}


def test_an_edited_tool_call_in_the_history_is_divergent(tool_model, engine):
    _, tok, _ = tool_model
    executor = EditsTheCall()
    batch = run_batch(executor, engine, tok, max_failure_frac=1.0)
    assert batch.skipped.tolist() == [True] and executor.divergent == 1
    assert "session diverged: call 2" in batch.rollouts[0].error


def test_the_shipped_tool_agent_file_runs_its_episode(tool_model, engine):
    """docs/agents.md's example agent file: the call as the client returns it goes back into the history,
    the tool's result, the answer; reward 1, on the sampled tokens."""
    from posttrain.agents.agent_file import load_agent_executor

    _, tok, _ = tool_model
    executor = load_agent_executor("posttrain/agents/examples/openai_tools_agent.py")
    batch = run_batch(executor, engine, tok, k=2, temperature=0.0)  # the run's greedy sampling
    assert not batch.skipped.any() and executor.divergent == 0 and batch.rewards.tolist() == [1.0, 1.0]
    assert batch.extra_logs["tool_calls"].tolist() == [1.0, 1.0]
    assert batch.rollouts[0].prompt_ids + batch.rollouts[0].output_ids == sum(episode_tokens(tok), [])


def test_streamed_content_pieces_join_to_the_content_and_never_split_a_character(tiny_model_dir):
    from posttrain.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    executor = OpenAIServerAgentExecutor()
    executor.tokenizer = tok
    text = "héllo wörld 😀 über 12+3"
    ids = encode_text(tok, text)
    pieces = executor._pieces(ids, text, "")
    assert "".join(pieces) == text and len(pieces) > 5 and not any("\ufffd" in p for p in pieces)
    lead = '<tool_call>\n{"name": '  # a prefilled opening comes first, then the model's tokens
    assert executor._pieces(ids, lead + text, lead) == [lead] + pieces
    # content that is not the tokens' text (the text outside tool calls): whatever matches, then the rest
    assert "".join(executor._pieces(ids, "héllo there", "")) == "héllo there"


def test_the_servers_call_ids_are_the_familys_numbered_over_the_session(tiny_model_dir):
    """Mistral's templates refuse ids that are not 9 alphanumeric characters: the server mints the family's
    ids, unique within the session (its served calls numbered in order)."""
    from types import SimpleNamespace

    from posttrain.agents.openai_server import Session
    from posttrain.agents.tool_calls import tool_call_format
    from posttrain.models import load_tokenizer
    from tests.agents.mistral_template import mistral_tokenizer

    fmt = tool_call_format(mistral_tokenizer(load_tokenizer(tiny_model_dir)))
    session = Session("s", "k", "http://x", "policy", engine=None, loop=None, defaults=None)
    executor = OpenAIServerAgentExecutor()
    ids = []
    for turn in ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {}}]',
                 '[TOOL_CALLS][{"name": "add", "arguments": {"b": 2}}]'):
        out = SimpleNamespace(text=turn, finish_reason="stop")
        message, finish, _ = executor._message(session, fmt, "", out, turn)
        assert finish == "tool_calls"
        ids += [c["id"] for c in message["tool_calls"]]
    assert ids == ["000000000", "000000001", "000000002"]
