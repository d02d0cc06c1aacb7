"""Agent episodes as a rollout batch (`--train.agent_func_path`): `AgentRunner.run` has the interface of
`SingleTurnSampler.run` (`rollout/single_turn.py`), so collection, dynamic filtering, shaping,
evaluation and every estimator work on multi-turn samples unchanged.

Each (prompt, sample) pair is one episode of the user's `AgentExecutor`, all run concurrently on one
event loop over an `AsyncRolloutEngine` (continuous batching across episodes on the HF engine). On Ray
the episodes run inside the rollout engine actors, as OpenRLHF's do: each prompt goes to the
least-loaded engine, whose actor runs its episodes against its own engine (`EngineWorker.run_episodes`);
failures and the reward source are counted and applied here, over the whole batch. Episode j of prompt g
(g counted within the step) has the seed `rank_seed(params.seed, j, g)`, so the batch does not depend
on scheduling. An episode becomes a sample:
    prompt = observation_tokens[:prompt_length], response = the rest (actions and environment feedback
    as fed and sampled), action_mask over the response = 1 inside `action_ranges`, rollout log-probs
    from the engine for action tokens (0 elsewhere), reward = the episode's accumulated reward
    (None: scored by the run's reward source, if any), score = its `scores`.
An episode that raises, exceeds `--agent.timeout` seconds or returns a malformed result fails: it is
logged with its reason, counted in `agent/failed`, and enters the batch as a skipped sample (no
tokens, no gradient, out of its group's baseline). More than `--agent.max_failure_frac` of a batch
failing stops the run with the first reason. An error of the rollout engine itself stops the run, and
so does `sys.exit()` in the agent's code (an error of the agent file, not of one episode).

Each episode's coroutine runs on a daemon thread with an event loop of its own (`_EpisodeThread`);
its engine calls cross to the shared front on the collecting loop (`_LoopBridge`). So an agent whose
`step()` blocks (`time.sleep`, a blocking socket, a busy loop) stalls only its own episode: the
timeout still fires, the episode fails and is abandoned (its thread is cancelled at its next `await`
and never blocks the exit), and the other episodes and the engine go on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import threading
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from posttrain.agents.agent_api import AgentExecutorBase
from posttrain.agents.episode import AgentSamplingParams, EpisodeEngine
from posttrain.compat.user_files import UserFileExit, exiting
from posttrain.rollout.async_engine import AsyncRolloutEngine, run_coroutine
from posttrain.rollout.single_turn import Rollout, ScoredRollouts, reward_prompt_text, score_rollouts
from posttrain.rollout.types import rank_seed
from posttrain.utils.errors import UserError
from posttrain.utils.log import info, warn_once

if TYPE_CHECKING:
    from posttrain.config import PPOConfig


GATHER_WAIT = 0.002  # seconds the front waits, per round, for requests crossing from episode threads


class AgentError(UserError):
    """Too many episodes of a batch failed."""


class EpisodeFailed(Exception):
    pass


class _EngineFailed(Exception):
    """The rollout engine failed under an episode: not the episode's fault, the run stops."""


class _GuardedEngine(EpisodeEngine):
    async def generate(self, *args, **kwargs):
        try:
            return await super().generate(*args, **kwargs)
        except (TypeError, ValueError):
            raise  # the agent's own request was malformed
        except Exception as e:
            raise _EngineFailed(e) from e


class _Abandoned(Exception):
    """The episode ran past its timeout; its late engine calls are refused."""


class _LoopBridge:
    """The shared `AsyncRolloutEngine` as an episode's thread sees it: `generate` runs on the front's
    loop (`loop`) and is awaited from the episode's own loop; cancelled when the episode is abandoned."""

    def __init__(self, front, loop) -> None:
        self.front, self.loop, self.engine = front, loop, front.engine
        self.abandoned = False
        self._pending: set[concurrent.futures.Future] = set()

    async def generate(self, *args, **kwargs):
        if self.abandoned or self.loop.is_closed():
            raise _Abandoned()
        future = asyncio.run_coroutine_threadsafe(self.front.generate(*args, **kwargs), self.loop)
        self._pending.add(future)
        try:
            return await asyncio.wrap_future(future)
        finally:
            self._pending.discard(future)

    def abandon(self) -> None:
        self.abandoned = True
        for future in list(self._pending):
            future.cancel()


class _EpisodeThread:
    """`make()`'s coroutine run to its end on a daemon thread with its own event loop; `future` gets its
    result or exception (a SystemExit as `UserFileExit`). `abandon()` cancels it at its next `await`."""

    def __init__(self, make, name: str) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self._make = make
        self._loop = self._task = None
        self._started = threading.Event()
        threading.Thread(target=self._main, name=name, daemon=True).start()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            self._task = loop.create_task(self._run())
            self._loop = loop
            self._started.set()
            outcome = ("result", loop.run_until_complete(self._task))
        except SystemExit as err:
            outcome = ("error", exiting(err))
        except BaseException as err:  # the episode's error, or its cancellation once abandoned
            outcome = ("error", err)
        finally:
            self._started.set()
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
        try:
            if outcome[0] == "result":
                self.future.set_result(outcome[1])
            else:
                self.future.set_exception(outcome[1])
        except concurrent.futures.InvalidStateError:  # abandoned: nobody waits
            pass

    async def _run(self):
        return await self._make()

    def abandon(self) -> None:
        self._started.wait(1.0)
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop has already closed
                pass


def episode_to_rollout(result, prompt, group: int, max_len: int, tokenizer) -> Rollout:
    """The sample of one episode result (module docstring); EpisodeFailed names what is malformed."""
    if not isinstance(result, dict):
        raise EpisodeFailed(f"execute() must return a dict, got {type(result).__name__}")
    obs, ranges = result.get("observation_tokens"), result.get("action_ranges")
    if not isinstance(obs, list) or not all(isinstance(t, int) for t in obs):
        raise EpisodeFailed("execute()['observation_tokens'] must be a list of token ids")
    if not isinstance(ranges, list) or not ranges:
        raise EpisodeFailed("execute()['action_ranges'] must be a non-empty list of (start, end) pairs")
    p = int(result.get("prompt_length", ranges[0][0]))
    if not 1 <= p <= len(obs):
        raise EpisodeFailed(f"execute()['prompt_length'] {p} must be between 1 and the {len(obs)} "
                            f"observation tokens")
    end = p
    mask = [0] * (len(obs) - p)
    for r in ranges:
        if not (isinstance(r, (list, tuple)) and len(r) == 2 and end <= r[0] <= r[1] <= len(obs)):
            raise EpisodeFailed(f"execute()['action_ranges'] {ranges}: ranges must be ordered, after the "
                                f"prompt ({p} tokens) and within the {len(obs)} observation tokens")
        mask[r[0] - p: r[1] - p] = [1] * (r[1] - r[0])
        end = r[1]
    if len(obs) > max_len:
        raise EpisodeFailed(f"the episode has {len(obs)} tokens, more than --data.max_len {max_len}")
    logprobs = result.get("rollout_log_probs")
    if logprobs is None or len(logprobs) != len(obs):
        raise EpisodeFailed(f"execute()['rollout_log_probs'] must hold one log-prob per observation token "
                            f"({len(obs)}), got {None if logprobs is None else len(logprobs)}")
    response = obs[p:]
    return Rollout(prompt_ids=obs[:p], output_ids=response, rollout_logprobs=[float(x) for x in logprobs[p:]],
                   finish_reason="length" if result.get("truncated") else "stop",
                   # with images, the prompt's expanded tokens decoded (`single_turn.reward_prompt_text`)
                   prompt_text=prompt.text if result.get("mm_train_inputs") is None
                   else tokenizer.decode(obs[:p], skip_special_tokens=False),
                   response_text=tokenizer.decode(response, skip_special_tokens=True), label=prompt.label,
                   columns=getattr(prompt, "columns", None), group=group, budget=max(1, max_len - p),
                   prompt_messages=getattr(prompt, "messages", None),
                   action_mask=mask,
                   turns=int(result.get("turns", len(ranges))),
                   env_tokens=int(result.get("env_tokens", len(response) - sum(mask))),
                   step_time=float(result.get("step_time", 0.0)), image_inputs=_image_inputs(result),
                   reward_ids=result.get("reward_ids"),
                   tool_call_errors=None if result.get("tool_call_errors") is None
                   else int(result["tool_call_errors"]))


def _image_inputs(result) -> dict | None:
    """The episode's image tensors (`mm_train_inputs`: a dict of arrays, or None without images)."""
    images = result.get("mm_train_inputs")
    if images is None:
        return None
    if not isinstance(images, dict) or not images:
        raise EpisodeFailed(f"execute()['mm_train_inputs'] must be a dict of image tensors or None, got "
                            f"{images!r:.80}")
    return {k: np.asarray(v) for k, v in images.items()}


def _episode_float(value, what: str) -> float | None:
    """A number of an `execute()` result (`reward`, `scores`, an extra_logs entry) as a float;
    None stays None."""
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        raise EpisodeFailed(f"execute()['{what}'] must be a number, got {value!r:.80}") from None


def loggable(extra_logs) -> dict[str, float]:
    """The numbers of an episode's `extra_logs`: a number, or a one-element sequence, array or tensor, as a
    float. Anything else (text, several elements, a non-dict) is skipped with one warning per key: a logging
    field never costs the episode its reward."""
    if not isinstance(extra_logs, dict):
        if extra_logs:
            warn_once(f"agent extra_logs must be a dict of numbers, got {type(extra_logs).__name__}: not "
                      f"logged")
        return {}
    out = {}
    for key, value in extra_logs.items():
        number = _log_number(value)
        if number is None:
            warn_once(f"agent extra_logs[{key!r}] is not a number or a one-element sequence/tensor "
                      f"({type(value).__name__}): not logged")
        else:
            out[str(key)] = number
    return out


def _log_number(value) -> float | None:
    """`value` as a float when it is a number or holds exactly one (list, array, tensor); else None."""
    try:
        values = torch.as_tensor(value, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    return float(values.reshape(-1)[0]) if values.numel() == 1 else None


class AgentRunner:
    """`executor`: an `AgentExecutorBase` instance; `engine`: a batch rollout engine (HF, vLLM, or a
    Ray engine group); `reward_source`: scores episodes whose reward is None (may be None);
    `turn_cap`: the most tokens per turn (`--rollout.max_new_tokens`; None: the remaining budget)."""

    def __init__(self, executor: AgentExecutorBase, engine, tokenizer, reward_source, *, max_len: int,
                 timeout: float, max_failure_frac: float, turn_cap: int | None = None, processor=None,
                 image_limits=None) -> None:
        self.executor, self.engine, self.tokenizer = executor, engine, tokenizer
        self.image_limits = image_limits  # the episodes' engines carry them to the executors
        # a vision-language model's: the executors get it as `hf_tokenizer` (OpenRLHF)
        self.processor = processor
        self.reward_source, self.turn_cap = reward_source, turn_cap
        self.max_len, self.timeout, self.max_failure_frac = max_len, timeout, max_failure_frac

    def close(self) -> None:
        """Stop what the executor started (an OpenAI-compatible server)."""
        if hasattr(self.executor, "close"):
            self.executor.close()

    @classmethod
    def from_config(cls, executor: AgentExecutorBase, engine, tokenizer, reward_source,
                    cfg: PPOConfig, processor=None) -> AgentRunner:
        from posttrain.data.images import ImageLimits

        return cls(executor, engine, tokenizer, reward_source, max_len=cfg.data.max_len,
                   timeout=cfg.agent.timeout, max_failure_frac=cfg.agent.max_failure_frac,
                   turn_cap=cfg.rollout.max_new_tokens, processor=processor,
                   image_limits=ImageLimits.of(cfg.data))

    def run(self, prompts, params, group_offset: int = 0, max_len: int | None = None) -> ScoredRollouts:
        """`max_len` is ignored: an episode's budget is `--data.max_len` over all its turns."""
        groups = list(range(group_offset, group_offset + len(prompts)))
        if params.seed is None:  # one base for the whole batch, wherever its episodes run
            params = replace(params, seed=random.getrandbits(62))
        if hasattr(self.engine, "run_episodes"):  # Ray rollout engines: episodes run inside them
            episodes = self.engine.run_episodes(prompts, params, groups)
        else:
            episodes = self.collect(prompts, params, groups)
        return self.finish(prompts, params, episodes, groups)

    def collect(self, prompts, params, groups: list[int]) -> list[tuple]:
        """Run every episode here: one (rollout or failure reason, reward, score, extra logs) per
        (prompt, sample), sample-minor. `groups[g]`: prompt g's index within the step (its seeds)."""
        return run_coroutine(self._collect(prompts, params, groups))

    async def _collect(self, prompts, params, groups: list[int]) -> list[tuple]:
        front = AsyncRolloutEngine(self.engine)
        front.gather_wait = GATHER_WAIT  # the episodes' requests cross from their own threads
        try:
            return await asyncio.gather(*(self._episode(front, prompts[g], params,
                                                        rank_seed(params.seed, j, groups[g]), groups[g])
                                          for g in range(len(prompts)) for j in range(params.n)))
        finally:
            front.close()

    def finish(self, prompts, params, episodes: list[tuple], groups: list[int]) -> ScoredRollouts:
        """The batch of the collected episodes: failures counted (the run stops past the threshold),
        rewards of None scored by the reward source, whose extra_logs (`reward/<term>`, ...) join those
        episodes' own (the other episodes: NaN, left out of the metric's mean)."""
        rollouts, rewards, scores, logs = [], [], [], []
        failed = []
        jobs = [g for g in range(len(prompts)) for _ in range(params.n)]
        for g, (rollout, reward, score, extra) in zip(jobs, episodes):
            if isinstance(rollout, str):
                failed.append(rollout)
                prompt = prompts[g]
                rollout = Rollout(prompt_ids=list(prompt.token_ids), output_ids=[], rollout_logprobs=[],
                                  finish_reason="stop",
                                  prompt_text=reward_prompt_text(self.tokenizer, prompt), response_text="",
                                  label=prompt.label, columns=getattr(prompt, "columns", None),
                                  prompt_messages=getattr(prompt, "messages", None),
                                  group=groups[g], budget=1, action_mask=[], turns=0,
                                  error=rollout, image_inputs=getattr(prompt, "image_inputs", None))
            rollouts.append(rollout)
            rewards.append(reward)
            scores.append(score)
            logs.append(extra)
        self._check_failures(failed, len(jobs))
        skipped = torch.tensor([r.error is not None for r in rollouts])
        need = [i for i, r in enumerate(rewards) if r is None and rollouts[i].error is None]
        if need:
            if self.reward_source is None:
                raise AgentError("the agent returned no reward (reward None) and the run has no reward "
                                 "source: return 'rewards' from step(), or add --reward.model_name_or_path / "
                                 "--reward.remote_url")
            scored = score_rollouts(self.reward_source, self.tokenizer, [rollouts[i] for i in need])
            for k, i in enumerate(need):
                rewards[i] = float(scored.rewards[k])
                scores[i] = float(scored.scores[k]) if scores[i] is None else scores[i]
                skipped[i] = bool(scored.skipped[k])
                logs[i] = {**_log_at(scored.extra_logs, k, len(need)), **logs[i]}  # its own win
        rewards_t = torch.tensor([0.0 if r is None else r for r in rewards], dtype=torch.float32)
        scores_t = torch.tensor([rewards_t[i] if s is None else s for i, s in enumerate(scores)],
                                dtype=torch.float32)
        return ScoredRollouts(rollouts=rollouts, rewards=rewards_t, scores=scores_t,
                              extra_logs=_merge_logs(logs), skipped=skipped)

    async def _episode(self, front, prompt, params, seed: int, group: int):
        """(rollout, reward, score, extra_logs), or (reason, None, None, {}) for a failed episode."""
        sampling = AgentSamplingParams.for_run(params, max_tokens=self.turn_cap)
        bridge = _LoopBridge(front, asyncio.get_running_loop())
        engine = _GuardedEngine(bridge, self.tokenizer, seed, self.image_limits)
        # the row's image references, as in OpenRLHF (a prompt built without them: its images)
        images = getattr(prompt, "images", None) and (getattr(prompt, "image_refs", None) or prompt.images)
        worker = _EpisodeThread(
            lambda: self.executor.execute(prompt.text, prompt.label, sampling, self.max_len,
                                          self.processor or self.tokenizer, engine,
                                          **({"images": images} if images else {})),
            name=f"posttrain-episode-{group}-{seed}")
        try:
            try:
                result = await asyncio.wait_for(asyncio.wrap_future(worker.future), self.timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                bridge.abandon()
                worker.abandon()
                raise
            rollout = episode_to_rollout(result, prompt, group, self.max_len, self.tokenizer)
            rollout.policy_versions = sorted(engine.versions) or None
            reward = _episode_float(result.get("reward"), "reward")
            score = _episode_float(result.get("scores"), "scores")
            return rollout, reward, score, loggable(result.get("extra_logs"))
        except _EngineFailed as e:
            raise e.args[0] from None
        except UserFileExit as e:
            flag = getattr(self.executor, "FLAG", "--train.agent_func_path")  # ToolAgentExecutor's
            raise AgentError(f"{flag}: an agent episode stopped the run: {e}") from None
        except asyncio.TimeoutError:
            return f"timed out after {self.timeout:g} s (--agent.timeout)", None, None, {}
        except Exception as e:  # the environment's or the executor's error: this episode fails
            return f"{type(e).__name__}: {e}", None, None, {}

    def _check_failures(self, failed: list[str], total: int) -> None:
        if not failed:
            return
        for reason in failed[:3]:
            info(f"agent episode failed: {reason}")
        if len(failed) > 3:
            info(f"... and {len(failed) - 3} more failed episodes in this batch")
        if len(failed) > self.max_failure_frac * total:
            raise AgentError(f"{len(failed)} of {total} agent episodes failed (more than "
                             f"--agent.max_failure_frac {self.max_failure_frac:g}); first: {failed[0]}")


def _log_at(extra_logs: dict, k: int, n: int) -> dict[str, float]:
    """Sample k's values of a reward source's extra_logs over n samples: a per-sample value (n of them)
    or a batch statistic (one number, the same for each)."""
    out = {}
    for key, value in extra_logs.items():
        t = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
        out[str(key)] = float(t[k] if t.numel() == n else t[0])
    return out


def _merge_logs(logs: list[dict]) -> dict:
    """Per-sample extra logs → one tensor per key over the batch (NaN where a sample has none)."""
    keys = list(dict.fromkeys(k for d in logs for k in d))
    return {k: torch.tensor([d.get(k, math.nan) for d in logs], dtype=torch.float32) for k in keys}
