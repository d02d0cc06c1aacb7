"""`posttrain kd` (trainers/kd.py): kd_coef 0 is SFT bit for bit, the step loss is the hand mix of the
logged NLL and divergence, resume equals an uninterrupted run (packed rows, LoRA student), bad flags and a
teacher of another vocabulary stop at start-up with one line, and KD from a trained teacher beats SFT on the
same data at equal steps (held-out NLL)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import sft_flags

from posttrain.utils.metrics import read_metrics


def kd_flags(model, data, out, teacher, *extra) -> list[str]:
    return sft_flags(model, data, out, "--teacher.model_name_or_path", teacher, *extra)


def logged(run, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]


def test_kd_coef_0_is_sft_bit_for_bit(single_process, tiny_model_dir, arithmetic_dir, tiny_teacher_dir,
                                      tmp_path):
    """With --model.kd_coef 0 the teacher runs (its divergence is logged) but the loss is SFT's: the same
    loss at every step, the same eval loss and the same weights, exactly."""
    from posttrain.cli import train_kd

    sft = single_process("--data.max_samples", 32)
    kd = tmp_path / "kd"
    train_kd.main(kd_flags(tiny_model_dir, arithmetic_dir, kd, tiny_teacher_dir, "--data.max_samples", 32,
                           "--model.kd_coef", 0))
    assert len(logged(sft, "train/loss")) == 4
    assert logged(kd, "train/loss") == logged(sft, "train/loss")
    assert logged(kd, "train/nll") == logged(sft, "train/loss")
    assert logged(kd, "eval/loss") == logged(sft, "eval/loss")
    assert min(logged(kd, "train/kd_loss")) > 0.01
    want, got = load_file(str(sft / "model.safetensors")), load_file(str(kd / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_resume_equals_uninterrupted_packed_lora_student(tiny_model_dir, arithmetic_dir, tiny_teacher_dir,
                                                        tmp_path):
    """Packed rows, a LoRA student and the reverse KL mixed half and half: a run resumed from its step-2
    checkpoint ends with the adapter of the uninterrupted run and logs its losses from step 3 on. Each step's
    loss is (1 - c)·nll + c·kd of its logged terms. The checkpoint holds the student only (no teacher)."""
    from posttrain.cli import train_kd

    common = ("--ds.packing_samples", "--ds.lora.rank", 4, "--ds.lora.alpha", 8, "--adam.lr", 1e-2,
              "--model.kd_coef", 0.5, "--model.kd_loss", "reverse", "--ckpt.save_steps", 2,
              "--ckpt.max_num", 5, "--data.max_samples", 32)
    ckpt_a, ckpt_b = tmp_path / "ckpt_a", tmp_path / "ckpt_b"
    full = tmp_path / "full"
    train_kd.main(kd_flags(tiny_model_dir, arithmetic_dir, full, tiny_teacher_dir, *common, "--ckpt.path",
                           ckpt_a))
    shutil.copytree(ckpt_a / "global_step2", ckpt_b / "global_step2")
    resumed = tmp_path / "resumed"
    train_kd.main(kd_flags(tiny_model_dir, arithmetic_dir, resumed, tiny_teacher_dir, *common, "--ckpt.path",
                           ckpt_b, "--ckpt.load_enable"))
    want, got = (load_file(str(d / "adapter_model.safetensors")) for d in (full, resumed))
    assert want.keys() == got.keys() and all(torch.allclose(want[k], got[k], atol=1e-6) for k in want)
    assert logged(resumed, "train/loss") == pytest.approx(logged(full, "train/loss")[2:], abs=1e-6)
    mix = [0.5 * n + 0.5 * k for n, k in zip(logged(full, "train/nll"), logged(full, "train/kd_loss"))]
    assert logged(full, "train/loss") == pytest.approx(mix, abs=1e-6)
    assert logged(full, "train/loss")[-1] < logged(full, "train/loss")[0]
    # the checkpoint's weights: the student's adapter tensors, nothing else (the frozen teacher is not saved)
    state = torch.load(ckpt_a / "global_step2" / "engine" / "model.pt", map_location="cpu")
    assert len(state) == len(want) > 0 and all(".lora_" in k for k in state)


@pytest.mark.parametrize("extra, line", [
    ((), "--teacher.model_name_or_path: required"),
    (("--teacher.model_name_or_path", "TEACHER", "--model.kd_coef", "1.5"), "--model.kd_coef 1.5: must be"),
    (("--teacher.model_name_or_path", "TEACHER", "--model.kd_loss", "kl"),
     "--model.kd_loss: invalid choice 'kl'"),
    (("--teacher.model_name_or_path", "OTHER_VOCAB"), "has a vocabulary of 1000 tokens, the student"),
    (("--teacher_model", "TEACHER"), "--teacher_model: OpenRLHF 0.9's train_kd flag; use --teacher."),
], ids=["no-teacher", "coef", "loss", "vocab", "openrlhf-0.9-flag"])
def test_bad_flags_and_a_teacher_of_another_vocabulary_stop_with_one_line(
        tiny_model_dir, arithmetic_dir, tiny_teacher_dir, tmp_path, capsys, extra, line):
    from posttrain.cli.main import main

    other = tmp_path / "other_vocab"
    shutil.copytree(tiny_teacher_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    names = {"TEACHER": tiny_teacher_dir, "OTHER_VOCAB": str(other)}
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["kd", *sft_flags(tiny_model_dir, arithmetic_dir, out, *(names.get(x, x) for x in extra))])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and line in err, err
    assert err.startswith("posttrain kd: error: ") and not out.exists()


@pytest.fixture(scope="module")
def addition_teacher(tmp_path_factory, tiny_model_dir):
    """(teacher run folder, data folder): the nano model SFT-ed for 2 epochs on 360 single-digit additions;
    the data's test split (40 rows) is held out from every run."""
    from posttrain.cli import train_sft
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    root = tmp_path_factory.mktemp("kd_teacher")
    rows = make_arithmetic_rows(400, seed=11, difficulty=0)
    write_jsonl(rows[:360], root / "data" / "train.jsonl")
    write_jsonl(rows[360:], root / "data" / "test.jsonl")
    train_sft.main(sft_flags(tiny_model_dir, root / "data", root / "teacher", "--adam.lr", 3e-3,
                             "--train.max_epochs", 2, "--train.seed", 42))
    return root / "teacher", root / "data"


@pytest.mark.slow
def test_kd_from_a_trained_teacher_beats_sft_at_equal_steps(addition_teacher, tiny_model_dir, tmp_path):
    """A fresh nano student on the first 64 rows for 4 epochs (32 steps, the same order and seed): with the
    teacher's distributions (default kd_coef 0.4, forward KL) its held-out NLL of the answers is lower than
    SFT's (bench/kd.py: 1.277 vs 1.375 at this seed; lower at seeds 1 and 2 as well)."""
    from posttrain.cli import train_kd, train_sft

    teacher, data = addition_teacher
    common = ("--data.max_samples", 64, "--train.max_epochs", 4, "--adam.lr", 3e-3, "--train.seed", 42)
    sft, kd = tmp_path / "sft", tmp_path / "kd"
    train_sft.main(sft_flags(tiny_model_dir, data, sft, *common))
    train_kd.main(kd_flags(tiny_model_dir, data, kd, teacher, *common))
    assert len(logged(kd, "train/loss")) == len(logged(sft, "train/loss")) == 32
    sft_nll, kd_nll = logged(sft, "eval/loss")[-1], logged(kd, "eval/nll")[-1]
    assert kd_nll < sft_nll - 0.03, (kd_nll, sft_nll)
