"""SFT across 2 processes (DeepSpeed ZeRO-2 / ZeRO-3, gloo on CPU) gives the weights of the
single-process run: the token-mean loss is normalised by the global token count of each step. Under
ZeRO-3 the model loads straight into shards: each rank reports holding half of it."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rounding import ADAM_EPS
from sft_helpers import (
    assert_loaded_as_shards,
    assert_same_grad_norms,
    assert_weights_within_rounding,
    sft_flags,
    torchrun_cases,
)
from test_prm import prm_dir, prm_flags  # noqa: F401  (the fixture: step-labelled rows)

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e


def launch_sft(flags, nproc=2, launcher="torchrun"):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with socket.socket() as sock:  # a free port (torchrun's --master_port 0 does not reach the workers)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               port, "-m", "posttrain.cli.train_sft", *flags]
    else:  # DeepSpeed's launcher; on GPUs it would be --num_gpus
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_accelerators", str(nproc),
               "--master_port", port, "--module", "posttrain.cli.train_sft", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


ZERO_CASES = [("torchrun", 2, []),
              ("torchrun", 3, ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "70"]),
              ("deepspeed", 3, [])]
RING_CASES = [(2, 1), (3, 2)]  # (ZeRO stage, --ds.ring_attn_head_stride)


def zero_common(extra) -> list:
    return ["--train.micro_batch_size", "2", "--data.max_samples", "32", "--adam.eps", ADAM_EPS, *extra]


RING_COMMON = ["--train.micro_batch_size", "4", "--data.max_samples", "32", "--ds.packing_samples",
               "--adam.eps", ADAM_EPS]
# `posttrain kd` (SFT's loop with a frozen teacher): ZeRO-3 shards of the student and of the teacher
KD_COMMON = ["--train.micro_batch_size", "2", "--data.max_samples", "32", "--adam.eps", ADAM_EPS,
             "--model.kd_loss", "jsd", "--model.kd_coef", "0.7"]
# `posttrain prm`: packed rows, 2 micro-batches per rank under ZeRO-3 against one padded micro-batch per step
PRM_COMMON = ["--data.max_samples", "32", "--train.batch_size", "8", "--adam.eps", ADAM_EPS,
              "--adam.lr", "1e-3"]
MOE_COMMON = ["--train.micro_batch_size", "4", "--data.max_samples", "32", "--model.aux_loss_coef", "0.5",
              "--adam.eps", ADAM_EPS]


@pytest.fixture(scope="module")
def torchrun_runs(tiny_model_dir, tiny_moe_dir, tiny_teacher_dir, arithmetic_dir, prm_dir,  # noqa: F811
                  tmp_path_factory):
    """This module's 2-rank torchrun runs (ZERO_CASES' torchrun ones, RING_CASES, the MoE run, the ZeRO-3 KD
    run, the packed ZeRO-3 PRM run), in one launch (`torchrun_cases`): case -> (run folder, its `CaseRun`)."""
    root = tmp_path_factory.mktemp("torchrun")
    flags = {}
    for launcher, stage, extra in ZERO_CASES:
        if launcher == "torchrun":
            flags["zero", stage] = (tiny_model_dir, "--ds.zero_stage", stage, *zero_common(extra))
    for stage, stride in RING_CASES:
        flags["ring", stage, stride] = (tiny_model_dir, "--ds.zero_stage", stage, "--ds.ring_attn_size", "2",
                                        "--ds.ring_attn_head_stride", stride, *RING_COMMON)
    flags["moe"] = (tiny_moe_dir, "--ds.zero_stage", 3, *MOE_COMMON)
    flags["kd"] = (tiny_model_dir, "--ds.zero_stage", 3, "--teacher.model_name_or_path", tiny_teacher_dir,
                   *KD_COMMON)
    outs = {case: root / f"run{i}" for i, case in enumerate(flags)}
    module = {"kd": "posttrain.cli.train_kd"}
    cases = [(module.get(case, "posttrain.cli.train_sft"),
              sft_flags(model, arithmetic_dir, outs[case], *more)) for case, (model, *more) in flags.items()]
    outs["prm"] = root / "prm"
    cases.append(("posttrain.cli.train_prm", prm_flags(tiny_model_dir, prm_dir, outs["prm"], *PRM_COMMON,
                                                       "--ds.zero_stage", 3, "--ds.packing_samples",
                                                       "--train.micro_batch_size", 2)))
    runs = torchrun_cases(cases, root / "logs")
    return dict(zip(outs, zip(outs.values(), runs)))


@pytest.mark.parametrize("launcher,stage,extra", ZERO_CASES)
def test_two_process_zero_matches_single_process(tiny_model_dir, arithmetic_dir, tmp_path, single_process,
                                                 torchrun_runs, launcher, stage, extra):
    single = single_process(*zero_common(extra))
    if launcher == "torchrun":
        multi, proc = torchrun_runs["zero", stage]
        proc.ok()
    else:
        multi = tmp_path / f"zero{stage}"
        proc = launch_sft(sft_flags(tiny_model_dir, arithmetic_dir, multi, "--ds.zero_stage", stage,
                                    *zero_common(extra)), launcher=launcher)
    assert "world_size = 2" in proc.stderr
    if stage == 3:
        assert_loaded_as_shards(proc.stderr, "model")
    else:
        assert "loaded as ZeRO-3 shards" not in proc.stderr
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)  # the ranks' all-reduce sums in another order


@pytest.mark.parametrize("stage,stride", RING_CASES)
def test_ring_attention_over_two_ranks_matches_single_process(single_process, torchrun_runs, stage, stride):
    """--ds.ring_attn_size 2: both ranks take the same packed micro-batches and each computes half of every
    row (context parallelism); the weights after training equal the single-process run's."""
    single = single_process(*RING_COMMON)
    ring, proc = torchrun_runs["ring", stage, stride]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "--ds.ring_attn_size 2 has no effect" not in proc.stderr
    assert_same_grad_norms(single, ring)
    assert_weights_within_rounding(single, ring)  # the split attention sums in another order


def test_moe_with_router_loss_on_two_ranks_zero3_matches_single_process(tiny_moe_dir, arithmetic_dir,
                                                                        tmp_path, torchrun_runs):
    """A tiny Qwen3-MoE with --model.aux_loss_coef: the router loss joins the loss (logged as train/aux_loss)
    and the gradient; on 2 ranks under ZeRO-3 the expert blocks are leaf modules (gathered whole) and the run
    equals the single-process one: losses, router losses and weights."""
    from posttrain.cli import train_sft

    single = tmp_path / "single"
    train_sft.main(sft_flags(tiny_moe_dir, arithmetic_dir, single, *MOE_COMMON))
    multi, proc = torchrun_runs["moe"]  # --ds.zero_stage 3
    proc.ok()
    assert "ZeRO-3 leaf modules (gathered whole, as routing varies): Qwen3MoeSparseMoeBlock" in proc.stderr
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, multi)]
    assert all(1.0 <= r["train/aux_loss"] <= 4.0 for r in runs[0])
    for key in ("train/loss", "train/aux_loss"):
        assert [r[key] for r in runs[1]] == pytest.approx([r[key] for r in runs[0]], rel=1e-5), key
    # ZeRO-3's gradient norm differs from one process by 2-6e-5 relative for the dense nano llama too (its
    # reduction order); a router-loss gradient counted twice or not at all moves it by far more (see below)
    assert ([r["train/grad_norm"] for r in runs[1]]
            == pytest.approx([r["train/grad_norm"] for r in runs[0]], rel=1e-4))
    assert_weights_within_rounding(single, multi)
    # the coefficient acts: without it the first step's gradient differs
    plain = tmp_path / "plain"
    train_sft.main(sft_flags(tiny_moe_dir, arithmetic_dir, plain, "--train.micro_batch_size", "4",
                             "--data.max_samples", "32"))
    first = [r for r in read_metrics(plain / "metrics.jsonl") if "train/loss" in r][0]
    assert ("train/aux_loss" not in first and first["train/grad_norm"] != pytest.approx(
        runs[0][0]["train/grad_norm"],
                                                                                        rel=1e-4))


def test_kd_on_two_ranks_zero3_matches_single_process(tiny_model_dir, tiny_teacher_dir, arithmetic_dir,
                                                      tmp_path, torchrun_runs):
    """`posttrain kd` under ZeRO-3 over 2 ranks: the student and the frozen teacher load straight into shards
    (each rank holds half of each; the teacher's forwards run on both ranks together), and the run gives the
    single-process run's gradient norms and weights (the KD term, like the NLL, over the step's tokens)."""
    from posttrain.cli import train_kd

    single = tmp_path / "single"
    train_kd.main(sft_flags(tiny_model_dir, arithmetic_dir, single, "--teacher.model_name_or_path",
                            tiny_teacher_dir, *KD_COMMON))
    multi, proc = torchrun_runs["kd"]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "held as ZeRO-3 shards across the 2 ranks" in proc.stderr
    for role in ("model", "teacher model"):
        assert_loaded_as_shards(proc.stderr, role)
    kd = [r["train/kd_loss"] for r in read_metrics(multi / "metrics.jsonl") if "train/kd_loss" in r]
    assert len(kd) == 4 and min(kd) > 1e-3  # jsd(0.5) of two random nano models: about 0.013
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)  # the ranks' all-reduce sums in another order


def test_prm_on_two_ranks_zero3_packed_matches_single_process(tiny_model_dir, prm_dir, tmp_path,  # noqa: F811
                                                              torchrun_runs):
    """`posttrain prm` on 2 ranks under ZeRO-3 with packed rows and 2 micro-batches per rank gives the losses,
    step accuracies, gradient norms and weights of one process with one padded micro-batch per step: the loss
    is divided by the labelled steps of the whole optimizer step."""
    from posttrain.cli import train_prm

    single = tmp_path / "single"
    train_prm.main(prm_flags(tiny_model_dir, prm_dir, single, *PRM_COMMON, "--train.micro_batch_size", 8))
    multi, proc = torchrun_runs["prm"]
    proc.ok()
    assert "world_size = 2" in proc.stderr
    assert_loaded_as_shards(proc.stderr, "model")
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, multi)]
    assert [r["train/micro_batches"] for r in runs[1]] == [2, 2, 2, 2]
    for key in ("train/loss", "train/acc"):
        assert [r[key] for r in runs[1]] == pytest.approx([r[key] for r in runs[0]], abs=1e-5), key
    assert (multi / "prm.json").read_text() == (single / "prm.json").read_text()
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)
