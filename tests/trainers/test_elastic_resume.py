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


def losses(run_dir, start=1):
    return [r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r
            and r["step"] >= start]


@pytest.fixture(scope="module")
def resumed(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """The uninterrupted run on each layout (the reference a resume onto that layout must equal; its step-2
    checkpoint, copied, the start of a resume from it), then each of PAIRS' resumes from it: the one-process
    runs in this process, the 2-rank ones in one launch (`torchrun_cases`, which copies a checkpoint before
    the case that resumes it): (before, after) -> (the uninterrupted run dir on `after`, the resumed run dir,
    the resumed run's stderr ("" in this process))."""
    from posttrain.cli import train_sft

    root = tmp_path_factory.mktemp("elastic")
    straight = {layout: (root / f"uninterrupted_{layout}" / "run", root / f"uninterrupted_{layout}" / "ck")
                for layout in LAYOUTS}
    resumes = {pair: (root / "-".join(pair) / "resumed", root / "-".join(pair) / "ckpt_resume")
               for pair in PAIRS}

    def flags(layout, out, ckpt, *extra):
        return [str(f) for f in sft_flags(tiny_model_dir, arithmetic_dir, out, *COMMON, "--ckpt.path", ckpt,
                                          *LAYOUTS[layout], *extra)]

    def step2(before, after):  # (the checkpoint a resume starts from, where it resumes it from)
        return straight[before][1] / "global_step2", resumes[before, after][1] / "global_step2"

    train_sft.main(flags("one", *straight["one"]))
    launched = [(layout, ("posttrain.cli.train_sft", flags(layout, *straight[layout])))
                for layout in LAYOUTS if layout != "one"]
    launched += [(pair, ("posttrain.cli.train_sft", flags(pair[1], *resumes[pair], "--ckpt.load_enable"),
                         [step2(*pair)])) for pair in PAIRS if pair[1] != "one"]  # after their sources
    runs = torchrun_cases([case for _, case in launched], root / "logs")
    errs = {key: proc.ok().stderr for (key, _), proc in zip(launched, runs)}
    for pair in PAIRS:
        if pair[1] == "one":
            shutil.copytree(*step2(*pair))
            train_sft.main(flags("one", *resumes[pair], "--ckpt.load_enable"))
            errs[pair] = ""
    return {pair: (straight[pair[1]][0], resumes[pair][0], errs[pair]) for pair in PAIRS}


@pytest.mark.parametrize("before,after", PAIRS)
def test_a_checkpoint_resumes_on_another_layout(resumed, before, after):
    straight, resumed_run, err = resumed[before, after]
    if after != "one":
        assert "from its layout-free copy" in err, err[-2000:]
    # the resumed steps are the uninterrupted run's (ZeRO-3 and one process differ by float sums: 1e-5)
    assert losses(resumed_run, start=3) == pytest.approx(losses(straight, start=3), rel=2e-5)
    # the first two steps ran on another layout: the weights are equal up to rounding (rounding.py)
    assert_weights_within_rounding(straight, resumed_run)
