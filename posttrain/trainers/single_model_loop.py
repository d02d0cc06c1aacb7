"""`SingleModelLoop`: the optimizer-step loop of the single-model trainers (SFT, RM, DPO), a `RunLoop`
(`trainers/run_loop.py`) built and run by `SingleModelRun.fit` (`trainers/session.py`).

A trainer supplies an `Objective`:
  - `units(item)`: how many normalisation units a sample contributes (SFT: its target tokens);
  - optional `length(item)`: the tokens a sample puts in a micro-batch, for the token budget of
    `--train.dynamic_batch_enable` (default: `len(item["input_ids"])`; RM/DPO: both sides of a pair);
  - `collate(items)`: a micro-batch;
  - `loss(model, batch, num_units) -> (loss, sums)`: the micro-batch's share of the step loss,
    already divided by `num_units` = the units of the WHOLE step (all micro-batches, all ranks), so
    the step loss is the plain sum of micro-batch losses — identical whatever the split
    (docs/algorithms.md, "Loss aggregation"). `sums` are additive statistics (floats) summed over
    micro-batches and ranks and logged divided by their `*_count` partner when one exists; a `*_sqsum` partner
    (sum of squares) adds the sample standard deviation (`x_sum`, `x_sqsum`, `x_count` are logged
    as `x_mean` and `x_std`);
  - optional `prepare(model, rows: StepRows)`: called before a step's (or an evaluation's) micro-batches
    run, with all of its rows, for what the loss needs from the whole step (KTO's KL estimate).
The loop owns data order, micro-batching, rank padding for ZeRO-3 and its checkpoint state (weights,
optimizer, scheduler, step counters and per-rank RNG); the step / eval / log / save / resume cadence
and Ctrl-C come from the loop every trainer shares (`trainers/run_loop.RunLoop`).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from posttrain.models.context_parallel import traffic as cp_traffic
from posttrain.models.moe import take_router_loss
from posttrain.trainers import batching
from posttrain.trainers.run_loop import Cadence, RunLoop
from posttrain.utils.checkpoint import CheckpointManager, load_state_file, save_state_file
from posttrain.utils.log import info
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.seeding import rng_state, set_rng_state


class Objective(Protocol):
    def units(self, item: dict) -> int: ...
    def collate(self, items: list[dict]) -> dict: ...
    def loss(self, model, batch: dict, num_units: float) -> tuple[torch.Tensor, dict[str, float]]: ...


@dataclass
class StepRows:
    """A step's rows as `Objective.prepare` sees them: `order` the rows of the step on every rank (indices
    into `items`, in the step's order; an evaluation: the evaluated rows), `groups` this rank's
    micro-batches, `n_micro` the micro-batches every rank runs (a rank with fewer re-runs its first one:
    ZeRO-3 gathers parameters in each forward, so every rank makes as many), `to_device(batch)` a collated
    batch on the device (this rank's slice of it with context parallelism), `all_reduce(sums)` a dict of sums
    over the ranks."""

    items: list[dict]
    order: list[int]
    groups: list[list[int]]
    n_micro: int
    to_device: Callable[[dict], dict]
    all_reduce: Callable[[dict[str, float]], dict[str, float]]


def evaluated_rows(n: int, dp_size: int) -> int:
    """The eval rows an evaluation runs: the largest multiple of the data-parallel size in `n` (every rank
    the same number)."""
    return n - n % dp_size


@dataclass
class LoopSettings:
    batch_size: int
    micro_batch_size: int
    max_epochs: int
    seed: int
    max_tokens: int | None = None  # set => dynamic batching: a micro-batch's token budget (ring x TP GPUs)
    logging_steps: int = 1
    eval_steps: int = -1
    save_steps: int = -1
    ckpt_path: str | None = None
    ckpt_max_num: int = 3
    ckpt_max_mem_gb: float = math.inf
    ckpt_disable_ds: bool = False
    load_checkpoint: bool = False
    save_hf: bool = False
    progress: bool = True
    context: object = None  # `models.parallel_groups.ContextGroups` (context parallelism), or None
    router_loss_coef: float = 0.0  # the MoE router loss's coefficient in force: joins each micro-batch's loss
    # `models.parallel_groups.ParallelLayout` of the run's ranks (None: each its own samples)
    layout: object = None


def _to_device(batch: dict, device) -> dict:
    """The batch's tensors, and those of a dict inside it (a vision batch's `image_inputs`), on `device`."""
    def move(v):
        if isinstance(v, dict):
            return {k: move(t) for k, t in v.items()}
        return v.to(device) if isinstance(v, torch.Tensor) else v
    return {k: move(v) for k, v in batch.items()}


def summarize(sums: dict[str, float], prefix: str) -> dict[str, float]:
    """`x_sum`/`x_count` pairs become the mean `prefix/x`; with `x_sqsum` too, `prefix/x_mean` and
    the sample std `prefix/x_std` = sqrt((Σx² − n·mean²) / (n − 1)); other sums are reported as they are."""
    out = {}
    for key, value in sums.items():
        if key.endswith(("_count", "_sqsum")):
            continue
        if key.endswith("_sum"):
            base = key[: -len("_sum")]
            count = sums.get(f"{base}_count", 0.0)
            mean = value / count if count else float("nan")
            if f"{base}_sqsum" not in sums:
                out[f"{prefix}/{base}"] = mean
                continue
            out[f"{prefix}/{base}_mean"] = mean
            var = (sums[f"{base}_sqsum"] - count * mean * mean) / (count - 1) if count > 1 else float("nan")
            out[f"{prefix}/{base}_std"] = math.sqrt(max(var, 0.0)) if var == var else var
        else:
            out[f"{prefix}/{key}"] = value
    return out


class SingleModelLoop(RunLoop):
    higher_is_better = False  # `metric_key`: the evaluation loss
    def __init__(self, *, engine, objective: Objective, train_items: list[dict],
                 eval_items: list[dict] | None, settings: LoopSettings, logger: MetricsLogger,
                 save_hf: Callable[[Path], None] | None = None, device=None,
                 ckpt: CheckpointManager | None = None) -> None:
        """`ckpt`: the run's checkpoint manager, already `prepare`d before the model loaded
        (`posttrain.trainers.run_folders.claim_run_folders`); without it one is
        made from `settings.ckpt_path`."""
        self.engine = engine
        self.obj = objective
        self.train_items = train_items
        self.eval_items = eval_items or []
        self.s = settings
        self.save_hf = save_hf
        self.device = device or torch.device("cpu")
        length = getattr(objective, "length",
                         None) or (lambda it: len(it["input_ids"]) if "input_ids" in it else 1)
        self.lengths = [length(it) for it in train_items]
        self.steps_per_epoch = batching.steps_per_epoch(len(train_items), settings.batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the training set has {len(train_items)} samples, fewer than one global batch "
                f"(--train.batch_size {settings.batch_size}); lower --train.batch_size or add data")
        dropped = len(train_items) - self.steps_per_epoch * settings.batch_size
        if dropped:
            info(f"{dropped} samples per epoch do not fill a whole batch of {settings.batch_size} and are "
                 f"skipped")
        if ckpt is not None:
            ckpt.is_main, ckpt.barrier = engine.is_main, engine.barrier
        elif settings.ckpt_path and not settings.ckpt_disable_ds:
            ckpt = CheckpointManager(settings.ckpt_path, max_num=settings.ckpt_max_num,
                                     max_mem_gb=settings.ckpt_max_mem_gb, is_main=engine.is_main,
                                     barrier=engine.barrier)
        cadence = Cadence(logging_steps=settings.logging_steps, eval_steps=settings.eval_steps,
                          save_steps=settings.save_steps, load_checkpoint=settings.load_checkpoint,
                          progress=settings.progress, save_hf=settings.save_hf and save_hf is not None)
        super().__init__(total_steps=self.steps_per_epoch * settings.max_epochs, logger=logger, ckpt=ckpt,
                         cadence=cadence, is_main=engine.is_main)

    # ---- one optimizer step -------------------------------------------------------------
    def _step_micro_batches(self, epoch: int, step_in_epoch: int) -> tuple[list[int], list[list[int]]]:
        """(the step's rows on all ranks, this rank's micro-batches of them)."""
        order = batching.epoch_order(len(self.train_items), self.s.seed, epoch)
        step_idx = order[step_in_epoch * self.s.batch_size:(step_in_epoch + 1) * self.s.batch_size]
        mine = batching.rank_slice(step_idx, *self._data_rank())
        return [int(i) for i in step_idx], batching.micro_batches(
            mine, self.lengths, micro_batch_size=self.s.micro_batch_size, max_tokens=self.s.max_tokens)

    def _data_rank(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, their number): the ranks of a context- or tensor-parallel group
        take the same samples (`ParallelLayout`)."""
        layout = self.s.layout
        if layout is None:
            return self.engine.rank, self.engine.world_size
        return layout.coordinates(self.engine.rank)[0], layout.data

    def _all_reduce_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """Sums over the ranks; the ranks of a tensor-parallel group computed the same ones (counted once)."""
        if self.engine.world_size == 1:
            return sums
        keys = sorted(sums)
        t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=self.device)
        t = self.engine.all_reduce(t, op="sum") / (self.s.layout.tensor if self.s.layout is not None else 1)
        return dict(zip(keys, t.tolist()))

    def _device_batch(self, batch: dict) -> dict:
        """A collated batch on the device; with context parallelism, this rank's slice of the packed row."""
        batch = _to_device(batch, self.device)
        return self.s.context.shard(batch) if self.s.context is not None else batch

    def _run_micro_batches(self, groups: list[list[int]], items: list[dict], train: bool,
                           order: list[int]) -> dict[str, float]:
        """Forward (and backward when training) every micro-batch of one step, whose rows on all ranks are
        `order` (after the objective's `prepare`, when it has one); return global sums."""
        units = float(sum(self.obj.units(items[i]) for g in groups for i in g))
        if self.engine.world_size > 1:
            units = float(self.engine.all_reduce(torch.tensor([units], dtype=torch.float64,
                                                              device=self.device))[0])
            # a context-/tensor-parallel group counted alike
            units /= self.engine.world_size // self._data_rank()[1]
            n_micro = int(self.engine.all_reduce(torch.tensor([len(groups)], device=self.device),
                                                 op="max")[0])
        else:
            n_micro = len(groups)
        sums: dict[str, float] = {}
        model = self.engine.model  # the wrapper that keeps DeepSpeed's micro-step bookkeeping
        if hasattr(self.obj, "prepare"):
            with torch.no_grad():
                self.obj.prepare(model, StepRows(items, order, groups, n_micro, self._device_batch,
                                                 self._all_reduce_sums))
        for k in range(n_micro):
            # ranks with fewer micro-batches re-run their first one with zero weight, so every rank
            # makes the same number of forward/backward calls (ZeRO-3 gathers parameters in each)
            real = k < len(groups)
            batch = self._device_batch(self.obj.collate([items[i] for i in groups[k if real else 0]]))
            with torch.set_grad_enabled(train):
                loss, stats = self.obj.loss(model, batch, max(units, 1.0))
                loss = self._with_router_loss(model, loss, stats, groups[k] if real else [], items, units)
            if not real:
                loss = loss * 0.0
            if train:
                self.engine.backward(loss)
            if real:
                for key, v in stats.items():
                    sums[key] = sums.get(key, 0.0) + float(v)
        return self._all_reduce_sums(sums)

    def _with_router_loss(self, model, loss, stats: dict, group: list[int], items: list[dict], units: float):
        """`loss` + coef x the MoE router loss of the micro-batch's forward (`models.moe`), weighted by the
        micro-batch's share of the step's units (its target tokens or pairs), so the step adds the
        units-weighted mean of the micro-batches' router losses; logged as `aux_loss` (that mean)."""
        aux = take_router_loss(model) if self.s.router_loss_coef > 0 else None
        if aux is None:
            return loss
        mine = float(sum(self.obj.units(items[i]) for i in group))
        stats.update(aux_loss_sum=float(aux.detach()) * mine, aux_loss_count=mine)
        # each rank's router loss is its slice's
        ring = self.s.context.size if self.s.context is not None else 1
        return loss + self.s.router_loss_coef * aux * (mine / max(units, 1.0)) / ring

    def evaluate(self, items: list[dict] | None = None, prefix: str = "eval") -> dict[str, float]:
        """The objective's statistics over `items` (default: the eval set) without training."""
        items = self.eval_items if items is None else items
        if not items:
            return {}
        self.engine.module.eval()
        dp_rank, dp_size = self._data_rank()
        n = evaluated_rows(len(items), dp_size)
        idx = batching.rank_slice(torch.arange(n).numpy(), dp_rank, dp_size)
        groups = batching.micro_batches(idx, None, micro_batch_size=self.s.micro_batch_size)
        sums = self._run_micro_batches(groups, items, train=False, order=list(range(n)))
        self.engine.module.train()
        return summarize(sums, prefix)

    # ---- RunLoop's hooks (trainers/run_loop.py) ---------------------------------------------
    def step(self) -> dict[str, float]:
        epoch, step_in_epoch = divmod(self.global_step, self.steps_per_epoch)
        cp_traffic(reset=True)
        order, groups = self._step_micro_batches(epoch, step_in_epoch)
        sums = self._run_micro_batches(groups, self.train_items, train=True, order=order)
        lr = self.engine.lr  # the rate this step is taken with (step() advances the schedule)
        grad_norm = self.engine.step()
        metrics = summarize(sums, "train")
        metrics.update({"train/lr": lr, "train/grad_norm": grad_norm,
                        "train/epoch": epoch + (step_in_epoch + 1) / self.steps_per_epoch,
                        "train/micro_batches": len(groups)})
        if self.s.context is not None:  # what the ring costs: this rank's collectives in the step
            moved = cp_traffic()
            metrics.update({"comm/cp_bytes": moved["bytes"], "comm/cp_seconds": moved["seconds"]})
        return metrics

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {k.split("/")[-1]: f"{v:.4g}" for k, v in metrics.items()
                if k in ("train/loss", "train/lr", "train/acc")}

    def before_loop(self) -> None:
        self.engine.module.train()

    def write_checkpoint(self, d: Path) -> None:
        self.engine.save_state(d / "engine")
        save_state_file({"rng": rng_state()}, d / f"trainer_rank{self.engine.rank}.pt")

    def export_hf(self, d: Path) -> None:
        self.save_hf(d)

    def metric_key(self, eval_metrics: dict[str, float]) -> str | None:
        """The evaluation loss ranks checkpoints (lower is better)."""
        return "eval/loss" if "eval/loss" in eval_metrics else None

    def checkpoint_meta(self) -> dict:
        return {"steps_per_epoch": self.steps_per_epoch, "world_size": self.engine.world_size,
                "batch_size": self.s.batch_size}

    def restore(self, path: Path, meta: dict) -> None:
        if meta.get("batch_size") != self.s.batch_size or meta.get("world_size") != self.engine.world_size:
            info(f"checkpoint {path} was written with batch size {meta.get('batch_size')} on "
                 f"{meta.get('world_size')} ranks; this run uses {self.s.batch_size} on "
                 f"{self.engine.world_size} — resuming its weights and counters, data order may differ")
        rng_file = path / f"trainer_rank{self.engine.rank}.pt"
        rng = load_state_file(rng_file)["rng"] if rng_file.exists() else None  # before the engine's files
        self.engine.load_state(path / "engine")
        if rng is not None:
            set_rng_state(rng)
