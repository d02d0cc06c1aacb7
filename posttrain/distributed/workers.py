"""The processes of a Ray placement: `RoleWorker` (one rank of the actor, critic, reference or
reward-model group) and `EngineWorker` (one rollout engine). Plain classes, made Ray actors by
`ray_placement` with `ray.remote(cls)`; each builds its role with the same code as the in-process
trainer (`trainers.rl.build`), then serves the role's batch methods on numpy experience."""
from __future__ import annotations

import os
import socket

import numpy as np
import torch

from posttrain.distributed.transport import experience_from_numpy
from posttrain.distributed.weight_sync import SyncGroup, weights_hash


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port on it (a rendezvous point for a process group)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def numpy_state(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """A state dict as numpy arrays (bf16 travels as its int16 bit pattern) with their dtypes."""
    out = {}
    for k, t in state.items():
        t = t.detach().to("cpu").contiguous()
        out[k] = ((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy(), str(t.dtype))
    return out


def torch_state(arrays: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for k, (a, dtype) in arrays.items():
        t = torch.from_numpy(np.array(a))
        out[k] = t.view(torch.bfloat16) if dtype == "torch.bfloat16" else t
    return out


class _Process:
    def __init__(self, threads: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        torch.set_num_threads(max(1, threads))

    def pid(self) -> int:
        return os.getpid()

    def address(self) -> tuple[str, int]:
        return free_address()


class RoleWorker(_Process):
    """Rank `rank` of `world` of a role ("actor", "critic", "ref", "reward"); the ranks of a
    trained role form a torch.distributed group (`master`: rank 0's address) for DeepSpeed."""

    def __init__(self, role: str, rank: int, world: int, master: tuple[str, int] | None, threads: int,
                 env: dict[str, str]) -> None:
        env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
        if master is not None:
            env.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        super().__init__(threads, env)
        self.role, self.rank, self.world = role, rank, world
        self.obj = None
        self.sync: SyncGroup | None = None

    def set_master(self, master: tuple[str, int]) -> None:
        os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))

    def setup(self, cfg, total_steps: int) -> None:
        from posttrain.models import load_tokenizer
        from posttrain.trainers.rl import build

        self.tokenizer = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer,
                                        chat_template=cfg.data.tokenizer_chat_template)
        device = _device()
        zero = cfg.ds.zero_stage if self.world > 1 else None  # one rank: the in-process engine
        if self.role == "actor":
            self.obj = build.build_actor(cfg, self.tokenizer, device, total_steps, zero)
        elif self.role == "critic":
            self.obj = build.build_critic(cfg, self.tokenizer, device, total_steps, zero)
        elif self.role == "ref":
            self.obj = build.build_reference(cfg, self.tokenizer, device)
        elif self.role == "reward":
            self.obj = build.build_reward_source(cfg, self.tokenizer, device)
        else:
            raise ValueError(f"unknown role {self.role!r}")

    # ---- batch methods ----------------------------------------------------------------------
    def _shard(self, arrays, rows: list[int]):
        exp = experience_from_numpy(arrays)
        return exp.select(rows if rows else [0])

    def logprobs(self, arrays, rows: list[int], batching) -> np.ndarray:
        return self.obj.logprobs(self._shard(arrays, rows), batching).numpy()[: len(rows)]

    def values(self, arrays, rows: list[int], batching) -> np.ndarray:
        return self.obj.values(self._shard(arrays, rows), batching).numpy()[: len(rows)]

    def fit(self, arrays, step_rows: list[list[int]], settings, *args) -> tuple[dict, dict]:
        """This rank's metrics and their weights (tokens), for `ray_placement.merge_metrics`."""
        exp = experience_from_numpy(arrays)
        weights: dict = {}
        return self.obj.fit(exp, settings, *args, step_rows=step_rows, weights_out=weights), weights

    def score_tokens(self, sequences: list[list[int]]):
        return self.obj.score_tokens(sequences)

    def save_state(self, directory: str) -> None:
        self.obj.save_state(directory)

    def load_state(self, directory: str, *args) -> None:
        from posttrain.utils.checkpoint import CheckpointError

        try:
            self.obj.load_state(directory, *args)
        except Exception as e:  # one line for the user (e.g. other rank counts than the checkpoint's)
            raise CheckpointError(f"{self.role} rank {self.rank} cannot load {directory}: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from e

    def export(self, directory: str, *args) -> None:
        self.obj.export(directory, self.tokenizer, *args)

    def close(self) -> None:
        if hasattr(self.obj, "close"):
            self.obj.close()

    # ---- weights ----------------------------------------------------------------------------
    def weights_hash(self) -> str | None:
        state = self.obj.full_state_dict()
        return None if state is None else weights_hash(state)

    def sync_layout(self, bucket_bytes: int):
        from posttrain.distributed.weight_sync import sync_layout

        state = self.obj.full_state_dict()
        return None if state is None else sync_layout(state, bucket_bytes)

    def sync_join(self, address: str, port: int, world: int, backend: str) -> None:
        if self.rank == 0:
            self.sync = SyncGroup(address, port, 0, world, backend)

    def sync_send(self, layout) -> None:
        """Every rank gathers (collective under ZeRO-3); rank 0 broadcasts the buckets."""
        state = self.obj.full_state_dict()
        if self.rank == 0:
            self.sync.send(state, layout)

    def sync_put(self):
        """Rank 0 puts the weights into Ray's object store as numpy; returns `[ref]` (None elsewhere)."""
        import ray

        state = self.obj.full_state_dict()
        return None if state is None else [ray.put(numpy_state(state))]


class EngineWorker(_Process):
    """A rollout engine: the HF engine over its own copy of the policy (the vLLM engine is wired in
    with the async trainer); its weights come from the actor by `sync_receive` / `load_numpy`."""

    def setup(self, cfg) -> None:
        from posttrain.engines.rollout import HFRolloutEngine
        from posttrain.models import load_causal_lm, load_tokenizer

        tok = load_tokenizer(cfg.actor.model_name_or_path, use_fast=not cfg.data.disable_fast_tokenizer,
                             chat_template=cfg.data.tokenizer_chat_template)
        model = load_causal_lm(cfg.actor.model_name_or_path, dtype=cfg.ds.param_dtype, tokenizer=tok,
                               attn_implementation=cfg.ds.attn_implementation)
        model.requires_grad_(False)
        self.model = model.to(_device()).eval()
        self.engine = HFRolloutEngine(self.model, tok, pad_token_id=tok.pad_token_id)
        self.sync: SyncGroup | None = None
        self.layout = None

    def generate(self, prompts, params, max_new_tokens, seeds):
        return self.engine.generate(prompts, params, max_new_tokens=max_new_tokens, seeds=seeds)

    def weights_hash(self) -> str:
        return weights_hash(self.model.state_dict())

    def _load(self, named) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in named:
                own[name].copy_(tensor)

    def sync_join(self, address: str, port: int, rank: int, world: int, backend: str, layout) -> None:
        self.layout = layout
        self.sync = SyncGroup(address, port, rank, world, backend)

    def sync_receive(self) -> None:
        self.sync.receive(self.layout, self._load)

    def load_numpy(self, arrays) -> None:
        self._load(torch_state(arrays).items())
