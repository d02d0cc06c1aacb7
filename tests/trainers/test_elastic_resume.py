"""Elastic resume (`engines.portable`): an SFT checkpoint written on one layout (ranks, ZeRO stage, one
process) resumes on another and ends where the uninterrupted run on the new layout ends: 2 ranks ZeRO-3 -> one
process, one process -> 2 ranks ZeRO-2, ZeRO-2 -> ZeRO-3 on 2 ranks. The global batch is the same, so
the math is."""
import shutil

import pytest
from rounding import ADAM_EPS
from sft_helpers import assert_weights_within_rounding, sft_flags, torchrun_cases

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

COMMON = ["--train.micro_batch_size", "4", "--data.max_samples", "32", "--ckpt.save_steps", "2",
          "--ckpt.max_num", "5", "--adam.eps", str(ADAM_EPS)]
LAYOUTS = {"one": [], "zero2": ["--ds.zero_stage", "2"], "zero3": ["--ds.zero_stage", "3"]}


PAIRS = [("zero3", "one"), ("one", "zero2"), ("zero2", "zero3")]  # (layout written on, layout resumed on)


def run(cases: dict, model, data, logs) -> dict:
    """`cases`: key -> (layout, run dir, checkpoint dir, *flags), the SFT runs to make: the one-process ones
    in this process, the others in one 2-rank launch (`torchrun_cases`); key -> its stderr ("" in this
    process)."""
    from posttrain.cli import train_sft

    errs, launched = {}, []
    for key, (layout, out, ckpt, *extra) in cases.items():
        flags = [str(f) for f in sft_flags(model, data, out, *COMMON, "--ckpt.path", ckpt, *LAYOUTS[layout],
                                           *extra)]
        if layout == "one":
            train_sft.main(flags)
            errs[key] = ""
        else:
            launched.append((key, ("posttrain.cli.train_sft", flags)))
    runs = torchrun_cases([case for _, case in launched], logs)
    return {**errs, **{key: proc.ok().stderr for (key, _), proc in zip(launched, runs)}}


def losses(run_dir, start=1):
    return [r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r
            and r["step"] >= start]


@pytest.fixture(scope="module")
def resumed(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """The uninterrupted run on each layout (the reference a resume onto that layout must equal; its step-2
    checkpoint the start of a resume from it), then each of PAIRS' resumes from it: (before, after) ->
    (the uninterrupted run dir on `after`, the resumed run dir, the resumed run's stderr)."""
    root = tmp_path_factory.mktemp("elastic")
    straight = {layout: (layout, root / f"uninterrupted_{layout}" / "run",
                         root / f"uninterrupted_{layout}" / "ck") for layout in LAYOUTS}
    run(straight, tiny_model_dir, arithmetic_dir, root / "logs_uninterrupted")
    resumes = {}
    for before, after in PAIRS:
        resume_ckpt = root / f"{before}-{after}" / "ckpt_resume"
        shutil.copytree(straight[before][2] / "global_step2", resume_ckpt / "global_step2")
        resumes[before, after] = (after, root / f"{before}-{after}" / "resumed", resume_ckpt,
                                  "--ckpt.load_enable")
    errs = run(resumes, tiny_model_dir, arithmetic_dir, root / "logs_resumed")
    return {pair: (straight[pair[1]][1], resumes[pair][1], errs[pair]) for pair in PAIRS}


@pytest.mark.parametrize("before,after", PAIRS)
def test_a_checkpoint_resumes_on_another_layout(resumed, before, after):
    straight, resumed_run, err = resumed[before, after]
    if after != "one":
        assert "from its layout-free copy" in err, err[-2000:]
    # the resumed steps are the uninterrupted run's (ZeRO-3 and one process differ by float sums: 1e-5)
    assert losses(resumed_run, start=3) == pytest.approx(losses(straight, start=3), rel=2e-5)
    # the first two steps ran on another layout: the weights are equal up to rounding (rounding.py)
    assert_weights_within_rounding(straight, resumed_run)
