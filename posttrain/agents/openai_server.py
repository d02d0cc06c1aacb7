"""An agent executor that serves the policy as an OpenAI-compatible HTTP API during rollouts, so an
agent program written against the OpenAI API (the official `openai` client, or plain HTTP) drives
the episodes; every call's tokens are recorded and stitched into the training sample.

Subclass `OpenAIServerAgentExecutor` and write `async run_agent(self, prompt, label, session) -> dict`:
talk to `session.base_url` with `session.api_key` (`session.openai_client()` builds an
`openai.AsyncOpenAI` when that package is installed), and return `{"reward": ..., "scores": ...,
"extra_logs": {...}}` (a missing reward is scored by the run's reward source). An agent file gives
`class AgentExecutor(OpenAIServerAgentExecutor)` to `--train.agent_func_path`.

The server (FastAPI on 127.0.0.1, a random port, its own thread, started on first use) serves
`GET /health`, `GET /v1/models`, `POST /tokenize` and `POST /v1/chat/completions`. Every episode gets
a session with its own bearer token: a request without the token of a live session gets 401;
a malformed one (bad JSON, no messages, a message without role/content, text that is not valid
Unicode, `n > 1`, a bad `max_tokens` / `temperature` / `top_p` / `tools` / `tool_choice`, a tool message
answering no call) gets 400 with the reason (`agents/openai_chat.py` checks the wire format); a
history longer than the budget 413, and so does a body larger than `max_request_bytes` (32 MiB, as
serve-rm's default), read no further than that. Request headers not complete within `read_timeout`
seconds (60, serve-rm's default), or a body not complete within as many again, get 408 and the
connection is closed; a client gone mid-body is logged in one counted line.

Tool calling (OpenAI's): `tools` are rendered by the chat template (`tool_calls.render_tool_prompt`), and the
reply is parsed in the tokenizer's family format (`tool_calls.tool_call_format`, found on the first request
with tools; 400 when the family is unknown) into `message.tool_calls` (ids minted by the format, numbered over
the session's served calls: `call_<n>`, 9 digits for Mistral; arguments a JSON string), `content` the text
outside the calls (None when empty), finish_reason "tool_calls". A malformed call is returned as plain content
with the engine's finish_reason ("stop", or "length" when the budget cut it) and a `tool_call_error` line in
the choice, and counted (`agent/tool_call_errors`); never a 500. `tool_choice`: "auto" parses; "none" still
renders the tools (as OpenAI) and returns the text as content unparsed; "required" and a named function put
the family's call opening (`prefill`) after the generation prompt, so the model must complete a call (of that
function): those tokens are context, not trained actions, and `content` of an unparsable reply begins with
them. `stream: true` answers with server-sent events (`chat.completion.chunk`s: the role, the content in one
delta per token whose text is complete, each tool call whole, the finish reason with the log-probs and
`token_ids`, the usage with `stream_options.include_usage`, `[DONE]`), sent once the completion is sampled
(the rollout engines return whole completions): joined, they are the non-streaming response.

Delta tokenisation: the first call's prompt is the chat template applied to the messages, tokenised.
For a later call the messages are re-rendered as text; when the session's text so far (the rendered
prompts and the completions decoded with their special tokens; or the same with the last completion's stop
token left out, as `message.content` shows it, like vLLM) is a prefix of it, the prompt is the
session's tokens as fed and sampled plus only the new tail tokenised, so the model's output is never
re-tokenised (OpenRLHF's example re-tokenises the whole history and asserts a token prefix, which BPE
merges break). An assistant turn with `tool_calls` that this session served, echoed back with the same
ids, calls and content, is rendered from the text the model sampled (the JSON's spacing and key order as
sampled), so a tool episode continues on the sampled tokens. When the text is not a prefix (the agent
changed the history, or the template renders an assistant turn differently from what was sampled), the
call is still served from the re-rendering, but the session is marked divergent and the episode fails at
the end ("counted, never trained on silently").
Stitching: sample = last prompt + last completion; each call's completion is an action range, with
the log-probs it was sampled with; everything else (template tokens, tool results, user turns) is
context. The budget is `--data.max_len` over the session (each call may generate what is left, capped by
`--rollout.max_new_tokens` when set).
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotations at runtime

import asyncio
import hmac
import json
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from uuid import uuid4

from posttrain.agents.agent_api import AgentExecutorBase, encode_text
from posttrain.agents.episode import AgentSamplingParams, shown_tokens
from posttrain.agents.openai_chat import (
    RequestError,
    chat_messages,
    chat_tools,
    completion,
    openai_tool_calls,
    request_number,
    stream_events,
    stream_options,
)
from posttrain.agents.tool_calls import ToolCallError, render_tool_prompt, tool_call_format
from posttrain.config.serving import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT
from posttrain.rewards.server import (
    BodyTimeout,
    BodyTooLarge,
    count_disconnects,
    decode_json,
    read_body,
    server_config,
)


@dataclass
class Session:
    """One episode's view of the server (module docstring)."""
    session_id: str
    api_key: str
    base_url: str
    model: str
    engine: object = field(repr=False)
    loop: asyncio.AbstractEventLoop = field(repr=False)
    defaults: AgentSamplingParams = field(repr=False)
    max_length: int = 0
    traces: list[dict] = field(default_factory=list)
    # the session's tokens so far (last prompt + completion, as fed and sampled)
    buffer: list[int] | None = None
    text: str = ""  # their text: the rendered prompt pieces + the completions decoded with special tokens
    shown: str | None = None  # the same, the last completion without its stop token (as `content` shows it)
    divergence: str | None = None
    engine_error: BaseException | None = None
    tool_turns: int = 0  # the calls that offered tools
    tool_call_errors: int = 0  # their replies with a malformed tool call
    # the served tool-call turns: (the response's message, the text the model sampled, any prefill included)
    sampled_turns: list[tuple[dict, str]] = field(default_factory=list)

    def openai_client(self):
        """An `openai.AsyncOpenAI` for this session (needs `pip install openai`)."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key)


_LIMIT_WHY = ("the agent server's limit, OpenAIServerAgentExecutor.max_request_bytes, the same as serve-rm's "
              "--max_request_bytes default); send a shorter conversation")


_TIMEOUT_FLAG = "OpenAIServerAgentExecutor.read_timeout"


class OpenAIServerAgentExecutor(AgentExecutorBase):
    """Base of an OpenAI-API agent (module docstring). One server per executor, shared by its episodes."""

    model_name = "policy"
    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES  # larger bodies get 413, as serve-rm's --max_request_bytes
    # seconds for a request's headers, then for its body (408), as serve-rm's
    read_timeout = DEFAULT_READ_TIMEOUT

    def __init__(self) -> None:
        self.sessions: dict[str, Session] = {}
        self.divergent = 0  # sessions whose history re-rendered differently (counted over the run)
        self._server = None
        self._lock = threading.Lock()
        self.host, self.port, self.tokenizer = "127.0.0.1", None, None
        self.tool_format = None  # the tokenizer's tool-call format, found on the first request with tools

    # ---- what a user writes ---------------------------------------------------------------------
    async def run_agent(self, prompt: str, label, session: Session) -> dict:
        raise NotImplementedError("write `async def run_agent(self, prompt, label, session)` in your "
                                  "AgentExecutor")

    # ---- one episode ------------------------------------------------------------------------------
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        if images:
            raise ValueError("images: vision-language agents are not available in this version")
        self._ensure_server(hf_tokenizer)
        key = secrets.token_urlsafe(24)
        session = Session(uuid4().hex, key, f"http://{self.host}:{self.port}/v1", self.model_name, llm_engine,
                          asyncio.get_running_loop(), sampling_params, max_length)
        self.sessions[key] = session
        try:
            try:
                result = await self.run_agent(prompt, label, session) or {}
            except Exception:
                # the engine failed under the agent: not the agent's fault
                if session.engine_error is not None:
                    raise session.engine_error
                raise
            # the agent caught the server's 500: still the engine's fault
            if session.engine_error is not None:
                raise session.engine_error
            if not isinstance(result, dict):
                raise ValueError(f"run_agent must return a dict (reward, scores, extra_logs), got "
                                 f"{type(result).__name__}")
            return self._stitch(session, prompt, label, result)
        finally:
            self.sessions.pop(key, None)

    def _stitch(self, session: Session, prompt, label, result: dict) -> dict:
        if session.divergence:
            raise ValueError(f"session diverged: {session.divergence}; not trained")
        if not session.traces:
            raise ValueError("the agent made no chat completion call in its session")
        last = session.traces[-1]
        obs = last["prompt_ids"] + last["completion_ids"]
        logprobs = [0.0] * len(obs)
        ranges = []
        for t in session.traces:
            start = len(t["prompt_ids"])
            ranges.append((start, start + len(t["completion_ids"])))
            logprobs[start: start + len(t["logprobs"])] = t["logprobs"]
        return {"prompt": prompt, "label": label, "observation_tokens": obs, "action_ranges": ranges,
                "rollout_log_probs": logprobs, "truncated": last["finish_reason"] == "length",
                "prompt_length": ranges[0][0], "reward": result.get("reward"), "scores": result.get("scores"),
                "extra_logs": result.get("extra_logs") or {}, "turns": len(session.traces),
                "env_tokens": len(obs) - ranges[0][0] - sum(e - s for s, e in ranges), "step_time": 0.0,
                **({"tool_call_errors": session.tool_call_errors} if session.tool_turns else {})}

    # ---- the server -------------------------------------------------------------------------------
    def _ensure_server(self, tokenizer) -> None:
        with self._lock:
            if self._server is not None:
                return
            import socket

            import uvicorn

            self.tokenizer = tokenizer
            with socket.socket() as s:
                s.bind((self.host, 0))
                self.port = s.getsockname()[1]
            config = server_config(self._app(), self.host, self.port, self.read_timeout, _TIMEOUT_FLAG,
                                   lifespan="off")
            self._server = uvicorn.Server(config)
            threading.Thread(target=self._server.run, name="posttrain-agent-server", daemon=True).start()
            deadline = time.monotonic() + 30
            while not self._server.started:
                if time.monotonic() > deadline:
                    raise RuntimeError("the agent's OpenAI-compatible server did not start within 30 s")
                time.sleep(0.01)

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server = None

    def _session(self, request) -> Session:
        given = request.headers.get("authorization", "")
        token = given[len("Bearer "):] if given.startswith("Bearer ") else ""
        for key, session in list(self.sessions.items()):
            if token and hmac.compare_digest(token.encode(), key.encode()):
                return session
        raise RequestError(401, "missing Authorization header" if not given else
                           "unknown bearer token: use the api_key of a live session")

    def _render_text(self, messages: list[dict], generation_prompt: bool, tools=None) -> str:
        if generation_prompt:
            return render_tool_prompt(self.tokenizer, messages, tools)
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)

    def _app(self):
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse

        app = FastAPI(title="posttrain agent server")
        count_disconnects(app)
        executor = self

        async def guarded(request: Request, handler):
            try:
                session = executor._session(request)
                body = None
                if request.method == "POST":
                    try:
                        body = decode_json(await read_body(request, executor.max_request_bytes, _LIMIT_WHY,
                                                           executor.read_timeout, _TIMEOUT_FLAG))
                    except BodyTooLarge as e:
                        raise RequestError(413, str(e)) from None
                    except BodyTimeout as e:
                        raise RequestError(408, str(e)) from None
                    except ValueError as e:
                        raise RequestError(400, f"the body must be a JSON object: {e}") from None
                    if not isinstance(body, dict):
                        raise RequestError(400, "the body must be a JSON object")
                return await handler(session, body)
            except RequestError as e:
                return JSONResponse({"error": {"message": e.detail, "type": "invalid_request_error"}},
                                    status_code=e.status,
                                    headers={"connection": "close"} if e.status == 408 else None)

        @app.get("/health")
        async def health(request: Request):
            return await guarded(request, lambda s, b: _done({"status": "ok", "model": s.model}))

        @app.get("/v1/models")
        async def models(request: Request):
            return await guarded(request, lambda s, b: _done(
                {"object": "list", "data": [{"id": s.model, "object": "model", "owned_by": "posttrain"}]}))

        @app.post("/tokenize")
        async def tokenize(request: Request):
            async def handle(session, body):
                text = executor._render_text(chat_messages(body), bool(body.get("add_generation_prompt")),
                                             chat_tools(body)[0])
                ids = encode_text(executor.tokenizer, text)
                return {"tokens": ids, "count": len(ids), "max_model_len": session.max_length}
            return await guarded(request, handle)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await guarded(request, executor._complete)

        return app

    async def _complete(self, session: Session, body: dict):
        messages = chat_messages(body)
        tools, choice, forced = chat_tools(body)
        stream, include_usage = stream_options(body)
        if request_number(body, "n", 1, 1, 1, integer=True) != 1:
            raise RequestError(400, "'n' must be 1")
        d = session.defaults
        temperature = request_number(body, "temperature", d.temperature, 0.0, 100.0)
        top_p = request_number(body, "top_p", d.top_p, 1e-9, 1.0)
        max_tokens = request_number(body, "max_completion_tokens", None, 1, 10**9, integer=True)
        max_tokens = request_number(body, "max_tokens", max_tokens, 1, 10**9, integer=True)
        fmt = self._tool_format() if tools and choice != "none" else None
        prefill = fmt.prefill(forced) if fmt is not None and choice in ("required", "function") else ""
        try:
            text = self._render_text(_as_sampled(session, messages), True, tools) + prefill
        except Exception as e:  # the chat template refused these messages (roles, alternation, ...)
            raise RequestError(400, f"the chat template cannot render these messages: {type(e).__name__}: "
                                    f"{e}") from None
        prompt_ids = self._prompt_ids(session, text)
        remaining = session.max_length - len(prompt_ids)
        if remaining <= 0:
            raise RequestError(413, f"the conversation has {len(prompt_ids)} tokens; the episode's budget "
                                    f"(--data.max_len {session.max_length}) is spent")
        caps = [remaining] + [c for c in (max_tokens, d.max_tokens) if c]
        params = replace(d, temperature=temperature, top_p=top_p, max_tokens=min(caps),
                         skip_special_tokens=True)
        future = asyncio.run_coroutine_threadsafe(session.engine.generate(prompt_ids, params), session.loop)
        try:
            out = (await asyncio.wrap_future(future)).outputs[0]
        except Exception as e:
            session.engine_error = e
            raise RequestError(500, f"the rollout engine failed: {type(e).__name__}") from None
        ids = list(out.token_ids)
        lps = [entry[t].logprob for entry, t in zip(out.logprobs, ids)]
        sampled = self.tokenizer.decode(shown_tokens(ids, out.finish_reason), skip_special_tokens=False)
        session.buffer = prompt_ids + ids
        session.text = text + self.tokenizer.decode(ids, skip_special_tokens=False)  # the text of `buffer`
        session.shown = text + sampled
        session.tool_turns += tools is not None
        message, finish, error = self._message(session, fmt, prefill, out, sampled)
        session.traces.append({"prompt_ids": prompt_ids, "completion_ids": ids, "logprobs": lps,
                               "finish_reason": out.finish_reason})
        content = None
        if body.get("logprobs"):
            content = [{"token": self.tokenizer.decode([t]), "token_id": t, "logprob": lp, "bytes": None,
                        "top_logprobs": []} for t, lp in zip(ids, lps)]
        response = completion(session.model, message, finish, content,
                              {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                               "total_tokens": len(prompt_ids) + len(ids)},
                              {"prompt_token_ids": prompt_ids, "completion_token_ids": ids}, error)
        if not stream:
            return response
        from fastapi.responses import StreamingResponse

        pieces = self._pieces(ids, message["content"], prefill)
        return StreamingResponse(stream_events(response, pieces, include_usage),
                                 media_type="text/event-stream")

    def _tool_format(self):
        if self.tool_format is None:
            try:
                self.tool_format = tool_call_format(self.tokenizer)
            except ValueError as e:
                raise RequestError(400, f"'tools': {e}") from None
        return self.tool_format

    def _prompt_ids(self, session: Session, text: str) -> list[int]:
        """The prompt's tokens: the session's as fed and sampled + the new tail (module docstring)."""
        prompt_ids = encode_text(self.tokenizer, text)
        if session.buffer is not None:
            # the history as sampled, then only the new turns tokenised; an echoed answer lacks a stop token
            # that is not special (`content` leaves it out), the tokens keep it as sampled
            seen = next((t for t in (session.text, session.shown) if t is not None and text.startswith(t)),
                        None)
            if seen is not None:
                prompt_ids = session.buffer + encode_text(self.tokenizer, text[len(seen):])
            elif session.divergence is None:
                session.divergence = (f"call {len(session.traces) + 1}: the re-rendered history differs from "
                                      f"the {len(session.buffer)} recorded tokens")
                self.divergent += 1
        return prompt_ids

    def _message(self, session: Session, fmt, prefill: str, out, sampled: str) -> tuple:
        """(the response's message, finish_reason, the malformed call's error or None): the turn's tool
        calls parsed when `fmt` (tool_choice not "none"); a malformed call is content, counted."""
        content = prefill + out.text
        if fmt is None:
            return {"role": "assistant", "content": content}, out.finish_reason, None
        try:
            served = sum(len(m["tool_calls"]) for m, _ in session.sampled_turns)  # numbers the ids
            rest, calls = fmt.parse(prefill + sampled, served)
        except ToolCallError as e:
            session.tool_call_errors += 1
            return {"role": "assistant", "content": content}, out.finish_reason, str(e)
        if not calls:
            return {"role": "assistant", "content": content}, out.finish_reason, None
        message = {"role": "assistant", "content": rest or None,
                   "tool_calls": openai_tool_calls(calls)}
        session.sampled_turns.append((message, prefill + sampled))
        return message, "tool_calls", None

    def _pieces(self, ids: list[int], content: str | None, lead: str) -> list[str]:
        """`content` cut where each token's text is complete, after `lead` (the prefill) when it starts
        with it: the streamed deltas; joined, they are `content`. Incremental, as vLLM detokenises: each
        new token is decoded after the previous piece's tokens (for tokenizers whose text depends on them)."""
        if not content:
            return []
        skip = len(lead) if lead and content.startswith(lead) else 0
        pieces, done, prefix, read = [content[:skip]] if skip else [], skip, 0, 0
        for i in range(1, len(ids) + 1):
            before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
            now = self.tokenizer.decode(ids[prefix:i], skip_special_tokens=True)
            if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
                continue  # no new text yet (a special token, or a character's bytes not all there)
            if not content.startswith(now[len(before):], done):
                break  # the content is not the tokens' text from here on (text outside tool calls)
            pieces.append(now[len(before):])
            done, prefix, read = done + len(pieces[-1]), read, i
        return pieces + ([content[done:]] if done < len(content) else [])


def _as_sampled(session: Session, messages: list[dict]) -> list[dict]:
    """`messages` with each echoed assistant tool-call turn this session served (the same ids, calls and
    content) rendered from the text the model sampled, so its tokens stay the sampled ones."""
    out = []
    for m in messages:
        match = next((raw for served, raw in session.sampled_turns if m.get("role") == "assistant"
                      and _same_turn(m, served)), None)
        out.append(m if match is None else {"role": "assistant", "content": match})
    return out


def _same_turn(m: dict, served: dict) -> bool:
    calls = m.get("tool_calls") or []
    if (m.get("content") or None) != served["content"] or len(calls) != len(served["tool_calls"]):
        return False
    for c, s in zip(calls, served["tool_calls"]):
        args = c["function"]["arguments"]
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            return False
        if (c["id"], c["function"]["name"], args) != (s["id"], s["function"]["name"],
                                                      json.loads(s["function"]["arguments"])):
            return False
    return True


async def _done(value):
    return value
