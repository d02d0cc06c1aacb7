"""HTTP reward server app (what `posttrain serve-rm` runs): any RewardSource behind FastAPI.

POST /get_reward  body `{"query": [B str], "prompts": [B str] (optional, default B ""), "labels": [B]
                  (optional)}` → `{"rewards", "scores", "extra_logs", "skipped", "skip_reasons",
                  "truncated": [B bool] (query cut to the model's length limit), "num_truncated": int}`.
GET  /health      → `{"status": "ok", "source": ...}`.
With a token every request (health included) needs `Authorization: Bearer <token>`, else 401.
Any problem with the body (not JSON, wrong shape, no queries, a string that is not valid Unicode such
as a lone surrogate `"\\ud800"`) → 400 naming it; a body over
`max_request_bytes` or more than `max_queries` queries → 413 naming the limit and its flag; a reward
source error → 500 with its message. Requests are scored one at a time (the source need not be
thread-safe).
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` class in the
# endpoint signatures, which are defined inside build_app.
import hmac
import json
import threading

from posttrain.config.serving import DEFAULT_MAX_REQUEST_BYTES

TRUNCATED_LOG = "reward_model/truncated"  # RewardModelSource's per-query extra_logs entry (1.0 = cut)
_DRAIN_BYTES = 1 << 30  # an over-limit body is read (and dropped) up to this much, so the client sees the 413


class BodyTooLarge(Exception):
    """The request exceeds a size limit; the message names the limit and the flag that sets it."""


def check_text(values, what: str) -> None:
    """ValueError when a string of `values` is not valid Unicode text: JSON lets `\\ud800` (a lone UTF-16
    surrogate) through, which no tokenizer or UTF-8 encoder takes."""
    for i, value in enumerate(values):
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise ValueError(f"{what}[{i}] holds a lone UTF-16 surrogate ({value[err.start]!r} at character "
                                 f"{err.start}), which is not valid Unicode text; send valid UTF-8 text") from None


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
        raise ValueError(f"'query'[{empty[0]}] is an empty string; every query needs the prompt + response text")
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


async def read_body(request, limit: int, why: str = _SERVE_RM_LIMIT) -> bytes:
    """The request body, at most `limit` bytes; BodyTooLarge (after dropping the rest, up to
    _DRAIN_BYTES, so the client reads the answer) when it is longer. `why`: the limit's origin and the
    fix, after "request body larger than N bytes (". Also used by the agents' OpenAI-compatible server."""
    too_large = BodyTooLarge(f"request body larger than {limit} bytes ({why}")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + _DRAIN_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit + _DRAIN_BYTES:
            break
        if size <= limit:
            chunks.append(chunk)
    if size > limit:
        raise too_large
    return b"".join(chunks)


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
              max_queries: int | None = None):
    """FastAPI app serving `source` (a RewardSource); `token` enables bearer-token checks; bodies over
    `max_request_bytes` or with more than `max_queries` queries (None: no limit) get HTTP 413."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

    if max_request_bytes < 1 or (max_queries is not None and max_queries < 1):
        raise ValueError(f"max_request_bytes={max_request_bytes} and max_queries={max_queries} must be >= 1")
    app = FastAPI(title="posttrain reward server")
    lock = threading.Lock()
    expected = f"Bearer {token}" if token else None

    def denied(request: Request):
        if expected is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), expected.encode()):
            return None
        why = "missing Authorization header" if not given else "wrong bearer token"
        return JSONResponse({"detail": f"{why}; send `Authorization: Bearer <token>` with the server's --token"},
                            status_code=401)

    def run(queries, prompts, labels):
        with lock:
            return response_json(source.score(queries, prompts, labels), len(queries))

    @app.get("/health")
    async def health(request: Request):
        return denied(request) or {"status": "ok", "source": repr(source)}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        refused = denied(request)
        if refused:
            return refused
        try:
            queries, prompts, labels = _check_body(decode_json(await read_body(request, max_request_bytes)))
            _check_count(len(queries), max_queries)
        except BodyTooLarge as err:
            return JSONResponse({"detail": str(err)}, status_code=413)
        except ValueError as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        try:
            return await run_in_threadpool(run, queries, prompts, labels)
        except Exception as err:  # the client sees the cause
            return JSONResponse({"detail": f"{type(err).__name__}: {err}"}, status_code=500)

    return app
