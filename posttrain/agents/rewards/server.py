"""HTTP reward server app (what `posttrain serve-rm` runs): any RewardSource behind FastAPI.

POST /get_reward  body `{"query": [B str], "prompts": [B str] (optional, default B ""), "labels": [B]
                  (optional)}` → `{"rewards", "scores", "extra_logs", "skipped", "skip_reasons"}`.
GET  /health      → `{"status": "ok", "source": ...}`.
With a token every request (health included) needs `Authorization: Bearer <token>`, else 401.
Bad bodies → 400 with the problem; a reward source error → 500 with its message. Requests are
scored one at a time (the source need not be thread-safe).
"""

# no `from __future__ import annotations`: FastAPI must see the real `Request` class in the
# endpoint signatures, which are defined inside build_app.
import hmac
import threading


def _check_body(body) -> tuple[list[str], list[str], list | None]:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object with a 'query' list, got {type(body).__name__}")
    queries = body.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise ValueError("'query' must be a list of strings (prompt + response texts)")
    n = len(queries)
    prompts = body.get("prompts")
    if prompts is None:
        prompts = [""] * n
    elif not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts) or len(prompts) != n:
        raise ValueError(f"'prompts' must be a list of {n} strings (one per query)")
    labels = body.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != n):
        raise ValueError(f"'labels' must be a list of {n} entries (one per query) or null")
    return queries, prompts, labels


def build_app(source, token: str | None = None):
    """FastAPI app serving `source` (a RewardSource); `token` enables bearer-token checks."""
    from fastapi import FastAPI, Request
    from fastapi.concurrency import run_in_threadpool
    from fastapi.responses import JSONResponse

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
            return source.score(queries, prompts, labels).to_json()

    @app.get("/health")
    async def health(request: Request):
        return denied(request) or {"status": "ok", "source": repr(source)}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        refused = denied(request)
        if refused:
            return refused
        try:
            body = await request.json()
        except ValueError as err:
            return JSONResponse({"detail": f"body is not valid JSON ({err})"}, status_code=400)
        try:
            queries, prompts, labels = _check_body(body)
        except ValueError as err:
            return JSONResponse({"detail": str(err)}, status_code=400)
        try:
            return await run_in_threadpool(run, queries, prompts, labels)
        except Exception as err:  # the client sees the cause
            return JSONResponse({"detail": f"{type(err).__name__}: {err}"}, status_code=500)

    return app
