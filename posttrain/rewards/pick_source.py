"""Pick the reward source from the `--reward.*` flags."""
from __future__ import annotations

from posttrain.config.roles import reward_endpoints
from posttrain.rewards.python_func import DEFAULT_TIMEOUT as FUNC_TIMEOUT
from posttrain.rewards.python_func import MAX_STUCK, PythonRewardFunction
from posttrain.rewards.remote import RemoteReward, ShardedRemoteReward
from posttrain.rewards.result import RewardError
from posttrain.rewards.reward_model import RewardModelSource

HTTP_TIMEOUT = 30.0  # seconds per HTTP reward request when --reward.timeout is not given


def make_reward_source(remote_url: str | None = None, model_name_or_path: str | None = None, *,
                       setup=None, normalize: bool = False, batch_size: int = 16, max_len: int | None = None,
                       tokenizer=None, device="cpu", on_error: str = "raise",
                       token: str | None = None, timeout: float | None = None, retries: int = 3,
                       backoff: float = 0.5, max_stuck: int = MAX_STUCK, ds=None,
                       zero_stage: int | None = None, offload: bool = False):
    """remote_url ending in .py → PythonRewardFunction(remote_url, on_error, timeout, retries, backoff,
    max_stuck);
    remote_url http(s):// → RemoteReward(remote_url, token, timeout, retries, backoff);
    several comma-separated http(s):// URLs → ShardedRemoteReward(urls, ...) (each batch spread over them);
    timeout: seconds per reward call — None: 30 per HTTP request (HTTP_TIMEOUT), 300 per reward_func
    call on a rollout batch (FUNC_TIMEOUT: a Python grader such as math-verify needs tens of ms per
    sample, i.e. tens of seconds for a batch of a thousand);
    model_name_or_path → RewardModelSource(model_name_or_path, setup, normalize, batch_size, max_len,
    tokenizer, device, ds, zero_stage, offload): `setup` (`models.setup.ModelSetup`) builds the model;
    `zero_stage` 3 over several ranks holds it as ZeRO-3 shards; `offload` keeps it in CPU memory
    between forwards where there is an accelerator.
    Exactly one of --reward.remote_url / --reward.model_name_or_path must be given."""
    if remote_url and model_name_or_path:
        raise RewardError(f"--reward.remote_url={remote_url!r} and --reward.model_name_or_path="
                          f"{model_name_or_path!r} both given; a run takes its rewards from one source, "
                          "drop one")
    if not remote_url and not model_name_or_path:
        raise RewardError("no reward source: give --reward.model_name_or_path (a reward model folder) or "
                         "--reward.remote_url (a reward_func .py file or an http(s):// reward server)")
    if remote_url:
        try:
            sources = reward_endpoints(remote_url)
        except ValueError as err:
            raise RewardError(f"--reward.remote_url={str(remote_url).strip()!r}: {err}") from None
        timeout_http = HTTP_TIMEOUT if timeout is None else timeout
        if len(sources) > 1:
            return ShardedRemoteReward(sources, token=token, timeout=timeout_http, retries=retries,
                                       backoff=backoff)
        url = sources[0]
        if url.startswith(("http://", "https://")):
            return RemoteReward(url, token=token, timeout=timeout_http, retries=retries, backoff=backoff)
        return PythonRewardFunction(url, on_error=on_error,
                                    timeout=FUNC_TIMEOUT if timeout is None else timeout,
                                    retries=retries, backoff=backoff, max_stuck=max_stuck)
    if normalize is None:
        normalize = False
    return RewardModelSource(model_name_or_path, setup=setup, normalize=normalize, batch_size=batch_size,
                             max_len=max_len, tokenizer=tokenizer, device=device, ds=ds,
                             zero_stage=zero_stage, offload=offload)
