"""The resumable step loop every trainer shares (trainers/run_loop.RunLoop): cadence, resume, Ctrl-C."""
from __future__ import annotations

import json
import shutil
import signal
import threading

import pytest

from posttrain.trainers.run_loop import Cadence, RunLoop
from posttrain.utils.checkpoint import CheckpointError, CheckpointManager, read_manifest
from posttrain.utils.interrupt import Interrupted
from posttrain.utils.metrics import MetricsLogger


class Counter(RunLoop):
    """A trainer whose state is one number: each step adds the step index."""

    def __init__(self, run_dir, total, cadence, ckpt=None, fail_restore=False):
        super().__init__(total_steps=total, logger=MetricsLogger(run_dir, resume=cadence.load_checkpoint),
                         ckpt=ckpt, cadence=cadence)
        self.value, self.evals, self.fail_restore = 0, [], fail_restore
        self.events = []

    def step(self):
        self.value += self.global_step
        return {"train/value": float(self.value)}

    def evaluate(self):
        self.evals.append(self.global_step)
        return {"eval/value": float(self.value)}

    def on_evaluated(self, eval_metrics, metrics):
        metrics["eval/extra"] = 1.0

    def write_checkpoint(self, d):
        (d / "state.json").write_text(json.dumps({"value": self.value}))

    def restore(self, path, meta):
        if self.fail_restore:
            raise OSError("truncated file")
        self.value = json.loads((path / "state.json").read_text())["value"]

    def before_loop(self):
        self.events.append(("before", self.global_step))

    def after_loop(self):
        self.events.append(("after", self.global_step))


def logged(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_cadence_logs_evaluates_and_saves_on_their_steps(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ck", max_num=5)
    loop = Counter(tmp_path, 7, Cadence(logging_steps=3, eval_steps=2, save_steps=4), ckpt)
    result = loop.fit()
    assert loop.value == sum(range(7))
    assert loop.evals == [2, 4, 6, 7]  # and the last step
    rows = logged(tmp_path)
    # logged on multiples of 3 and at every evaluation, never twice
    assert [r["step"] for r in rows] == [2, 3, 4, 6, 7]
    assert all(("eval/value" in r) == (r["step"] % 2 == 0 or r["step"] == 7) for r in rows)
    assert rows[0]["eval/extra"] == 1.0
    assert sorted(p.name for p in (tmp_path / "ck").glob("global_step*")) == ["global_step4"]
    assert result == {"eval/value": float(sum(range(7)))}  # the last step's evaluation
    assert loop.events == [("before", 0), ("after", 7)]


def test_the_last_step_is_evaluated_once(tmp_path):
    loop = Counter(tmp_path, 4, Cadence(eval_steps=3))
    assert loop.fit() == {"eval/value": float(sum(range(4)))}
    assert loop.evals == [3, 4]
    loop2 = Counter(tmp_path / "b", 4, Cadence(eval_steps=2))
    loop2.fit()
    assert loop2.evals == [2, 4]  # the last step was evaluated by the cadence: not again


class Scored(Counter):
    """Evaluations score the model by `scores[step]`; the best export is recorded."""

    def __init__(self, *args, scores, **kw):
        super().__init__(*args, **kw)
        self.scores, self.exports = scores, []

    def evaluate(self):
        self.evals.append(self.global_step)
        return {"eval/score": self.scores[self.global_step]}

    def metric_key(self, eval_metrics):
        return "eval/score"

    def export_best(self, best):
        self.exports.append(dict(best))


def test_no_best_is_saved_when_nothing_beats_the_starting_model(tmp_path, capsys):
    ckpt = CheckpointManager(tmp_path / "ck", max_num=5)
    loop = Scored(tmp_path, 4, Cadence(eval_steps=2, save_steps=2, keep_best=True), ckpt, scores=[0.0] * 5)
    loop.fit()
    assert loop.evals == [0, 2, 4]  # the starting model first: the baseline
    assert [r["step"] for r in logged(tmp_path) if "eval/score" in r] == [0, 2, 4]
    assert loop.exports == [] and not list((tmp_path / "ck").glob("best*"))
    err = capsys.readouterr().err
    assert "no improvement: eval/score never rose above the starting model's 0.0000 (step 0)" in err


def test_best_checkpoint_is_resumable_and_outlives_rotation(tmp_path):
    scores = [0.1, 0.0, 0.5, 0.0, 0.3, 0.0, 0.7, 0.0, 0.7]
    ckpt = CheckpointManager(tmp_path / "ck", max_num=1)
    loop = Scored(tmp_path / "a", 8, Cadence(eval_steps=2, save_steps=2, keep_best=True), ckpt, scores=scores)
    loop.fit()
    assert [e["step"] for e in loop.exports] == [2, 6]  # strictly better than every earlier evaluation only
    names = sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith("."))
    assert names == ["best_global_step6", "global_step8"]  # the earlier best replaced; max_num: regular ones
    best_meta = read_manifest(tmp_path / "ck" / "best_global_step6")["meta"]
    assert best_meta["best"] == {"key": "eval/score", "value": 0.7, "step": 6}
    assert best_meta["metric"] == {"key": "eval/score", "value": 0.7, "step": 6, "higher_is_better": True}
    shutil.rmtree(tmp_path / "ck" / "global_step8")  # the best is the newest left: resume takes it
    cadence = Cadence(eval_steps=2, save_steps=2, keep_best=True, load_checkpoint=True)
    resumed = Scored(tmp_path / "a", 8, cadence, CheckpointManager(tmp_path / "ck", max_num=1), scores=scores)
    resumed.fit()
    assert resumed.events[0] == ("before", 6) and resumed.value == loop.value
    assert resumed.evals == [8] and resumed.exports == []  # 0.7 again is no improvement on the restored best


def test_resume_restores_state_and_trims_the_metrics_file(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ck", max_num=5)
    Counter(tmp_path / "a", 6, Cadence(save_steps=2), ckpt).fit()
    full = Counter(tmp_path / "full", 6, Cadence())
    full.fit()
    shutil.rmtree(tmp_path / "ck" / "global_step6")  # as if the run had died in step 5
    resumed_dir = tmp_path / "a"
    resumed = Counter(resumed_dir, 6, Cadence(save_steps=2, load_checkpoint=True),
                      CheckpointManager(tmp_path / "ck", max_num=5))
    resumed.fit()
    assert resumed.events[0] == ("before", 4)
    assert resumed.value == full.value
    assert [r["step"] for r in logged(resumed_dir)] == [1, 2, 3, 4, 5, 6]


def test_an_unloadable_checkpoint_is_a_checkpoint_error_naming_it(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ck")
    Counter(tmp_path, 2, Cadence(save_steps=2), ckpt).fit()
    broken = Counter(tmp_path, 4, Cadence(load_checkpoint=True), CheckpointManager(tmp_path / "ck"),
                     fail_restore=True)
    with pytest.raises(CheckpointError, match=r"global_step2 verifies but cannot be loaded by this run "
                                              r"\(truncated file\)"):
        broken.fit()
    assert (tmp_path / "ck" / "global_step2" / "state.json").exists()  # never lost


@pytest.fixture
def ctrl_c_enabled():
    """A shell that starts the suite in the background hands it SIGINT ignored; Ctrl-C means
    the default here."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.slow
def test_ctrl_c_names_the_step_and_the_last_checkpoint(tmp_path, ctrl_c_enabled):
    ckpt = CheckpointManager(tmp_path / "ck")

    class Slow(Counter):
        def step(self):
            if self.global_step == 3:
                threading.Timer(0.05, lambda: signal.raise_signal(signal.SIGINT)).start()
                threading.Event().wait(5)
            return super().step()

    with pytest.raises(Interrupted, match=r"interrupted at step 3; last checkpoint: .*global_step2"):
        Slow(tmp_path, 6, Cadence(save_steps=2), ckpt).fit()


def test_resuming_a_finished_run_does_not_evaluate_its_last_step_again(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ck", max_num=5)
    first = Counter(tmp_path, 4, Cadence(eval_steps=2, save_steps=4), ckpt)
    result = first.fit()
    resumed = Counter(tmp_path, 4, Cadence(eval_steps=2, save_steps=4, load_checkpoint=True),
                      CheckpointManager(tmp_path / "ck", max_num=5))
    assert resumed.fit() == result == {"eval/value": float(sum(range(4)))}  # the checkpoint's evaluation
    assert resumed.evals == []
    assert [r["step"] for r in logged(tmp_path) if "eval/value" in r] == [2, 4]


def test_zero_steps_evaluate_the_baseline_once(tmp_path):
    loop = Scored(tmp_path, 0, Cadence(keep_best=True), scores=[0.5])
    assert loop.fit() == {"eval/score": 0.5}
    assert loop.evals == [0] and [r["step"] for r in logged(tmp_path)] == [0]


def test_a_nan_evaluation_is_neither_baseline_nor_best(tmp_path):
    nan = float("nan")
    loop = Scored(tmp_path, 4, Cadence(eval_steps=1, keep_best=True), scores=[nan, 0.2, nan, 0.1, 0.3])
    loop.fit()
    assert [e["step"] for e in loop.exports] == [4]  # 0.2 at step 1 is the baseline; NaN never counts
    assert loop.record.best == {"key": "eval/score", "value": 0.3, "step": 4}


def test_an_older_checkpoint_without_a_recorded_best_takes_a_baseline(tmp_path, capsys):
    """A checkpoint written before meta["best"]: its first evaluation after the resume is the baseline, and a
    run that never beats it says so."""
    ckpt = CheckpointManager(tmp_path / "ck", max_num=5)
    ckpt.save(2, lambda d: (d / "state.json").write_text('{"value": 1}'), {"global_step": 2, "metric": None})
    cadence = Cadence(eval_steps=2, keep_best=True, load_checkpoint=True)
    loop = Scored(tmp_path, 6, cadence, CheckpointManager(tmp_path / "ck", max_num=5), scores=[0.0] * 7)
    loop.fit()
    assert loop.evals == [4, 6] and loop.exports == []
    said = capsys.readouterr().err
    assert "no improvement: eval/score never rose above the baseline 0.0000 (step 4)" in said


def test_the_best_of_an_older_trainer_state_is_kept():
    from posttrain.trainers.run_loop import best_of_old_state

    assert best_of_old_state({"key": None, "value": float("-inf")}) is None  # no evaluation yet
    assert best_of_old_state({"key": "eval/m", "value": 0.5, "step": 3}) == {"key": "eval/m", "value": 0.5,
                                                                             "step": 3}
