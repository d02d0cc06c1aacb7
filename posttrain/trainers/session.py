"""How a run starts and, for the single-model trainers, how it is set up and ends:

- `RunStart` — what every trainer (SFT, RM, DPO, PPO) does first: the heap policy
  (`utils.memory.apply_heap_policy`), hardware defaults, every input path and data key checked
  (`inputs.check_inputs`), the run folders claimed (`run_folders.claim_run_folders`), seeding; then, once
  the trainer has loaded its inputs, `announce` (the echo of the flags set, config.yaml), metric sinks, and
  at the end `finish` (`run_summary.finish_run`: the summary line and summary.json);
- `SingleModelRun` — SFT/RM/DPO on top of it: tokenizer, data rows, model, train engine, the step
  loop (`single_model_loop.SingleModelLoop`, a `run_loop.RunLoop`), and the final Hugging Face export
  to `--ckpt.output_dir` (the run directory: config.yaml, metrics.jsonl, plots/ and the model all land
  there). The RL trainer (`rl/ppo.RLTrainer`) uses `RunStart` and is itself a `RunLoop`.

The run directory has one writer: `RunStart(cfg)` (inside `SingleModelRun(cfg)`) locks it (and the
checkpoint folder) and checks the checkpoint folder before it writes config.yaml or loads anything; for
SFT/RM/DPO the locks are released when `fit` returns or fails, or by `close()` (`with SingleModelRun(cfg) as
run:` releases them whatever happens in between, and a failure before training removes what the run created
in its folders: `RunStart.abandon`)."""
from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from posttrain.config import (
    SingleModelConfig,
    TrainerConfig,
    derived_sizes,
    format_set_flags,
    inert_flags,
    resolve_hardware_defaults,
    save_config,
    translation_of,
)
from posttrain.config.facts import deepspeed_only_flags
from posttrain.config.flag_values import format_value
from posttrain.config.summary import micro_batch_tokens
from posttrain.data import load_rows
from posttrain.engines import make_train_engine, num_warmup_steps
from posttrain.engines.zero3 import describe_shards, sharded_loading
from posttrain.models import load_tokenizer, save_pretrained, tensor_parallel
from posttrain.models.setup import ModelSetup
from posttrain.models.vision import export_savers, vision_processor
from posttrain.trainers.inputs import check_inputs
from posttrain.trainers.run_folders import claim_run_folders
from posttrain.trainers.run_loop import plot_charts
from posttrain.trainers.run_summary import finish_run
from posttrain.trainers.single_model_loop import LoopSettings, SingleModelLoop
from posttrain.utils.checkpoint import disk_full_as_error
from posttrain.utils.interrupt import interrupt_as_error
from posttrain.utils.log import info, rank_info
from posttrain.utils.memory import apply_heap_policy
from posttrain.utils.metrics import MetricsLogger
from posttrain.utils.seeding import set_seed


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class RunStart:
    """The start every trainer shares (SFT, RM, DPO, PPO), in this order: the device and hardware defaults
    (resolved, not yet printed); every input checked at once (`inputs.check_inputs`: one error naming
    each missing or broken model, dataset and reward file, and each data key the data files lack); the run
    directory locked and checked (`claim_run_folders`: a finished run is refused without --ckpt.overwrite);
    the seed. The trainer then loads its inputs (tokenizer, rows, each row's fields, sizes) and calls
    `announce()`, which prints the echo and writes config.yaml. A failure before training (`closed_on_error`,
    `abandon`) removes what the start created in the run folders; `close()` only releases them."""

    def __init__(self, cfg: TrainerConfig) -> None:
        apply_heap_policy()
        self.cfg = cfg
        self.device = pick_device()
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.is_main = int(os.environ.get("RANK", "0")) == 0
        self.hardware_notes = resolve_hardware_defaults(cfg, self.device.type) or []
        self.output_dir = Path(cfg.ckpt.output_dir)
        self.translation = translation_of(cfg)
        self.began: float | None = None  # when training began (`begin`); a failure after it keeps the files
        self.started = time.time()
        check_inputs(cfg)
        self.folders = claim_run_folders(cfg, is_main=self.is_main)
        with self.closed_on_error():
            set_seed(cfg.train.seed)

    def announce(self, steps: int | None = None, optimizers: tuple = ()) -> None:
        """The echo, once the inputs are loaded and checked: hardware notes, the TRL translation, the flags
        the user set and where each came from, the derived sizes, notes on flags without effect and on a
        warm-up longer than a quarter of the run (`optimizers`: (flag prefix, optimizer section) pairs that
        train for `steps` optimizer steps); then config.yaml (every flag) and the TRL report are written."""
        cfg = self.cfg
        for note in self.hardware_notes:
            info(note)
        if self.translation is not None:
            info(self.translation.report())
        info(format_set_flags(cfg, derived_sizes(cfg, self.world_size), str(self.output_dir / "config.yaml")))
        for note in inert_flags(cfg, self.device.type):
            info(f"note: {note}")
        for prefix, section in optimizers if steps else ():
            note = warmup_note(section, steps, prefix)
            if note:
                info(f"note: {note}")
        with self.closed_on_error():
            if self.is_main:
                save_config(cfg, self.output_dir / "config.yaml")
                if self.translation is not None:
                    (self.output_dir / self.translation.file).write_text(self.translation.report() + "\n",
                                                                         encoding="utf-8")

    @contextmanager
    def closed_on_error(self):
        """`abandon()` if the block raises (a set-up that fails)."""
        try:
            yield
        except BaseException:
            self.abandon()
            raise

    def open_logger(self, cfg: TrainerConfig, enabled: bool = True) -> MetricsLogger:
        """The run's metric sinks: metrics.jsonl in the run directory (continued after the resumed step
        when a checkpoint is resumed; a fresh start, also under --ckpt.load_enable with no checkpoint
        left, starts it over), TensorBoard and W&B when asked for. TensorBoard writes to
        `<--logger.tensorboard_dir>/<run name>` (`run_name`), one folder per run as in OpenRLHF."""
        name = run_name(cfg)
        tb = cfg.logger.tensorboard_dir
        return MetricsLogger(self.output_dir, tensorboard_dir=os.path.join(tb, name) if tb else None,
                             wandb=wandb_settings(cfg, name), enabled=enabled,
                             resume=self.folders.resume_from is not None)

    def close(self) -> None:
        self.folders.close()

    def begin(self) -> None:
        """Training begins: from now on a failure keeps what the run wrote (checkpoints, metrics)."""
        self.began = time.time()

    def finish(self) -> None:
        """The end of a run whose final model is saved: summary.json and the summary line (main process)."""
        if self.is_main:
            finish_run(self.cfg.trainer, self.output_dir, self.started, self.began)

    def abandon(self) -> None:
        """A failure: before training, remove what this run created in its folders (`RunFolders.abandon`)
        and release them; once training began, only release them."""
        if self.began is not None:
            self.close()
        else:
            self.folders.abandon()


def warmup_note(opt, steps: int, prefix: str = "") -> str | None:
    """The note for a learning-rate warm-up (section `opt`, flags `--{prefix}lr_warmup_*`) longer than a
    quarter of a run of `steps` optimizer steps, or None."""
    if opt.lr_scheduler == "constant" or steps < 1:
        return None
    warm = min(num_warmup_steps(steps, opt.lr_warmup_ratio, opt.lr_warmup_steps), steps)
    if warm * 4 <= steps:
        return None
    how = (f"--{prefix}lr_warmup_steps {opt.lr_warmup_steps}" if opt.lr_warmup_steps is not None
           else f"--{prefix}lr_warmup_ratio {format_value(opt.lr_warmup_ratio)}")
    return (f"lr warm-up covers {warm} of the {steps} steps ({100 * warm // steps}%, {how}): the first steps "
            "log lr near 0")


@dataclass(frozen=True)
class ExportHooks:
    """What a trainer adds to every HF export of its model: `state` maps the state dict before it is saved
    (e.g. the RM's head renamed), `extras(folder)` writes files beside it (e.g. a PRM's prm.json)."""

    state: Callable[[dict], dict] | None = None
    extras: Callable[[Path], None] | None = None


class SingleModelRun:
    """SFT/RM/DPO's run: `RunStart`, then the tokenizer and data rows; `fit` loads the model, builds the
    train engine, runs the `SingleModelLoop` and exports the final model. With --ds.zero_stage 3 over
    several ranks the model loads straight into ZeRO-3 shards (`engines.zero3.sharded_loading`): no rank
    ever holds the whole model, and each prints the share it holds."""

    def __init__(self, cfg: SingleModelConfig, head_prefix: Callable[[], str] | None = None) -> None:
        """`head_prefix`: the trained model is a score model (RM), loaded with the head prefix this returns
        (called when the model loads), and may start a new head; None: a causal LM."""
        self.cfg = cfg
        self.start = RunStart(cfg)
        start = self.start
        self.device, self.world_size, self.is_main = start.device, start.world_size, start.is_main
        self.output_dir, self.folders = self.start.output_dir, self.start.folders
        # RunStart checked the model folders and their config.json (heads vs the tensor-parallel size)
        with self.start.closed_on_error():
            self.setup = ModelSetup.of(cfg)  # after RunStart resolved the hardware defaults
            self.tokenizer = load_tokenizer(cfg.model.model_name_or_path,
                                            use_fast=not cfg.data.disable_fast_tokenizer,
                                            chat_template=cfg.data.tokenizer_chat_template)
            self.processor = vision_processor(cfg.model.model_name_or_path, self.tokenizer)
            self.train_rows = load_rows(cfg.data.dataset, cfg.data.dataset_probs, cfg.data.dataset_split,
                                        cfg.train.seed, cfg.data.max_samples)
            self.eval_rows = self._eval_rows()
        self.head_prefix = head_prefix
        self._export = ExportHooks()

    def close(self) -> None:
        """Release the run directory (idempotent); `fit` does it when it ends."""
        self.start.close()

    def __enter__(self) -> SingleModelRun:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """A failure before training (e.g. a row without a key the first rows have) leaves nothing this run
        created."""
        self.start.abandon() if exc_type is not None else self.close()

    def _eval_rows(self) -> list[dict]:
        """Rows of `--eval.dataset` (split `--eval.split`); none without it, as in OpenRLHF."""
        cfg = self.cfg
        if not cfg.eval.dataset:
            return []
        rows = load_rows(cfg.eval.dataset, None, cfg.eval.split, cfg.train.seed, cfg.data.max_samples)
        info(f"eval set: {len(rows)} rows from {cfg.eval.dataset} split '{cfg.eval.split}'")
        return rows

    def fit(self, objective, train_items: list[dict], eval_items: list[dict] | None, on_trained=None,
            export: ExportHooks | None = None) -> dict:
        """Train, then call `on_trained(loop, final_metrics)` (all ranks; e.g. RM reward statistics
        written into the model config) and export the final model to the run directory, `export`'s hooks
        applied to it and to every `--ckpt.save_hf` export. Releases the run directory however it ends."""
        self._loop = None
        self._export = export or ExportHooks()
        try:
            with interrupt_as_error(self._interrupted_message):
                return self._fit(objective, train_items, eval_items, on_trained)
        except BaseException:
            self.start.abandon()
            raise
        finally:
            self.close()

    def _interrupted_message(self, how: str = "interrupted") -> str:
        """Ctrl-C or SIGTERM outside the step loop (model loading, final export)."""
        if self._loop is not None:
            return self._loop.interrupted_message(how)
        last = self.folders.last_checkpoint()
        return f"{how} before training started; last checkpoint: {last if last is not None else 'none'}"

    def _fit(self, objective, train_items, eval_items, on_trained) -> dict:
        cfg = self.cfg
        steps = (len(train_items) // cfg.train.batch_size) * cfg.train.max_epochs
        self.start.announce(steps, (("", cfg),))
        zero_stage = cfg.ds.zero_stage if self._needs_deepspeed() else None
        setup = self.setup
        split_rows = setup.ring > 1  # context parallelism: each packed row over a group of ranks
        head = self.head_prefix is not None
        built = setup.build(cfg.model.model_name_or_path, "policy", head=head, new_head_ok=head,
                            head_prefix=self.head_prefix() if head else None,
                            device=self.device if self.world_size == 1 else None,
                            sharding=sharded_loading(cfg.ds, zero_stage), split_rows=split_rows)
        model = built.model
        if built.sharded:  # ZeRO-3 over several ranks: each holds its shard; the engine gathers per layer
            rank_info(describe_shards("model", model))
        engine = make_train_engine(model, cfg, total_steps=max(steps, 1), ds=cfg.ds, zero_stage=zero_stage,
                                   tensor_parallel=setup.tensor)
        built = setup.parallel(built, engine.rank, engine.world_size, split_rows=split_rows)
        layout = built.layout
        if layout.world > 1 and layout.data < layout.world:
            info(f"parallel layout: {layout.describe()}")
        if layout.tensor > 1 and torch.distributed.get_process_group_ranks(engine.tensor_group) not in \
                layout.tensor_groups():
            raise RuntimeError("DeepSpeed's tensor-parallel groups are not the run's layout "
                               "(consecutive ranks)")
        logger = self.start.open_logger(cfg, enabled=engine.is_main)
        ckpt = self.folders.ckpt
        settings = LoopSettings(
            batch_size=cfg.train.batch_size, micro_batch_size=cfg.train.micro_batch_size,
            max_epochs=cfg.train.max_epochs, seed=cfg.train.seed,
            max_tokens=micro_batch_tokens(cfg, cfg.train.max_tokens_per_gpu)
            if cfg.train.dynamic_batch_enable else None,
            logging_steps=cfg.logger.logging_steps, eval_steps=cfg.eval.steps, save_steps=cfg.ckpt.save_steps,
            ckpt_path=str(ckpt.root) if ckpt is not None else None, ckpt_max_num=cfg.ckpt.max_num,
            ckpt_max_mem_gb=cfg.ckpt.max_mem if cfg.ckpt.max_mem is not None else math.inf,
            ckpt_disable_ds=cfg.ckpt.disable_ds, load_checkpoint=cfg.ckpt.load_enable,
            save_hf=cfg.ckpt.save_hf,
            context=built.context, router_loss_coef=built.router_loss_coef, layout=layout)
        loop = SingleModelLoop(engine=engine, objective=objective, train_items=train_items,
                               eval_items=eval_items, settings=settings, logger=logger,
                               save_hf=lambda d: self.export_hf(engine, d), device=self.device, ckpt=ckpt)
        self._loop = loop
        self.start.begin()
        try:
            final = loop.fit()
        finally:
            logger.close()
        if setup.tensor > 1:  # what each rank held: its share of the weights and optimizer state
            rank_info(tensor_parallel.describe(engine.module, built.loaded_numel[1], setup.tensor,
                                               engine.optimizer))
        if on_trained is not None:
            on_trained(loop, final)
        with disk_full_as_error("the final model", self.output_dir, self.folders.last_checkpoint()):
            self.export_hf(engine, self.output_dir)
        if engine.is_main:
            plot_charts(self.output_dir)
            info(f"final model saved to {self.output_dir}")
            self.start.finish()
        if self.world_size > 1:  # a launcher's process: end its process group before the interpreter exits
            from posttrain.engines.dist import shutdown

            shutdown()
        return final

    def _needs_deepspeed(self) -> bool:
        """One process uses the plain torch engine (no DeepSpeed start-up) unless a DeepSpeed-only
        feature is asked for; several processes always use DeepSpeed with --ds.zero_stage."""
        return self.world_size > 1 or bool(deepspeed_only_flags(self.cfg.ds))

    def export_hf(self, engine, out_dir) -> None:
        """Write a `from_pretrained`-loadable model (all ranks call; ZeRO-3 gathers on rank 0)."""
        state = engine.full_state_dict() if hasattr(engine, "full_state_dict") else None
        if engine.is_main:
            hooks = self._export
            if hooks.state is not None:
                state = hooks.state(state if state is not None else engine.module.state_dict())
            savers = export_savers(self.tokenizer, self.processor)
            save_pretrained(engine.module, savers, out_dir, state_dict=state)
            if hooks.extras is not None:
                hooks.extras(out_dir)
        engine.barrier()


def run_name(cfg: TrainerConfig) -> str:
    """The run's name in TensorBoard and W&B: --logger.wandb.run_name, else OpenRLHF's default
    `<trainer>_<MMDDTHH:MM>` (local time now)."""
    return cfg.logger.wandb.run_name or f"{cfg.trainer}_{datetime.now():%m%dT%H:%M}"


def wandb_settings(cfg: TrainerConfig, name: str) -> dict:
    w = cfg.logger.wandb
    return {"key": w.key, "org": w.org, "group": w.group, "project": w.project, "run_name": name}
