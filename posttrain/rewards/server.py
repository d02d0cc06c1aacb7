"""HTTP reward server app (what `posttrain serve-rm` runs): any RewardSource behind FastAPI.

POST /get_reward  body `{"query": [B str], "prompts": [B str] (optional, default B ""), "labels": [B]
                  (optional)}` → `{"rewards", "scores", "extra_logs", "skipped", "skip_reasons",
                  "truncated": [B bool] (query cut to the model's length limit), "num_truncated": int}`.
GET  /health      → `{"status": "ok" | "degraded" | "unavailable", "source", "in_flight", "max_concurrent",
                  "stuck_calls", "max_stuck"}`: degraded while timed-out reward_func calls still run,
                  unavailable (HTTP 503) once `max_stuck` of them do and every call is refused.
With a token every request (health included) needs `Authorization: Bearer <token>`, else 401.
Any problem with the body (not JSON, wrong shape, no queries, a string that is not valid Unicode such
as a lone surrogate `"\\ud800"`) → 400 naming it; a body over
`max_request_bytes` or more than `max_queries` queries → 413 naming the limit and its flag; a body not
complete within `read_timeout` seconds → 408 and the connection closed; a reward source error → 500 with
its message. Requests are scored one at a time (the source need not be thread-safe); more than
`max_concurrent` requests scored or waiting → 503 at once, and so does a reward_func refusing new calls
while too many earlier ones are stuck (RewardBusy).

`server_config` adds a header deadline: headers not complete within `read_timeout` seconds of the
connection opening (of their first byte on a kept-alive connection) → 408 and the connection closed.
A client that closes its connection before sending the whole body is logged in one counted line.
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` class in the
# endpoint signatures, which are defined inside build_app.
import asyncio
import hmac
import json
from collections import Counter

from posttrain.config.serving import DEFAULT_MAX_CONCURRENT, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_READ_TIMEOUT
from posttrain.rewards.python_func import RewardBusy
from posttrain.utils.log import info

TRUNCATED_LOG = "reward_model/truncated"  # RewardModelSource's per-query extra_logs entry (1.0 = cut)
_DRAIN_BYTES = 1 << 30  # an over-limit body is read (and dropped) up to this much, so the client sees the 413
# connections this process dropped: "disconnected" mid-body, "timed out" reading a request
DROPPED = Counter()


class BodyTooLarge(Exception):
    """The request exceeds a size limit; the message names the limit and the flag that sets it."""


class BodyTimeout(Exception):
    """The request body did not arrive within the read timeout (answer 408 and close the connection)."""


def dropped(kind: str, what: str) -> None:
    """Count a dropped connection of `kind` in DROPPED and log it in one line."""
    DROPPED[kind] += 1
    info(f"{what} ({DROPPED[kind]} {kind} so far)")


def check_text(values, what: str) -> None:
    """ValueError when a string of `values` is not valid Unicode text: JSON lets `\\ud800` (a lone UTF-16
    surrogate) through, which no tokenizer or UTF-8 encoder takes."""
    for i, value in enumerate(values):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"{what}[{i}] holds a lone UTF-16 surrogate ({value[err.start]!r} at "
                                 f"character {err.start}), which is not valid Unicode text; send valid UTF-8 "
                                 f"text") from None


def _check_body(body) -> tuple[list[str], list[str], list | None]:
    """(queries, prompts, labels) of a decoded /get_reward body; ValueError naming the problem otherwise."""
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object with a 'query' list, got {type(body).__name__}")
    queries = body.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("'query' must be a list of strings (prompt + response texts)")
    if not queries:
        raise ValueError("'query' is an empty list; send at least one prompt + response text")
    empty = [i for i, q in enumerate(queries) if not q]
    if empty:
        raise ValueError(f"'query'[{empty[0]}] is an empty string; every query needs the prompt + response "
                         f"text")
    n = len(queries)
    prompts = body.get("prompts")
    if prompts is None:
        prompts = [""] * n
    elif not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or len(prompts) != n:
        raise ValueError(f"'prompts' must be a list of {n} strings (one per query)")
    labels = body.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != n):
        raise ValueError(f"'labels' must be a list of {n} entries (one per query) or null")
    check_text(queries, "'query'")
    check_text(prompts, "'prompts'")
    check_text(labels or [], "'labels'")
    return queries, prompts, labels


def decode_json(raw: bytes):
    """The JSON value of a request body; ValueError saying why it is not valid JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # bad UTF-8 / syntax, or nested too deep
        raise ValueError(f"body is not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None


_SERVE_RM_LIMIT = ("the server's --max_request_bytes); send fewer or shorter queries per request, or restart "
                   "serve-rm with a larger --max_request_bytes")


async def read_body(request, limit: int, why: str = _SERVE_RM_LIMIT, timeout: float = DEFAULT_READ_TIMEOUT,
                    flag: str = "--read_timeout") -> bytes:
    """The request body, at most `limit` bytes, complete within `timeout` seconds; BodyTooLarge (after
    dropping the rest, up to _DRAIN_BYTES, so the client reads the answer) when it is longer, BodyTimeout
    (naming `flag`) when it is late. `why`: the limit's origin and the fix, after "request body larger
    than N bytes (". A client gone mid-body raises starlette's ClientDisconnect (see `count_disconnects`).
    Also used by the agents' OpenAI-compatible server."""
    too_large = BodyTooLarge(f"request body larger than {limit} bytes ({why}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + _DRAIN_BYTES:
        raise too_large
    chunks, size = [], 0

    async def collect():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + _DRAIN_BYTES:
                break
            if size <= limit:
                chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        dropped("timed out", f"{_client(request)}: request body not complete within {timeout:g} s ({flag}); "
                "answered 408, connection closed")
        raise BodyTimeout(f"request body not complete within {timeout:g} s (the server's {flag}); send the "
                          "whole body at once") from None
    if size > limit:
        raise too_large
    return b"".join(chunks)


def _client(request) -> str:
    client = request.client
    return f"client {client.host}:{client.port}" if client else "a client"


def count_disconnects(app) -> None:
    """Answer starlette's ClientDisconnect (a client gone before sending its whole body) in `app` with one
    counted log line instead of a traceback; the answer itself goes nowhere."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response

    async def gone(request, exc):
        dropped("disconnected", f"{_client(request)} closed its connection before sending the whole request "
                f"body ({request.method} {request.url.path})")
        return Response(status_code=400)

    app.add_exception_handler(ClientDisconnect, gone)


def server_config(app, host: str, port: int, read_timeout: float = DEFAULT_READ_TIMEOUT,
                  flag: str = "--read_timeout", **kwargs):
    """uvicorn.Config serving `app` over h11 with a read deadline: request headers not complete within
    `read_timeout` s of the connection (of their first byte on a kept-alive connection) get 408 and the
    connection is closed (without an answer when nothing was sent); so is, after as long, a body the app
    answered without reading (a 401) and the client has not finished. Each is counted in DROPPED and
    logged in one line naming `flag`. A body the app reads has its own deadline (`read_body`). kwargs
    go to uvicorn.Config."""
    import h11
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline = None

        def _owed(self) -> bool:
            """The client owes bytes no app deadline covers: the headers of its first request or of one it
            has begun (an idle kept-alive connection is uvicorn's to close), or a body the app answered
            without reading."""
            state, begun = self.conn.their_state, bool(self.conn.trailing_data[0])
            return not self.transport.is_closing() and (
                (state is h11.IDLE and (self.cycle is None or begun))
                or (state is h11.SEND_BODY and self.cycle is not None and self.cycle.response_complete))

        def _update(self):
            if not self._owed():
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
            elif self._deadline is None:
                self._deadline = self.loop.call_later(read_timeout, self._expired)

        def _expired(self):
            self._deadline = None
            if not self._owed():
                return
            host, port = self.client or ("?", 0)
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: "
                                     b"close\r\n\r\n")
            dropped("timed out", f"client {host}:{port}: request not complete within {read_timeout:g} s "
                                 f"({flag}); "
                    "connection closed")
            self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._update()

        def data_received(self, data):
            super().data_received(data)
            self._update()

        def on_response_complete(self):
            super().on_response_complete()
            self._update()

        def connection_lost(self, exc):
            if self._deadline is not None:
                self._deadline.cancel()
            super().connection_lost(exc)

    if not read_timeout > 0:
        raise ValueError(f"{flag}={read_timeout}: must be > 0 seconds")
    return uvicorn.Config(app, host=host, port=port, http=HeaderDeadline,
                          **{"log_level": "warning", **kwargs})


def _check_count(n: int, max_queries: int | None) -> None:
    if max_queries is not None and n > max_queries:
        raise BodyTooLarge(f"{n} queries in one request; the server takes at most {max_queries} "
                           "(--max_queries); split the batch or restart serve-rm with a larger --max_queries")


def response_json(result, n: int) -> dict:
    """A RewardResult for n queries as the /get_reward answer: its JSON plus "truncated" (one bool per
    query, from the source's TRUNCATED_LOG; all False for sources that never cut) and "num_truncated"."""
    out = result.to_json()
    flags = out["extra_logs"].get(TRUNCATED_LOG)
    truncated = [bool(v) for v in flags] if isinstance(flags, list) and len(flags) == n else [False] * n
    out["truncated"], out["num_truncated"] = truncated, sum(truncated)
    return out


def build_app(source, token: str | None = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              max_queries: int | None = None, max_concurrent: int = DEFAULT_MAX_CONCURRENT,
              read_timeout: float = DEFAULT_READ_TIMEOUT):
    """FastAPI app serving `source` (a RewardSource); `token` enables bearer-token checks; bodies over
    `max_request_bytes` or with more than `max_queries` queries (None: no limit) get HTTP 413, a body
    not complete within `read_timeout` s 408; beyond `max_concurrent` requests scored or waiting, 503."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    if max_request_bytes < 1 or max_concurrent < 1 or (max_queries is not None and max_queries < 1):
        raise ValueError(f"max_request_bytes={max_request_bytes}, max_concurrent={max_concurrent} and "
                         f"max_queries={max_queries} must be >= 1")
    app = FastAPI(title="posttrain reward server")
    count_disconnects(app)
    turn = asyncio.Lock()  # one source call at a time, waiting in the event loop (no thread per waiter)
    in_flight = 0
    expected = f"Bearer {token}" if token else None

    def denied(request: Request):
        if expected is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), expected.encode()):
            return None
        why = "missing Authorization header" if not given else "wrong bearer token"
        return JSONResponse({"detail": f"{why}; send `Authorization: Bearer <token>` with the server's "
                                       f"--token"},
                            status_code=401)

    def run(queries, prompts, labels):
        return response_json(source.score(queries, prompts, labels), len(queries))

    @app.get("/health")
    async def health(request: Request):
        refused = denied(request)
        if refused:
            return refused
        stuck, cap = getattr(source, "stuck_calls", 0), getattr(source, "max_stuck", None)
        status = "ok" if not stuck else "unavailable" if cap is not None and stuck >= cap else "degraded"
        return JSONResponse({"status": status, "source": repr(source), "in_flight": in_flight,
                             "max_concurrent": max_concurrent, "stuck_calls": stuck, "max_stuck": cap},
                            status_code=503 if status == "unavailable" else 200)

    @app.post("/get_reward")
    async def get_reward(request: Request):
        refused = denied(request)
        if refused:
            return refused
        nonlocal in_flight
        try:
            body = await read_body(request, max_request_bytes, timeout=read_timeout)
            queries, prompts, labels = _check_body(decode_json(body))
            _check_count(len(queries), max_queries)
        except BodyTooLarge as err:
            return JSONResponse({"detail": str(err)}, status_code=413)
        except BodyTimeout as err:
            return JSONResponse({"detail": str(err)}, status_code=408, headers={"connection": "close"})
        except ValueError as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        if in_flight >= max_concurrent:
            return JSONResponse({"detail": f"server busy: {in_flight} requests are being scored or waiting "
                                 f"(--max_concurrent {max_concurrent}); retry later, or restart serve-rm "
                                 f"with a larger --max_concurrent"}, status_code=503)
        in_flight += 1
        try:
            async with turn:
                return await run_in_threadpool(run, queries, prompts, labels)
        except RewardBusy as err:  # earlier calls are stuck: nothing was started
            return JSONResponse({"detail": f"{type(err).__name__}: {err}"}, status_code=503)
        except Exception as err:  # the client sees the cause
            return JSONResponse({"detail": f"{type(err).__name__}: {err}"}, status_code=500)
        finally:
            in_flight -= 1

    return app
