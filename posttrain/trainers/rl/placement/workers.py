"""The processes of a Ray placement: `RoleWorker` (one rank of the actor, critic, reference or
reward-model group) and `EngineWorker` (one rollout engine). Plain classes, made Ray actors by
`ray_placement` with `ray.remote(cls)`; each builds its role with the same code as the in-process
trainer (`trainers.rl.build`), then serves the role's batch methods on numpy experience."""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from posttrain.engines import dist as pdist
from posttrain.models.lora_sync import is_adapter_name
from posttrain.models.vision import export_savers, is_vision_folder, load_processor
from posttrain.trainers.rl.placement.transport import experience_from_numpy
from posttrain.trainers.rl.placement.weight_sync import SyncGroup
from posttrain.utils.memory import apply_heap_policy
from posttrain.utils.weights_hash import NamedTensors, WeightsDigest, named_tensors

if TYPE_CHECKING:
    from posttrain.config import PPOConfig


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def numpy_state(state: NamedTensors) -> dict[str, tuple[np.ndarray, str]]:
    """A state dict (or its pairs, streamed) as numpy arrays (bf16 travels as its int16 bit pattern)
    with their dtypes."""
    out = {}
    for k, t in named_tensors(state):
        t = t.detach().to("cpu").contiguous()
        out[k] = ((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy(), str(t.dtype))
    return out


def torch_state(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for k, (a, dtype) in arrays.items():
        t = torch.from_numpy(np.array(a))
        out[k] = t.view(torch.bfloat16) if dtype == "torch.bfloat16" else t
    return out


DRIVER_CWD = "POSTTRAIN_DRIVER_CWD"  # the driver's working directory (`ray_placement.worker_env`)


class _Process:
    def __init__(self, threads: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        if os.path.isdir(env.get(DRIVER_CWD, "")):  # a joined cluster's worker starts in the cluster's own
            os.chdir(env[DRIVER_CWD])
        self._listening: dict = {}  # port -> the store this process serves there (`listen`)
        torch.set_num_threads(max(1, threads))
        apply_heap_policy()

    def pid(self) -> int:
        return os.getpid()

    def listen(self, world: int) -> tuple[str, int]:
        """Serve the rendezvous store of a new group of `world` processes, this one its rank 0; returns
        (this node's IP, the port the OS gave it). The store is kept until the group is formed."""
        import ray

        host = ray.util.get_node_ip_address()
        store = pdist.serve_store(host, world)
        self._listening[store.port] = store
        return host, store.port


class RoleWorker(_Process):
    """Rank `rank` of `world` of a role ("actor", "critic", "ref", "teacher", "reward"); the ranks of a
    trained role form a torch.distributed group (`master`: rank 0's address) for DeepSpeed."""

    def __init__(self, role: str, rank: int, world: int, master: tuple[str, int] | None, threads: int,
                 env: dict[str, str]) -> None:
        env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
        if master is not None:
            env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        super().__init__(threads, env)
        self.role, self.rank, self.world = role, rank, world
        # rank 0's: set by `listen_as_master`; None: the launcher's env rendezvous (torchrun)
        self.master = master
        self.obj = None
        self.gather_for_generation = False
        self.sync: SyncGroup | None = None

    def listen_as_master(self) -> tuple[str, int]:
        """Rank 0: serve the role group's store (`listen`) and take its address as MASTER_ADDR /
        MASTER_PORT."""
        self.master = self.listen(self.world)
        os.environ.update(MASTER_ADDR=self.master[0], MASTER_PORT=str(self.master[1]))
        return self.master

    def _join_role_group(self) -> None:
        """Form the role's default process group over rank 0's store (every rank's `setup` runs at once)
        before the engines need it; they find it running. Without a master (ranks started by a launcher
        such as torchrun) the engines form it from the launcher's env."""
        import torch.distributed as dist

        if self.master is not None and not dist.is_initialized():
            host, port = self.master
            if self.rank > 0:
                store = pdist.connect_store(host, port, self.world)
            elif port in self._listening:  # the store it served (`listen_as_master`)
                store = self._listening.pop(port)
            else:  # an address it was given: serve the store there
                store = pdist.serve_store(host, self.world, port)
            pdist.init_process_group_from_store(store, self.rank, self.world)

    def setup(self, cfg: PPOConfig, total_steps: int) -> None:
        from posttrain.models import load_tokenizer
        from posttrain.trainers.rl import build

        self.tokenizer = load_tokenizer(cfg.actor.model_name_or_path,
                                        use_fast=not cfg.data.disable_fast_tokenizer,
                                        chat_template=cfg.data.tokenizer_chat_template)
        processor = None
        if self.role == "actor" and is_vision_folder(cfg.actor.model_name_or_path):
            processor = load_processor(cfg.actor.model_name_or_path, self.tokenizer)
        self.savers = export_savers(self.tokenizer, processor)  # what its exports hold besides the weights
        device = _device()
        if self.world > 1:
            self._join_role_group()
        zero = cfg.ds.zero_stage if self.world > 1 else None  # one rank: the in-process engine
        self.gather_for_generation = cfg.ds.gather_for_generation
        if self.role == "actor":
            self.obj = build.build_actor(cfg, self.tokenizer, device, total_steps, zero)
        elif self.role == "critic":
            self.obj = build.build_critic(cfg, self.tokenizer, device, total_steps, zero)
        elif self.role == "ref":
            self.obj = build.build_reference(cfg, self.tokenizer, device, zero)
        elif self.role == "teacher":
            self.obj = build.build_teacher(cfg, self.tokenizer, device, zero)
        elif self.role == "reward":
            self.obj = build.build_reward_source(cfg, self.tokenizer, device, zero)
        else:
            raise ValueError(f"unknown role {self.role!r}")

    def shard_numel(self) -> tuple[int, int] | None:
        """(parameter elements this rank held right after loading its model, elements of the whole model):
        equal for a whole copy, this rank's share when it loaded ZeRO-3 shards (`engines.zero3.shard_numel`);
        None for a role without a model (a reward file or server)."""
        return getattr(self.obj, "loaded_numel", None)

    # ---- batch methods ----------------------------------------------------------------------
    def _shard(self, arrays, rows: list[int]):
        exp = experience_from_numpy(arrays)
        return exp.select(rows if rows else [0])

    def logprobs(self, arrays, rows: list[int], batching) -> np.ndarray:
        return self.obj.logprobs(self._shard(arrays, rows), batching).numpy()[: len(rows)]

    def reference_logprobs(self, arrays, rows: list[int], batching) -> np.ndarray:
        return self.obj.reference_logprobs(self._shard(arrays, rows), batching).numpy()[: len(rows)]

    def values(self, arrays, rows: list[int], batching) -> np.ndarray:
        return self.obj.values(self._shard(arrays, rows), batching).numpy()[: len(rows)]

    def fit(self, arrays, step_rows: list[list[int]], settings, *args) -> tuple[dict, dict]:
        """This rank's metrics and their weights (tokens), for `role_groups.merge_metrics`."""
        exp = experience_from_numpy(arrays)
        weights: dict = {}
        return self.obj.fit(exp, settings, *args, step_rows=step_rows, weights_out=weights), weights

    def score_tokens(self, sequences: list[list[int]]):
        return self.obj.score_tokens(sequences)

    def score_steps(self, prompts: list[list[int]], responses: list[list[int]]):
        return self.obj.score_steps(prompts, responses)

    def save_state(self, directory: str) -> None:
        self.obj.save_state(directory)

    def load_state(self, directory: str) -> None:
        from posttrain.utils.checkpoint import CheckpointError

        try:
            self.obj.load_state(directory)
        except Exception as e:  # one line for the user (e.g. other rank counts than the checkpoint's)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"{self.role} rank {self.rank} cannot load {directory}: {first}") from e

    def export(self, directory: str, *args) -> None:
        self.obj.export(directory, self.savers, *args)

    def close(self) -> None:
        if hasattr(self.obj, "close"):
            self.obj.close()

    # ---- weights ----------------------------------------------------------------------------
    def _on_rank0(self, consume, kind: str = "full"):
        """`consume(pairs)` of the actor's `Actor.sync_pairs(kind)` on rank 0, and its result (None
        elsewhere). Every rank calls it (the gathers are collective under ZeRO-3): one tensor at a time, so
        that no rank materialises the whole model, or all at once with --ds.gather_for_generation; the
        same names and bytes either way."""
        named = iter(self.obj.sync_pairs(kind, per_tensor=not self.gather_for_generation))
        try:
            return consume(named) if self.rank == 0 else None
        finally:  # the gathers left (all off rank 0, any after an error), so no rank waits for this one
            for _ in named:
                pass

    def weights_hash(self) -> str | None:
        return self.obj.weights_hash(per_tensor=not self.gather_for_generation)

    def sync_layout(self, bucket_bytes: int, kind: str = "full"):
        from posttrain.trainers.rl.placement.weight_sync import sync_layout

        return self._on_rank0(lambda named: sync_layout(named, bucket_bytes), kind)

    def sync_join(self, address: str, port: int, world: int, backend: str) -> None:
        if self.rank == 0:
            # the store `listen` serves there; none: SyncGroup serves one at that port itself
            self.sync = SyncGroup(address, port, 0, world, backend, store=self._listening.pop(port, None))

    def sync_send(self, layout, kind: str = "full") -> None:
        """Every rank gathers (collective under ZeRO-3); rank 0 broadcasts the buckets as they fill."""
        self._on_rank0(lambda named: self.sync.send(named, layout), kind)

    def sync_put(self, kind: str = "full"):
        """Rank 0 puts the weights into Ray's object store as numpy; returns `[ref, bytes]` (None
        elsewhere)."""
        import ray

        def put(named):
            state = numpy_state(named)
            return [ray.put(state), sum(array.nbytes for array, _ in state.values())]
        return self._on_rank0(put, kind)


class EngineWorker(_Process):
    """A rollout engine: vLLM where this process runs it (a CUDA GPU with vLLM's CUDA build, or vLLM's CPU
    build), else the HF engine over its own copy of the policy (`rollout_backend`); with
    `--train.agent_func_path` or `--train.tool_path` it also runs agent episodes (`run_episodes`). Its
    weights come from the actor by `sync_receive` (bucketed broadcast) or `load_numpy` (object store). A
    receive with `verify` records a digest of what arrived, the hash of an engine that cannot read its
    weights back by HF name (vLLM)."""

    def setup(self, cfg: PPOConfig) -> None:
        from posttrain.config.backends import rollout_backend
        from posttrain.models import load_tokenizer
        from posttrain.trainers.rl.build import build_rollout_copy

        _ray_visible_gpu()
        tok = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer,
                             chat_template=cfg.data.tokenizer_chat_template)
        self.backend, self.why = rollout_backend(cfg)
        # HF: over its own copy of the policy on this process's device; the actor's weights arrive by sync
        self.engine = (build_vllm_engine(cfg, tok) if self.backend == "vllm"
                       else build_rollout_copy(cfg, tok, _device()))
        self.sync: SyncGroup | None = None
        self.received: WeightsDigest | None = None
        self.agents = None
        if cfg.train.agent_func_path or cfg.train.tool_path:  # the episodes run here, next to the engine
            from posttrain.agents.agent_file import load_agent_executor
            from posttrain.agents.multi_turn import AgentRunner
            from posttrain.agents.tool_env import ToolAgentExecutor, load_tool_file
            from posttrain.models.vision import vision_processor

            processor = vision_processor(cfg.actor.model_name_or_path, tok)
            agent = (load_agent_executor(cfg.train.agent_func_path) if cfg.train.agent_func_path
                     else ToolAgentExecutor(load_tool_file(cfg.train.tool_path, tok)))
            self.agents = AgentRunner.from_config(agent, self.engine, tok, None, cfg, processor=processor)

    def backend_name(self) -> tuple[str, str]:
        """("vllm" or "hf", why not vLLM)."""
        return self.backend, self.why

    def eos_token_ids(self) -> list[int] | None:
        """The engine's default stop ids (None: vLLM's own handling)."""
        return self.engine.eos_token_ids

    def generate(self, prompts, params, max_new_tokens, seeds, images=None):
        with self._released_decode_weights():
            return self.engine.generate(prompts, params, max_new_tokens=max_new_tokens, seeds=seeds,
                                        **({"images": images} if images is not None else {}))

    def run_episodes(self, prompts, params, groups: list[int]) -> list[tuple]:
        """`AgentRunner.collect` of these prompts' episodes on this engine (continuous batching on HF)."""
        with self._released_decode_weights():
            return self.agents.collect(prompts, params, groups)

    @contextlib.contextmanager
    def _released_decode_weights(self):
        """The HF engine's fast-decode fused weight copies are freed after each batch: the next weight sync
        replaces them anyway, and between batches they would hold a second copy of the linear weights in
        this process through the actor's update (2 GB at the 0.5B shape; rebuilding them costs one copy)."""
        try:
            yield
        finally:
            release = getattr(self.engine, "release_decode_weights", None)
            if release is not None:
                release()

    def sleep(self, level: int) -> dict:
        """Release the vLLM engine's memory until `wake_up` (--vllm.enable_sleep): vLLM's sleep mode on a GPU
        (level 1: KV cache freed, weights offloaded to CPU memory; 2: weights discarded too); on vLLM's CPU
        build, which has no sleep mode, the KV cache is freed (`vllm_worker`) and the weights stay. Returns
        what it freed: {"kv_cache_bytes", "rss_bytes" (this process's resident set, before - after)}."""
        from posttrain.utils.memory import current_rss

        before, kv = current_rss(), 0
        self.engine.sleep(level=level)  # on CPU vLLM frees nothing; level 2: no generate before a sync
        if not torch.cuda.is_available():
            kv = sum(self.engine.llm.collective_rpc("posttrain_release_kv_cache"))
        after = current_rss()
        return {"kv_cache_bytes": kv, "rss_bytes": (before - after) if before and after else 0}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` for `tags` ("weights", "kv_cache"; None: both), as vLLM's `wake_up`: the weights
        before a sync, the KV cache before generating."""
        self.engine.llm.wake_up(tags=tags)
        if not torch.cuda.is_available() and (tags is None or "kv_cache" in tags):
            if sum(self.engine.llm.collective_rpc("posttrain_restore_kv_cache")):
                self.engine.llm.reset_prefix_cache()  # its blocks were freed

    def weights_hash(self) -> str | None:
        own = self.engine.weights_hash()
        return own if own is not None else (self.received.hexdigest() if self.received is not None else None)

    def _update(self, named) -> None:
        """One bucket into the engine: LoRA adapter tensors (`*.lora_A/B.weight`) by `update_adapter`,
        the others by `update_weights`."""
        named = list(named)
        adapter = [(n, t) for n, t in named if is_adapter_name(n)]
        base = [(n, t) for n, t in named if not is_adapter_name(n)]
        if base or not adapter:
            self.engine.update_weights(base)
        if adapter:
            self.engine.update_adapter(adapter)

    def _loader(self, verify: bool):
        if not verify:
            self.received = None  # an older digest no longer describes the weights
            return self._update
        self.received = WeightsDigest()
        scaling = getattr(self.engine, "lora_scaling", None)

        def load(named) -> None:
            named = list(named)
            self._update(named)
            for name, tensor in named:
                self.received.add(name, tensor)
            if scaling is not None:  # as `lora_weights_hash`: base + adapter + scaling
                self.received.add("lora.scaling", torch.tensor(float(scaling), dtype=torch.float64))
        return load

    def sync_join(self, address: str, port: int, rank: int, world: int, backend: str) -> None:
        self.sync = SyncGroup(address, port, rank, world, backend)

    def _paused(self):
        """No decode step runs while the weights load (partial rollout: generation continues afterwards)."""
        return self.engine.paused() if hasattr(self.engine, "paused") else contextlib.nullcontext()

    def sync_receive(self, layout, verify: bool = False, version: int | None = None) -> None:
        """The buckets of `layout` (the actor's `sync_layout`: full, or a LoRA actor's adapter only)."""
        with self._paused():
            self.sync.receive(layout, self._loader(verify))
            self.engine.weights_updated(version)

    def load_numpy(self, arrays, verify: bool = False, version: int | None = None) -> None:
        with self._paused():
            self._loader(verify)(torch_state(arrays).items())
            self.engine.weights_updated(version)


def _ray_visible_gpu() -> None:
    """With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves every GPU visible: show this actor
    only the one Ray gave it (before CUDA initialises), as OpenRLHF does."""
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"):
        import ray

        ids = ray.get_gpu_ids()
        if ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(int(ids[0]))


def build_vllm_engine(cfg: PPOConfig, tok):
    """This worker's vLLM engine (`rollout.engine_builder.build_rollout_engine`: on its GPU or its CPU, or
    over AsyncLLM), after the refusal of tensor parallelism on a GPU."""
    from posttrain.config import ConfigError
    from posttrain.config.validate import vllm_tensor_parallel_problem
    from posttrain.rollout.engine_builder import build_rollout_engine

    problem = vllm_tensor_parallel_problem(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    if problem:  # start-up refused it where the head has a GPU; here the engine's own machine decides
        raise ConfigError(problem)
    return build_rollout_engine(cfg, tok, "vllm")
