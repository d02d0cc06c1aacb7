"""`RunLoop`: the resumable step loop every trainer runs: resume, the step / evaluate / log / checkpoint
cadence with a progress bar, Ctrl-C handling and the final charts. Its subclasses are
`SingleModelLoop` (SFT, RM, DPO; `trainers/single_model_loop.py`) and `RLTrainer` (PPO and its
estimators; `trainers/rl/ppo.py`). What happens before the loop (hardware defaults, run folders, config
echo, seed, metric sinks) is `trainers/session.RunStart`.

A trainer subclasses `RunLoop` and supplies:
  - `step() -> metrics`: one optimizer step (or one RL step) at `self.global_step`, which `RunLoop`
    then advances;
  - `evaluate() -> metrics` (`{}`: nothing to evaluate);
  - `write_checkpoint(dir)` (every rank) and `restore(path, meta)`: its own state; `RunLoop` writes
    and reads `meta["global_step"]`, `meta["metric"]`, `meta["best"]`, `meta["baseline_step"]` and
    `meta["evaluation"]` (the results of an evaluation of the checkpoint's step, which a resume does not
    repeat), wraps an unloadable checkpoint in a CheckpointError and trims the metrics file after the
    resumed step;
  - `export_hf(dir)` (every rank) with `--ckpt.save_hf`: the HF export, written to
    `<ckpt.path>/global_step<N>_hf` (atomic, never rotated);
  - `metric_key(eval_metrics)` and `higher_is_better`: the evaluation metric that ranks checkpoints
    (None: none); with `Cadence.keep_best` also `export_best(best)`;
  - optionally `checkpoint_meta()`, `postfix(metrics)` (progress-bar fields), `on_evaluated(...)`,
    `before_loop()` and `after_loop()`.
Cadence (as OpenRLHF): evaluate every `eval_steps`, log every `logging_steps` (and at every
evaluation), save every `save_steps`. Unlike OpenRLHF's PPO, the last step is always evaluated (when the
trainer has an evaluation), before its checkpoint. A checkpoint records the metric of an evaluation of
its own step (`meta["metric"]`), which rotation reads (`CheckpointManager`).
Best (`Cadence.keep_best`, RL): the starting model is evaluated first (logged at step 0) as the
baseline; an evaluation strictly better than every earlier one (the baseline included) saves the best
checkpoint `best_global_step<N>` (resumable, never rotated; whenever the run has a checkpoint folder) and
calls `export_best`. A resumed run without a recorded best takes its first evaluation as the baseline. A run
that never beats its baseline saves no best and says so. A non-finite metric is neither.
Resume takes the checkpoint `CheckpointManager.prepare` chose (newest that verifies, same training
flags) and never an older or another run's one instead. Ctrl-C ends `fit` with `Interrupted`:
`interrupted at step N; last checkpoint: <path or none>`; SIGTERM with `Terminated`: `terminated at
step N; ...` (`utils/interrupt.py`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.utils.checkpoint import CheckpointError, CheckpointManager, read_manifest
from posttrain.utils.interrupt import interrupt_as_error
from posttrain.utils.log import info
from posttrain.utils.metrics import METRICS_FILE, MetricsLogger


@dataclass
class Cadence:
    logging_steps: int = 1
    eval_steps: int = -1
    save_steps: int = -1
    load_checkpoint: bool = False
    progress: bool = True
    save_hf: bool = False  # an HF export with every checkpoint (`export_hf`)
    keep_best: bool = False  # a baseline evaluation, the best checkpoint and `export_best`


@dataclass
class EvalRecord:
    """What the loop remembers of its evaluations (and a checkpoint's meta keeps): `metric`, the latest
    checkpoint metric {"key", "value", "step", "higher_is_better"} (None: none yet); `best`, the best
    evaluation or the baseline {"key", "value", "step"}; `baseline_step`, the step of the evaluation
    the best must beat; `evaluated_at`, the step of the latest evaluation, and `last`, its results."""
    metric: dict | None = None
    best: dict = field(default_factory=lambda: {"key": None, "value": None, "step": None})
    baseline_step: int | None = None
    evaluated_at: int | None = None
    last: dict[str, float] = field(default_factory=dict)


def best_of_old_state(old: dict | None) -> dict | None:
    """The best evaluation as checkpoints from before `meta["best"]` kept it in the trainer's own state
    ({"key", "value", "step"}; {"value": -inf}: none yet), or None."""
    if not old or not isinstance(old.get("value"), (int, float)) or not math.isfinite(old["value"]):
        return None
    return {"key": old.get("key"), "value": float(old["value"]), "step": old.get("step")}


class RunLoop:
    desc = "train"  # the progress bar's label
    higher_is_better = True  # the direction of `metric_key`'s metric

    def __init__(self, *, total_steps: int, logger: MetricsLogger, ckpt: CheckpointManager | None,
                 cadence: Cadence, is_main: bool = True) -> None:
        self.total_steps = total_steps
        self.logger = logger
        self.ckpt = ckpt
        self.cadence = cadence
        self.is_main = is_main
        self.global_step = 0
        self.record = EvalRecord()

    # ---- what a trainer supplies ------------------------------------------------------------
    def step(self) -> dict[str, float]:
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        return {}

    def write_checkpoint(self, directory: Path) -> None:
        raise NotImplementedError

    def restore(self, path: Path, meta: dict) -> None:
        raise NotImplementedError

    def checkpoint_meta(self) -> dict:
        return {}

    def export_hf(self, directory: Path) -> None:
        raise NotImplementedError

    def metric_key(self, eval_metrics: dict[str, float]) -> str | None:
        """The key in `eval_metrics` that ranks checkpoints and picks the best one; None: none."""
        return None

    def export_best(self, best: dict) -> None:
        """After a new best (`Cadence.keep_best`): `best` = {"key", "value", "step"}."""

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {}

    def on_evaluated(self, eval_metrics: dict[str, float], metrics: dict[str, float]) -> None:
        """After an evaluation; `metrics` (this step's, to be logged) may be extended."""

    def before_loop(self) -> None:
        """After resume, before the first step."""

    def after_loop(self) -> None:
        """After the last step, still under the Ctrl-C handler (final export, charts)."""

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self, best: bool = False) -> Path:
        """The resumable checkpoint of this step (`best`: the best one), and with `Cadence.save_hf` (not for
        the best) its HF export next to it."""
        ev = self.record
        metric = ev.metric if ev.metric is not None and ev.metric["step"] == self.global_step else None
        meta = {"global_step": self.global_step, "metric": metric, "best": ev.best,
                "baseline_step": ev.baseline_step, **self.checkpoint_meta(),
                "evaluation": ({k: v.item() if hasattr(v, "item") else v for k, v in ev.last.items()}
                               if ev.evaluated_at == self.global_step else None)}
        path = self.ckpt.save(self.global_step, self.write_checkpoint, meta, best=best)
        info(f"saved {'best ' if best else ''}checkpoint {path}")
        if self.cadence.save_hf and not best:
            export = self.ckpt.save_export(f"global_step{self.global_step}_hf", self.export_hf)
            info(f"saved HF export {export}")
        return path

    def resume(self) -> None:
        """Load the checkpoint chosen when the run folders were claimed, if any (module docstring)."""
        if self.ckpt is None or not self.cadence.load_checkpoint:
            return
        path = self.ckpt.prepare(True)  # the answer `claim_run_folders` got at start-up
        if path is None:
            return
        meta = read_manifest(path)["meta"]
        try:
            self.restore(path, meta)
        except CheckpointError:  # already names the file and the fix
            raise
        except Exception as e:  # verified, same flags, yet unloadable: never fall back to another checkpoint
            why = " ".join(str(e).split())  # one line
            raise CheckpointError(
                f"checkpoint {path} verifies but cannot be loaded by this run ({why}); resume on the set-up "
                f"that wrote it (ranks, DeepSpeed flags), or start a new run with another --ckpt.path") from e
        self.global_step = int(meta["global_step"])
        # `restore` may have set the best (an older checkpoint's state)
        self.record.best = meta.get("best") or self.record.best
        # a checkpoint written before "baseline_step": a best at step 0 was the starting model's baseline
        self.record.baseline_step = meta.get("baseline_step", 0 if self.record.best["step"] == 0 else None)
        if meta.get("evaluation") is not None:  # this step was evaluated (and logged) before the save
            self.record.evaluated_at, self.record.last = self.global_step, meta["evaluation"]
        self.logger.truncate_after(self.global_step)
        info(f"resumed from {path} at step {self.global_step}")
        if self.global_step >= self.total_steps:  # e.g. a finished run resumed into another --ckpt.output_dir
            at = "at" if self.global_step == self.total_steps else "past"
            info(f"note: {path} is {at} the run's last step ({self.total_steps}); nothing is left to train, "
                 "only the final model is written")

    def interrupted_message(self, how: str = "interrupted") -> str:
        """`how` ("interrupted": Ctrl-C, "terminated": SIGTERM) at step N; last checkpoint: <path or none>."""
        last = self.ckpt.last_good if self.ckpt is not None else None
        return f"{how} at step {self.global_step}; last checkpoint: {last if last is not None else 'none'}"

    # ---- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        """Resume if asked, train to the last step; returns the last evaluation's metrics."""
        with interrupt_as_error(self.interrupted_message):
            self.resume()
            self.before_loop()
            result = self._loop()
            self.after_loop()
            return result

    def _evaluate(self, metrics: dict[str, float]) -> dict[str, float]:
        """Evaluate at this step, merge the results into `metrics` (logged by the caller) and remember the
        checkpoint metric."""
        result = self.evaluate()
        metrics.update(result)
        self.on_evaluated(result, metrics)
        self.record.evaluated_at, self.record.last = self.global_step, result
        key = self.metric_key(result) if result else None
        if key is not None:
            self.record.metric = {"key": key, "value": float(result[key]), "step": self.global_step,
                                  "higher_is_better": self.higher_is_better}
        return result

    def _track_best(self) -> None:
        """After this step's evaluation is logged: the first evaluation is the baseline; a later one strictly
        better than the best so far saves the best checkpoint and export. A non-finite value is neither."""
        m = self.record.metric
        if not self.cadence.keep_best or m is None or m["step"] != self.global_step:
            return
        if not math.isfinite(m["value"]):
            return
        b = self.record.best
        if b["value"] is not None and b["key"] == m["key"]:
            better = m["value"] > b["value"] if self.higher_is_better else m["value"] < b["value"]
            if not better:
                return
        self.record.best = {"key": m["key"], "value": m["value"], "step": self.global_step}
        if b["value"] is None or b["key"] != m["key"]:
            self.record.baseline_step = self.global_step
            info(f"baseline {m['key']} = {m['value']:.4f} at step {self.global_step}; a best model is saved "
                 f"when a later evaluation beats it")
            return
        info(f"new best {m['key']} = {m['value']:.4f} at step {self.global_step} (previous "
             f"{b['value']:.4f} at step {b['step']})")
        if self.ckpt is not None:
            self.save_checkpoint(best=True)
        self.export_best(self.record.best)

    def _report_best(self) -> None:
        b = self.record.best
        if self.cadence.keep_best and b["value"] is not None and b["step"] == self.record.baseline_step:
            what = "the starting model's" if b["step"] == 0 else "the baseline"
            info(f"no improvement: {b['key']} never rose above {what} {b['value']:.4f} "
                 f"(step {b['step']}); no best model saved")

    def _loop(self) -> dict[str, float]:
        from tqdm.auto import tqdm

        c = self.cadence
        if c.keep_best and self.global_step == 0:  # the starting model: the baseline a best must beat
            baseline: dict[str, float] = {}
            if self._evaluate(baseline):
                self.logger.log(0, baseline)
                self._track_best()
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc=self.desc, dynamic_ncols=True,
                   disable=not (c.progress and self.is_main))
        try:
            while self.global_step < self.total_steps:
                metrics = self.step()
                self.global_step += 1
                bar.update(1)
                bar.set_postfix(self.postfix(metrics))
                due = c.eval_steps > 0 and self.global_step % c.eval_steps == 0
                if due or self.global_step == self.total_steps:
                    self._evaluate(metrics)
                evaluated_now = self.record.evaluated_at == self.global_step and bool(self.record.last)
                if self.global_step % max(c.logging_steps, 1) == 0 or evaluated_now:
                    self.logger.log(self.global_step, metrics)
                self._track_best()
                if self.ckpt is not None and c.save_steps > 0 and self.global_step % c.save_steps == 0:
                    self.save_checkpoint()
        finally:
            bar.close()  # on Ctrl-C too: the error line starts on a line of its own
        # resumed at a last step not evaluated yet: evaluated here
        if self.record.evaluated_at != self.global_step:
            final: dict[str, float] = {}
            if self._evaluate(final):
                self.logger.log(self.global_step, final)
        self._report_best()
        return self.record.last


PLOTS_ENV = "POSTTRAIN_PLOTS"  # 0 (or false/no/off): a run ends without drawing its charts


def plot_charts(output_dir: Path) -> list[Path]:
    """The run's PNG charts from metrics.jsonl (`posttrain plot`); none when there is nothing to plot, or
    when `POSTTRAIN_PLOTS=0` (1-3 CPU-s a run: sweeps of short runs, the test suite)."""
    from posttrain.utils.plot import plot_run

    if os.environ.get(PLOTS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        info(f"no plots: {PLOTS_ENV}={os.environ[PLOTS_ENV]} (posttrain plot {output_dir} draws them)")
        return []
    if not (output_dir / METRICS_FILE).exists():  # a resumed run that had no step left to train
        info(f"no plots: this run logged no step to {output_dir / METRICS_FILE}")
        return []
    try:
        plots = plot_run(output_dir)
    except ValueError as e:
        info(f"no plots: {e}")
        return []
    info(f"plots: {', '.join(str(p) for p in plots)}")
    return plots
