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
    and reads `meta["global_step"]`, wraps an unloadable checkpoint in a CheckpointError and trims the
    metrics file after the resumed step;
  - optionally `checkpoint_meta()`, `postfix(metrics)` (progress-bar fields), `on_evaluated(...)`,
    `before_loop()` and `after_loop()`.
Cadence (as OpenRLHF): evaluate every `eval_steps`, log every `logging_steps` (and at every
evaluation), save every `save_steps`. With `final_eval` (SFT/RM/DPO) the last step is always
evaluated; without it (RL, as OpenRLHF's PPO) `fit` returns the latest evaluation.
Resume takes the checkpoint `CheckpointManager.prepare` chose (newest that verifies, same training
flags) and never an older or another run's one instead. Ctrl-C ends `fit` with `Interrupted`:
`interrupted at step N; last checkpoint: <path or none>`; SIGTERM with `Terminated`: `terminated at
step N; ...` (`utils/interrupt.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
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
    final_eval: bool = True
    load_checkpoint: bool = False
    progress: bool = True


class RunLoop:
    desc = "train"  # the progress bar's label

    def __init__(self, *, total_steps: int, logger: MetricsLogger, ckpt: CheckpointManager | None,
                 cadence: Cadence, is_main: bool = True) -> None:
        self.total_steps = total_steps
        self.logger = logger
        self.ckpt = ckpt
        self.cadence = cadence
        self.is_main = is_main
        self.global_step = 0

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

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {}

    def on_evaluated(self, eval_metrics: dict[str, float], metrics: dict[str, float]) -> None:
        """After an evaluation; `metrics` (this step's, to be logged) may be extended."""

    def before_loop(self) -> None:
        """After resume, before the first step."""

    def after_loop(self) -> None:
        """After the last step, still under the Ctrl-C handler (final export, charts)."""

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        meta = {"global_step": self.global_step, **self.checkpoint_meta()}
        path = self.ckpt.save(self.global_step, self.write_checkpoint, meta)
        info(f"saved checkpoint {path}")
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
            raise CheckpointError(
                f"checkpoint {path} verifies but cannot be loaded by this run ({e}); resume on the set-up that "
                f"wrote it (ranks, DeepSpeed flags), or start a new run with another --ckpt.path") from e
        self.global_step = int(meta["global_step"])
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

    def _loop(self) -> dict[str, float]:
        from tqdm.auto import tqdm

        c = self.cadence
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc=self.desc, dynamic_ncols=True,
                   disable=not (c.progress and self.is_main))
        last_eval: dict[str, float] = {}
        evaluated = False
        try:
            while self.global_step < self.total_steps:
                metrics = self.step()
                self.global_step += 1
                bar.update(1)
                bar.set_postfix(self.postfix(metrics))
                evaluated = c.eval_steps > 0 and self.global_step % c.eval_steps == 0
                if evaluated:
                    last_eval = self.evaluate()
                    metrics.update(last_eval)
                    self.on_evaluated(last_eval, metrics)
                if self.global_step % max(c.logging_steps, 1) == 0 or (evaluated and last_eval):
                    self.logger.log(self.global_step, metrics)
                if self.ckpt is not None and c.save_steps > 0 and self.global_step % c.save_steps == 0:
                    self.save_checkpoint()
        finally:
            bar.close()  # on Ctrl-C too: the error line starts on a line of its own
        if c.final_eval and not evaluated:
            last_eval = self.evaluate()
            if last_eval:
                self.logger.log(self.global_step, last_eval)
        return last_eval


def plot_charts(output_dir: Path) -> list[Path]:
    """The run's PNG charts from metrics.jsonl (`posttrain plot`); none when there is nothing to plot."""
    from posttrain.utils.plot import plot_run

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
