"""Elastic resume (`engines.portable`): an SFT checkpoint written on one layout (ranks, ZeRO stage, one
process) resumes on another and ends where the uninterrupted run on the new layout ends: 2 ranks ZeRO-3 -> one
process, one process -> 2 ranks ZeRO-2, ZeRO-2 -> ZeRO-3 on 2 ranks. The global batch is the same, so
the math is."""
import shutil

import pytest
from rounding import ADAM_EPS
from sft_helpers import assert_weights_within_rounding, sft_flags, torchrun

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

COMMON = ["--train.micro_batch_size", "4", "--data.max_samples", "32", "--ckpt.save_steps", "2",
          "--ckpt.max_num", "5", "--adam.eps", str(ADAM_EPS)]
LAYOUTS = {"one": [], "zero2": ["--ds.zero_stage", "2"], "zero3": ["--ds.zero_stage", "3"]}


def run(layout: str, model, data, out, ckpt, *extra):
    flags = sft_flags(model, data, out, *COMMON, "--ckpt.path", ckpt, *LAYOUTS[layout], *extra)
    if layout == "one":
        from posttrain.cli import train_sft

        train_sft.main([str(f) for f in flags])
        return ""
    return torchrun("posttrain.cli.train_sft", flags).stderr


def losses(run_dir, start=1):
    return [r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r
            and r["step"] >= start]


@pytest.fixture(scope="module")
def uninterrupted_on(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """`layout -> (run dir, checkpoint dir)` of its uninterrupted run, run once for the module: the reference
    a resume onto that layout must equal, and (its step-2 checkpoint) the start of a resume from it."""
    runs = {}

    def get(layout):
        if layout not in runs:
            tmp = tmp_path_factory.mktemp(f"uninterrupted_{layout}")
            run(layout, tiny_model_dir, arithmetic_dir, tmp / "run", tmp / "ck")
            runs[layout] = (tmp / "run", tmp / "ck")
        return runs[layout]
    return get


@pytest.mark.parametrize("before,after", [("zero3", "one"), ("one", "zero2"), ("zero2", "zero3")])
def test_a_checkpoint_resumes_on_another_layout(uninterrupted_on, tiny_model_dir, arithmetic_dir, tmp_path,
                                                before, after):
    _, first_ckpt = uninterrupted_on(before)
    straight, _ = uninterrupted_on(after)
    resume_ckpt = tmp_path / "ckpt_resume"
    resume_ckpt.mkdir()
    shutil.copytree(first_ckpt / "global_step2", resume_ckpt / "global_step2")
    resumed = tmp_path / "resumed"
    err = run(after, tiny_model_dir, arithmetic_dir, resumed, resume_ckpt, "--ckpt.load_enable")
    if after != "one":
        assert "from its layout-free copy" in err, err[-2000:]
    # the resumed steps are the uninterrupted run's (ZeRO-3 and one process differ by float sums: 1e-5)
    assert losses(resumed, start=3) == pytest.approx(losses(straight, start=3), rel=2e-5)
    # the first two steps ran on another layout: the weights are equal up to rounding (rounding.py)
    assert_weights_within_rounding(straight, resumed)
