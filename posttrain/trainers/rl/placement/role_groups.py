"""The Ray actor groups of an RL run's roles, each with the role interface of the in-process roles
(`trainers/rl/roles.py`): the actor, reference and critic (`RoleWorker` ranks), the reward model, and the
rollout engines (`EngineWorker`s); `RayPlacement` (`ray_placement.py`) places and starts them.

Rows go to ranks balanced by tokens; experience travels once per call as numpy through the object store.
Any rank that dies or fails ends the call at once with an error naming its role and rank (`wait_all`),
without waiting for the others (which may be blocked in a collective with it)."""
from __future__ import annotations

import threading
import time

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from posttrain.models.parallel_groups import ParallelLayout
from posttrain.rewards.process_reward_model import StepRewards
from posttrain.rewards.result import RewardResult, concat_results, contiguous_chunks
from posttrain.rollout.types import rank_seed
from posttrain.trainers.rl.placement.transport import (
    experience_to_numpy,
    least_loaded,
    plan_steps,
    split_by_tokens,
)
from posttrain.trainers.rl.placement.weight_sync import layout_bytes
from posttrain.trainers.rl.updates import critic_shuffle_step, optimizer_steps
from posttrain.utils.errors import UserError, WorkerFailed

SYNC_BUCKET_BYTES = 128 << 20
_SUMMED = ("actor/policy_loss", "critic/value_loss", "train/rows_per_step")


def wait_all(calls: list[tuple[ray.ObjectRef, str]], timeout: float | None = None) -> list:
    """The results of `calls` (object ref, "role rank i") in order. The first failure raises at
    once: a dead process as `WorkerFailed` naming it, a user error of a worker as itself, any other
    exception as RuntimeError with the worker's traceback; with `timeout`, calls still pending after
    it as `WorkerFailed` (a process Ray could not place or start)."""
    label = {ref: name for ref, name in calls}
    pending, results = [ref for ref, _ in calls], {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            names = ", ".join(label[r] for r in pending)
            raise WorkerFailed(f"{names} did not start within {timeout:.0f} s (the cluster has "
                               f"{ray.cluster_resources()}): lower the rank counts, colocate roles, or add "
                               "nodes")
        for ref in ready:
            try:
                results[ref] = ray.get(ref)
            except RayTaskError as e:
                cause = getattr(e, "cause", None)
                if isinstance(cause, UserError):
                    raise cause from None
                raise RuntimeError(f"{label[ref]} failed:\n{e}") from None
            except RayActorError as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise WorkerFailed(f"{label[ref]} died or could not start ({reason}); the run stops — "
                                   "resume it from its last checkpoint with --ckpt.load_enable") from None
    return [results[ref] for ref, _ in calls]


class Group:
    def __init__(self, name: str, handles: list, layout: ParallelLayout | None = None) -> None:
        self.name, self.handles = name, handles
        # context and tensor parallelism: the ranks of one data-parallel index (a block of context x tensor
        # consecutive ranks) take the same rows
        self.layout = layout if layout is not None and len(handles) > 1 else ParallelLayout(len(handles))
        self.same_rows = self.layout.context * self.layout.tensor

    @property
    def context_size(self) -> int:
        return self.layout.context

    @property
    def data_ranks(self) -> int:
        """The data-parallel ranks: groups of ranks that take the same rows."""
        return self.layout.data

    def per_rank(self, shares: list) -> list:
        """Each rank's share: its data-parallel index's."""
        return [shares[r // self.same_rows] for r in range(len(self.handles))]

    def leaders(self, results: list) -> list:
        """One result per data-parallel index (its first rank's; the others computed the same)."""
        return results[::self.same_rows]

    def label(self, rank: int) -> str:
        return f"{self.name} rank {rank}"

    def call(self, method: str, *args) -> list:
        return wait_all([(getattr(h, method).remote(*args), self.label(i))
                         for i, h in enumerate(self.handles)])

    def call_each(self, method: str, per_rank: list[tuple]) -> list:
        return wait_all([(getattr(h, method).remote(*a), self.label(i))
                         for i, (h, a) in enumerate(zip(self.handles, per_rank))])

    def first(self, results: list):
        return next(r for r in results if r is not None)


class _RoleGroup(Group):
    """Ranks of one role; per-token outputs are computed on token-balanced row shares."""

    def _per_token(self, method: str, exp, batches) -> torch.Tensor:
        shares = split_by_tokens(range(len(exp)), exp.attention_mask.sum(1).tolist(), self.data_ranks)
        arrays = ray.put(experience_to_numpy(exp))
        out = torch.zeros_like(exp.action_mask)
        results = self.call_each(method, [(arrays, s, batches) for s in self.per_rank(shares)])
        for share, part in zip(shares, self.leaders(results)):
            if share:
                out[share, : part.shape[1]] = torch.from_numpy(part.copy())
        return out

    def _fit(self, exp, settings, shuffle_step: int, *args) -> dict[str, float]:
        steps = optimizer_steps(len(exp), settings, shuffle_step)
        plan = plan_steps(steps, exp.attention_mask.sum(1).tolist(), self.data_ranks)
        arrays = ray.put(experience_to_numpy(exp))
        results = self.call_each("fit", [(arrays, rows, settings, *args) for rows in self.per_rank(plan)])
        metrics = merge_metrics([m for m, _ in self.leaders(results)], [w for _, w in self.leaders(results)])
        if self.context_size > 1:  # what the ring cost in this step: the most any rank moved and waited
            for key in ("bytes", "seconds"):
                metrics.pop(f"comm/cp_{key}", None)
                metrics[f"comm/{self.name}_cp_{key}"] = max(m.get(f"comm/cp_{key}", 0.0) for m, _ in results)
        return metrics

    def save_state(self, directory) -> None:
        self.call("save_state", str(directory))


class ActorGroup(_RoleGroup):
    def __init__(self, name, handles, keeps_ema: bool, lora: bool = False,
                 layout: ParallelLayout | None = None) -> None:
        super().__init__(name, handles, layout)
        self.keeps_ema, self.lora = keeps_ema, lora

    def logprobs(self, exp, batches) -> torch.Tensor:
        return self._per_token("logprobs", exp, batches)

    def reference_logprobs(self, exp, batches) -> torch.Tensor:
        """A LoRA actor's base log-probs (adapter disabled): the reference without a ref group."""
        return self._per_token("reference_logprobs", exp, batches)

    def fit(self, exp, settings, kl_coef: float, step: int) -> dict[str, float]:
        return self._fit(exp, settings, step, kl_coef, step)

    def load_state(self, directory) -> None:
        self.call("load_state", str(directory))

    def export(self, directory, tokenizer, ema: bool = True) -> None:
        self.call("export", str(directory), ema)

    def weights_hash(self) -> str:
        return self.first(self.call("weights_hash"))

    def broadcast_weights(self, engines, verify: bool = False, version: int | None = None) -> int:
        """`Actor.broadcast_weights` on Ray: base + adapter of a LoRA actor with `verify`, else the adapter
        only (a full-parameter actor: every weight). Returns the bytes sent."""
        return sum(engine_group.receive_from(self, self.sync_kind(verify or engine_group.discarded), verify,
                                             version)
                   for engine_group in engines)

    def sync_kind(self, full: bool) -> str:
        """What a sync sends (`Actor.sync_pairs`): every weight (`full`), else what training changed: the
        adapter of a LoRA actor, the trained weights of a full-parameter one."""
        return "full" if full else ("adapter" if self.lora else "trained")


class ReferenceGroup(_RoleGroup):
    def logprobs(self, exp, batches) -> torch.Tensor:
        return self._per_token("logprobs", exp, batches)


class CriticGroup(_RoleGroup):
    def values(self, exp, batches) -> torch.Tensor:
        return self._per_token("values", exp, batches)

    def fit(self, exp, settings, step: int) -> dict[str, float]:
        return self._fit(exp, settings, critic_shuffle_step(step), step)

    def load_state(self, directory) -> None:
        self.call("load_state", str(directory))

    def export(self, directory, tokenizer) -> None:
        self.call("export", str(directory))


class RewardGroup(Group):
    """A reward model over ranks: each scores a contiguous chunk of the samples' token ids. `sharded`:
    the model is held as ZeRO-3 shards across the ranks, whose forwards are collective, so every rank
    is called, with an empty chunk when there are fewer samples than ranks."""

    def __init__(self, name, handles, sharded: bool = False, layout: ParallelLayout | None = None) -> None:
        super().__init__(name, handles, layout)
        # every rank is called (an empty chunk too) when its forwards are collective: ZeRO-3 shards or a ring
        self.sharded = (sharded or self.context_size > 1) and len(handles) > 1

    def score_tokens(self, sequences: list[list[int]]) -> RewardResult:
        if not sequences:
            return RewardResult(rewards=torch.zeros(0))
        return concat_results(self._scatter("score_tokens", sequences))

    def score_steps(self, prompts: list[list[int]], responses: list[list[int]]) -> StepRewards:
        """A process reward model's step rewards (`ProcessRewardSource.score_steps`), chunked as scores."""
        if not prompts:
            return StepRewards()
        return StepRewards.concat(self._scatter("score_steps", prompts, responses))

    def _scatter(self, method: str, *columns: list) -> list:
        """`method` of each rank on its contiguous chunk of the rows of `columns`: the results of the chunks
        in order (one per data-parallel group)."""
        chunks = self.per_rank(contiguous_chunks(len(columns[0]), self.data_ranks))
        calls = [(i, c) for i, c in enumerate(chunks) if len(c) or self.sharded]
        parts = wait_all([(getattr(self.handles[i], method).remote(*([col[j] for j in c] for col in columns)),
                           self.label(i)) for i, c in calls])
        leaders = {i: p for (i, _), p in zip(calls, parts) if i % self.same_rows == 0}
        return [leaders[i] for i, c in enumerate(chunks) if len(c) and i % self.same_rows == 0]

    def close(self) -> None:
        pass


class EngineGroup(Group):
    """Rollout engines: prompts dispatched to the least-loaded engine (`generate`); weight sync
    (`receive_from`); the hashes that verify it."""

    def __init__(self, name, handles, with_ray: bool, backend: str) -> None:
        super().__init__(name, handles)
        self.with_ray, self.backend = with_ray, backend
        self.group = None  # (address, port) of the sync process group, once joined
        self.layouts: dict[str, list] = {}  # `Actor.sync_pairs` kind -> its bucket layout
        self.loads = [0] * len(handles)  # sample rows in flight per engine
        self.lock = threading.Lock()  # generate may be called from several threads (the async front)
        self.sleep_level = 0  # --vllm.sleep_level when the engines sleep between rollouts, else 0
        # what the sleeping engines released and have not taken back: "weights", "kv_cache"
        self.asleep = set()
        self.discarded = False  # a level-2 sleep discarded the weights: the next sync sends all of them
        self.kinds: list[str] = []  # the engines' backends ("hf", "vllm"), once `describe`d

    def generate(self, prompt_token_ids, params, max_new_tokens=None, seeds=None, images=None):
        """Each prompt goes to the least-loaded engine (rows in flight, over concurrent callers); every
        prompt carries its seed, so the samples do not depend on the dispatch. `images`: one entry per
        prompt (a vision-language model; `engine.generate`'s), sent with its prompt."""
        n = len(prompt_token_ids)
        if seeds is None:
            base = params.seed if params.seed is not None else int(torch.randint(0, 2**63 - 1, (1,)).item())
            seeds = [rank_seed(base, 0, i) for i in range(n)]
        return self._spread(n, params.n, lambda h, rows: h.generate.remote(
            [prompt_token_ids[i] for i in rows], params,
            None if max_new_tokens is None else [max_new_tokens[i] for i in rows], [seeds[i] for i in rows],
            None if images is None else [images[i] for i in rows]))

    def run_episodes(self, prompts, params, groups: list[int]) -> list[tuple]:
        """Agent episodes: each prompt's n episodes run in the least-loaded engine's actor (seeds follow
        `groups`, so the dispatch changes no sample); one result per (prompt, sample), sample-minor."""
        per_prompt = self._spread(len(prompts), params.n, lambda h, rows: h.run_episodes.remote(
            [prompts[i] for i in rows], params, [groups[i] for i in rows]), per_item=params.n)
        return [episode for episodes in per_prompt for episode in episodes]

    def _spread(self, n: int, cost: int, call, per_item: int = 1) -> list:
        """Items 0..n-1 over the engines, each to the least-loaded one (`cost` rows in flight per item);
        `call(handle, rows)` starts one engine's share and returns `per_item` results per row. The
        results, in item order (a list of `per_item` results each when `per_item` > 1)."""
        with self.lock:
            engine_of = least_loaded(self.loads, [cost] * n)
        parts = {e: [i for i in range(n) if engine_of[i] == e] for e in dict.fromkeys(engine_of)}
        try:  # the loads are returned even when starting a call fails
            results = wait_all([(call(self.handles[e], rows), self.label(e)) for e, rows in parts.items()])
        finally:
            with self.lock:
                for e, rows in parts.items():
                    self.loads[e] -= cost * len(rows)
        out: list = [None] * n
        for rows, outs in zip(parts.values(), results):
            for k, i in enumerate(rows):
                out[i] = outs[k] if per_item == 1 else outs[k * per_item:(k + 1) * per_item]
        return out

    def receive_from(self, actor: ActorGroup, kind: str = "full", verify: bool = False,
                     version: int | None = None) -> int:
        """Load the actor's `Actor.sync_pairs(kind)`: through Ray's object store (--vllm.sync_with_ray), or
        broadcast in buckets from actor rank 0 over a process group of its own. `verify`: the engines
        record what they received, for `weights_hashes`; `version`: the policy version they record.
        Returns the bytes sent (once for every engine)."""
        self.wake_up(("weights",))
        if kind == "full":
            self.discarded = False
        if self.with_ray:
            ref, sent = actor.first(actor.call("sync_put", kind))
            self.call("load_numpy", ref, verify, version)
            return sent
        if self.group is None:
            self._join(actor)
        if kind not in self.layouts:  # the plan of each kind's buckets (names, shapes: fixed for a run)
            self.layouts[kind] = actor.first(actor.call("sync_layout", SYNC_BUCKET_BYTES, kind))
        layout = self.layouts[kind]
        wait_all([(h.sync_receive.remote(layout, verify, version), self.label(i))
                  for i, h in enumerate(self.handles)]
                 + [(h.sync_send.remote(layout, kind), actor.label(i)) for i, h in enumerate(actor.handles)])
        return layout_bytes(layout)

    def _join(self, actor: ActorGroup) -> None:
        world = len(self.handles) + 1
        address, port = ray.get(actor.handles[0].listen.remote(world))
        wait_all([(actor.handles[0].sync_join.remote(address, port, world, self.backend), actor.label(0))]
                 + [(h.sync_join.remote(address, port, i + 1, world, self.backend), self.label(i))
                    for i, h in enumerate(self.handles)])
        self.group = (address, port)

    def weights_hashes(self) -> list[str | None]:
        return self.call("weights_hash")

    def sleep(self) -> list[dict]:
        """Put the engines to sleep at `sleep_level` (a no-op when they do not sleep); what each freed
        (`EngineWorker.sleep`)."""
        if not self.sleep_level or self.asleep:
            return []
        freed = self.call("sleep", self.sleep_level)
        self.asleep = {"weights", "kv_cache"}
        self.discarded = self.discarded or self.sleep_level == 2
        return freed

    def wake_up(self, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        """Take back what the sleeping engines released of `tags`, as OpenRLHF: the weights before a sync
        (after a level-2 sleep they hold nothing until it), the KV cache before generating."""
        tags = [t for t in tags if t in self.asleep]
        if tags:
            self.call("wake_up", tags)
            self.asleep -= set(tags)

    def describe(self) -> str:
        """Which backend the engines run, and why (why not vLLM when they do not)."""
        backends = self.call("backend_name")
        self.kinds = kinds = sorted({b for b, _ in backends})
        why = sorted({w for b, w in backends if w})
        not_vllm = "vllm" not in kinds
        return (f"{len(backends)} rollout engine(s): {', '.join(kinds)}"
                + (f" ({'not vLLM: ' if not_vllm else ''}{'; '.join(why)})" if why else ""))


def merge_metrics(per_rank: list[dict[str, float]], weights: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict from the ranks': losses and row counts add up (each rank's is its share of the
    step's); the rest are means weighted as in one process (a token-weighted rate by each rank's
    tokens; norms and the learning rate, equal on every rank, stay as they are). A metric only some
    ranks measured is merged over those."""
    out = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):
        present = [(m[key], w.get(key, 1.0)) for m, w in zip(per_rank, weights) if key in m]
        total = sum(w for _, w in present)
        if key in _SUMMED:
            out[key] = sum(v for v, _ in present)
        elif total > 0:
            out[key] = sum(v * w for v, w in present) / total
        else:
            out[key] = sum(v for v, _ in present) / len(present)
    return out
