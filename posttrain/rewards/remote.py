"""A reward server over HTTP (`--reward.remote_url http://host:port/get_reward`), e.g. `posttrain serve-rm`.

Request (OpenRLHF's serve_rm shape): POST JSON `{"query": B prompt+response texts, "prompts": B
prompts, "labels": B labels}`. Response: `{"rewards": B numbers, "scores": optional,
"extra_logs": optional, "skipped": optional}`, validated like a reward_func's return value.

Several servers (`--reward.remote_url http://a/get_reward,http://b/get_reward`): `ShardedRemoteReward`
sends each server a contiguous share of the batch, all at once, and joins the answers in order.
"""
from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

from posttrain.config.serving import TOKEN_ENV
from posttrain.rewards.result import (
    RewardError,
    RewardResult,
    check_batch,
    concat_results,
    contiguous_chunks,
    parse_output,
)

_HINT = "start it with `posttrain serve-rm ...` or fix --reward.remote_url"


def _cause(err: Exception) -> str:
    """Short cause of a requests exception: 'Connection refused', 'read timed out', ..."""
    text = str(err)
    m = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if m:
        return m.group(1).strip()
    if "timed out" in text.lower():
        return f"timed out: {type(err).__name__}"
    return f"{type(err).__name__}: {text[:200]}"


def _detail(response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and "detail" in body:
            return str(body["detail"])[:500]
    except ValueError:
        pass
    return response.text[:500]


class RemoteReward:
    """RewardSource POSTing each batch to a reward server, in one request.

    retries: attempts in total (>= 1); connection errors, timeouts and HTTP 5xx are retried after
    backoff * 2**(attempt-1) seconds; HTTP 4xx (bad request, 401 bad token) and invalid responses are
    not. token (or env POSTTRAIN_RM_TOKEN) is sent as `Authorization: Bearer <token>`. kwargs of
    `score` (e.g. token-id tensors) are not sent."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30, retries: int = 3,
                 backoff: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--reward.remote_url={url!r}: expected an http(s):// URL")
        if retries < 1:
            raise ValueError(f"retries={retries}: must be >= 1 (attempts in total)")
        if timeout <= 0 or backoff < 0:
            raise ValueError(f"timeout={timeout} must be > 0 and backoff={backoff} >= 0")
        import requests

        self.url = url
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.session = requests.Session()
        self.session.trust_env = False  # no proxies from the environment for the reward server
        self.origin = f"reward server {url}"
        self.num_calls = 0

    def _post(self, payload: dict):
        import requests

        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            body = json.dumps(payload)
        except TypeError as err:
            raise TypeError(f"{self.origin}: labels must be JSON-serialisable ({err})") from None
        last = ""
        for attempt in range(1, self.retries + 1):
            if attempt > 1:
                time.sleep(self.backoff * 2 ** (attempt - 2))
            try:
                response = self.session.post(self.url, data=body, headers=headers, timeout=self.timeout)
            except requests.ReadTimeout:  # connected, but no answer in time: slow, not unreachable
                last = "timeout"
                continue
            except (requests.ConnectionError, requests.Timeout) as err:
                last = _cause(err)
                continue
            if response.status_code >= 500:
                last = f"HTTP {response.status_code}: {_detail(response)}"
                continue
            if response.status_code == 401:
                raise RewardError(f"{self.origin} rejected the request (HTTP 401: {_detail(response)}); set "
                                  f"{TOKEN_ENV} to the token the server was started with (--token)")
            if response.status_code >= 400:
                raise RewardError(f"{self.origin} rejected the request (HTTP {response.status_code}: "
                                  f"{_detail(response)})")
            try:
                return response.json()
            except ValueError:
                raise RewardError(f"{self.origin} answered HTTP {response.status_code} with a body that is "
                                  f"not JSON: {response.text[:200]!r}") from None
        if last == "timeout":
            raise RewardError(f"{self.origin} timed out after {self.timeout:g} s (--reward.timeout) on each "
                              f"of {self.retries} attempts: it accepted the connection but did not answer in "
                              f"time; raise --reward.timeout, send smaller batches or speed the server up")
        if last.startswith("HTTP"):
            raise RewardError(f"{self.origin} failed after {self.retries} attempts ({last})")
        raise RewardError(f"{self.origin} unreachable after {self.retries} attempts ({last}); {_HINT}")

    def score(self, queries, prompts, labels=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        self.num_calls += 1
        raw = self._post({"query": list(queries), "prompts": None if prompts is None else list(prompts),
                          "labels": None if labels is None else list(labels)})
        return parse_output(raw, n, self.origin)

    def close(self) -> None:
        self.session.close()

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r})"


class ShardedRemoteReward:
    """RewardSource spreading each batch of B samples over k reward servers (`urls`, in order).

    Server i gets the contiguous chunk i of `contiguous_chunks(B, k)`: B // k samples each, and one
    more for each of the first B % k servers; a server whose chunk is empty gets no request. The
    requests go out concurrently (one thread per server) and the results are joined in the order
    of the batch (`concat_results`). Each server is a `RemoteReward` with the same token, timeout,
    retries and backoff; when one still fails, its RewardError (which names its URL) is raised, with
    the URLs of any other failed servers appended."""

    def __init__(self, urls: list[str], *, token: str | None = None, timeout: float = 30, retries: int = 3,
                 backoff: float = 0.5):
        if len(urls) < 2:
            raise ValueError(f"ShardedRemoteReward needs at least two URLs, got {urls!r}")
        self.servers = [RemoteReward(u, token=token, timeout=timeout, retries=retries, backoff=backoff)
                        for u in urls]
        self.urls = list(urls)
        self.origin = "reward servers " + ", ".join(self.urls)
        self.num_calls = 0
        self._pool: ThreadPoolExecutor | None = None  # made at the first call


    def score(self, queries, prompts, labels=None, **kwargs) -> RewardResult:
        n = check_batch(queries, prompts, labels)
        self.num_calls += 1
        chunks = contiguous_chunks(n, len(self.servers))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.servers), thread_name_prefix="reward-server")

        def part(values, chunk):
            return None if values is None else [values[j] for j in chunk]

        jobs = [(server, self._pool.submit(server.score, part(queries, c), part(prompts, c), part(labels, c)))
                for server, c in zip(self.servers, chunks) if len(c)]
        parts, errors = [], []
        for server, job in jobs:
            try:
                parts.append(job.result())
            except RewardError as err:
                errors.append((server, err))
        if errors:
            first, err = errors[0]
            others = [s.url for s, _ in errors[1:]]
            also = f" (also failed: {', '.join(others)})" if others else ""
            raise RewardError(f"{err}{also}") from None
        try:
            return concat_results(parts)
        except RewardError as err:
            raise RewardError(f"{self.origin}: {err}") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for server in self.servers:
            server.close()

    def __repr__(self) -> str:
        return f"ShardedRemoteReward({self.urls!r})"
