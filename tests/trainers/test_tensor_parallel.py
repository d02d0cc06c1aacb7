"""`posttrain sft --ds.tensor_parallel_size 2` on 2 gloo ranks (one tensor-parallel group: DeepSpeed AutoTP
splits every decoder layer, both ranks take the same micro-batches) equals the one-process run: the loss of
every step, the gradient norm, the exported weights (gathered into the unsplit layout, loadable as a plain
model); each rank holds half of the split layers plus the replicated rest, and optimizer state for what it
holds. DPO and RM (the same loop) likewise. A model whose key/value heads do not divide by the group is
refused in one line before it loads."""
import re

import pytest
import torch
from rounding import ADAM_EPS, adam_weight_tolerance, assert_weights_within
from sft_helpers import sft_flags, torchrun_cases, weights

from posttrain.utils.metrics import read_metrics

# 4 steps, 2 micro-batches each; Adam's eps of the equality runs (rounding.py)
COMMON = ("--train.micro_batch_size", "4", "--data.max_samples", "32", "--adam.eps", str(ADAM_EPS))


def rows(run, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]


def assert_same_run(single, split, norm_rtol: float) -> None:
    """Loss and gradient norm of every step (relative 1e-5; the norm to `norm_rtol`), the eval loss and every
    exported tensor (to the rounding Adam passes on at sft_flags' lr 1e-3: rounding.py)."""
    for key, rtol in (("train/loss", 1e-5), ("train/grad_norm", norm_rtol), ("eval/loss", 1e-5)):
        want, got = rows(single, key), rows(split, key)
        assert len(want) == len(got) > 0 and got == pytest.approx(want, rel=rtol), key
    tolerance = adam_weight_tolerance(1e-3, rows(single, "train/grad_norm"))
    assert_weights_within(weights(single), weights(split), tolerance)


def rank_shares(stderr: str) -> dict[int, tuple[int, int, int, int]]:
    found = re.findall(r"\[rank (\d)\] tensor parallel over 2 ranks: this rank holds (\d+) of (\d+) "
                       r"parameter elements \((\d+) split, \d+%\), (\d+) optimizer-state elements", stderr)
    return {int(r): tuple(map(int, v)) for r, *v in found}


# the 2-rank, tensor-parallel-2 cases: SFT's (ZeRO stage, packing), and the pair trainers' (trainer, ZeRO
# stage, flags)
SFT_CASES = [(0, False), (1, True), (2, False), (2, True)]
PAIR_CASES = [("dpo", 2, ("--ds.packing_samples",)), ("rm", 1, ())]


def packing_flags(packing: bool) -> tuple:
    return ("--ds.packing_samples",) if packing else ()


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir, tiny_score_model_dir, arithmetic_dir, pairs_dir, tmp_path_factory):
    """The 2-rank tensor-parallel runs of SFT_CASES and PAIR_CASES, "full" (`resume_flags` with
    --ckpt.save_hf: its checkpoints in the folder's sibling ckpt_a), and the resumes of full's step-2
    checkpoint (copied into ckpt_b and ckpt_c): "resumed" on the same layout, "other" on the same 2 ranks
    without tensor parallelism; in one launch (`torchrun_cases`): case -> (run folder, its `CaseRun`)."""
    root = tmp_path_factory.mktemp("two_ranks")
    outs = {(stage, packing): root / f"tp{stage}{'p' if packing else ''}" for stage, packing in SFT_CASES}
    cases = [("posttrain.cli.train_sft", sft_flags(tiny_model_dir, arithmetic_dir, out, *COMMON,
                                                   *packing_flags(packing), "--ds.zero_stage", stage,
                                                   "--ds.tensor_parallel_size", 2))
             for (stage, packing), out in outs.items()]
    for trainer, stage, extra in PAIR_CASES:
        outs[trainer] = root / f"{trainer}_tp"
        model = tiny_score_model_dir if trainer == "rm" else tiny_model_dir
        cases.append((f"posttrain.cli.train_{trainer}",
                      pair_flags(model, pairs_dir, outs[trainer], *extra, "--ds.zero_stage", stage,
                                 "--ds.tensor_parallel_size", 2)))
    outs["full"] = root / "full"
    cases.append(("posttrain.cli.train_sft", resume_flags(tiny_model_dir, arithmetic_dir, outs["full"],
                                                          root / "ckpt_a", "--ds.tensor_parallel_size", 2,
                                                          "--ckpt.save_hf")))
    for name, ckpt, *more in (("resumed", "ckpt_b", "--ds.tensor_parallel_size", 2), ("other", "ckpt_c")):
        outs[name] = root / name
        cases.append(("posttrain.cli.train_sft",
                      resume_flags(tiny_model_dir, arithmetic_dir, outs[name], root / ckpt, *more,
                                   "--ckpt.load_enable"),
                      [(root / "ckpt_a" / "global_step2", root / ckpt / "global_step2")]))
    return dict(zip(outs, zip(outs.values(), torchrun_cases(cases, root / "logs"))))


def resume_flags(model, data, out, ckpt, *more) -> list[str]:
    """The resume test's runs: ZeRO-1, a checkpoint every 2 steps into `ckpt`."""
    return sft_flags(model, data, out, *COMMON, "--ds.zero_stage", 1, "--ckpt.path", ckpt,
                     "--ckpt.save_steps", 2, *more)


@pytest.mark.e2e
@pytest.mark.parametrize("stage,packing", SFT_CASES)
def test_two_ranks_with_tensor_parallel_size_2_match_one_process(two_rank_runs, single_process, stage,
                                                                 packing):
    single = single_process(*COMMON, *packing_flags(packing))
    split, proc = two_rank_runs[stage, packing]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "data_parallel_size = 1" in proc.stderr
    assert "--ds.tensor_parallel_size 2 has no effect" not in proc.stderr
    # ZeRO-0: the norm of models.tensor_parallel.grad_norm; ZeRO 1/2: DeepSpeed's own, which differs from the
    # one process's torch norm by ~2e-5 without tensor parallelism too (its summation order)
    assert_same_run(single, split, norm_rtol=1e-5 if stage == 0 else 1e-4)
    shares = rank_shares(proc.stderr)
    assert sorted(shares) == [0, 1], proc.stderr[-3000:]
    for own, full, split_elements, optimizer in shares.values():
        assert full == sum(t.numel() for t in weights(single).values())  # (the tied head is saved once)
        # the other half is on the other rank
        assert split_elements > 0.3 * full and full - own == split_elements
        # Adam's two moments of what the rank holds (one group: no ZeRO partition)
        assert optimizer == 2 * own
    if stage == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(split)  # a plain, unsplit model
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (128, 128)


def test_heads_that_do_not_divide_by_the_group_stop_the_run_before_the_model_loads(tiny_model_dir,
                                                                                   arithmetic_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    from posttrain.cli import train_sft

    monkeypatch.setenv("WORLD_SIZE", "4")  # as a launcher's rank 0 would see it; nothing distributed starts
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_:
        train_sft.main(sft_flags(tiny_model_dir, arithmetic_dir, tmp_path / "run",
                                 "--ds.tensor_parallel_size", 4))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "posttrain sft: error: --ds.tensor_parallel_size 4: the model's num_key_value_heads (2) is not "
        "divisible by 4; each rank keeps whole heads and an equal share of the MLP")


@pytest.fixture(scope="module")
def four_rank_runs(tiny_model_dir, arithmetic_dir, tmp_path_factory):
    """The 4-rank runs, in one launch (`torchrun_cases`): "tp2dp2" (ZeRO-0, tensor parallel 2) and "cp2tp2"
    (packed, ring 2 x tensor parallel 2) -> (run folder, its `CaseRun`)."""
    root = tmp_path_factory.mktemp("four_ranks")
    outs = {"tp2dp2": root / "tp2dp2", "cp2tp2": root / "cp2tp2"}
    cases = [("posttrain.cli.train_sft", sft_flags(tiny_model_dir, arithmetic_dir, outs["tp2dp2"], *COMMON,
                                                   "--ds.zero_stage", 0, "--ds.tensor_parallel_size", 2)),
             ("posttrain.cli.train_sft", sft_flags(tiny_model_dir, arithmetic_dir, outs["cp2tp2"], *COMMON,
                                                   "--ds.packing_samples", "--ds.zero_stage", 0,
                                                   "--ds.tensor_parallel_size", 2, "--ds.ring_attn_size", 2))]
    return dict(zip(outs, zip(outs.values(), torchrun_cases(cases, root / "logs", nproc=4))))


@pytest.mark.e2e
def test_four_ranks_as_two_tensor_parallel_groups_match_one_process(four_rank_runs, single_process):
    """4 ranks, N = 2: ranks 0-1 and 2-3 each hold one split copy and take half of each step's samples
    (ZeRO-0: DeepSpeed averages over the 2 ranks holding each shard, the norm is taken per group)."""
    split, proc = four_rank_runs["tp2dp2"]
    proc.ok()
    assert "data_parallel_size = 2" in proc.stderr
    assert "rank 2 (dp 1, cp 0, tp 0), rank 3 (dp 1, cp 0, tp 1)" in proc.stderr
    assert_same_run(single_process(*COMMON), split, norm_rtol=1e-5)


@pytest.mark.e2e
def test_four_ranks_as_ring_2_by_tensor_parallel_2_match_one_process(four_rank_runs, single_process):
    """4 ranks, ring 2 x TP 2 (data parallel 1): each rank holds half of every layer (tp) and computes half of
    every packed row (cp), attending the row's keys of its own heads gathered from its context group (ranks 0,
    2 and 1, 3). The run equals the one-process run."""
    split, proc = four_rank_runs["cp2tp2"]
    proc.ok()
    assert "data_parallel_size = 1" in proc.stderr
    assert ("rank 0 (dp 0, cp 0, tp 0), rank 1 (dp 0, cp 0, tp 1), rank 2 (dp 0, cp 1, tp 0), "
            "rank 3 (dp 0, cp 1, tp 1)") in proc.stderr
    assert_same_run(single_process(*COMMON, "--ds.packing_samples"), split, norm_rtol=1e-5)


@pytest.fixture(scope="module")
def pairs_dir(tmp_path_factory):
    from posttrain.data.synthetic import make_preference_rows, write_jsonl

    path = tmp_path_factory.mktemp("pairs")
    rows = [dict(r, chosen=f"The answer is {r['chosen']}.") for r in make_preference_rows(96, seed=5)]
    write_jsonl(rows[:64], path / "train.jsonl")
    write_jsonl(rows[64:], path / "test.jsonl")
    return path


def pair_flags(model, pairs_dir, out, *more) -> list[str]:
    return [str(f) for f in ("--model.model_name_or_path", model, "--data.dataset", pairs_dir,
                             "--data.prompt_key", "prompt", "--data.apply_chat_template",
                             "--data.max_len", 48, "--train.batch_size", 16,
                             "--train.micro_batch_size", 4, "--data.max_samples", 48, "--adam.lr", "1e-3",
                             "--eval.dataset", pairs_dir, "--eval.split", "test",
                             "--ckpt.output_dir", out, "--adam.eps", ADAM_EPS, *more)]


@pytest.mark.e2e
@pytest.mark.parametrize("trainer,stage,extra", PAIR_CASES)
def test_dpo_and_rm_with_tensor_parallel_size_2_match_one_process(tiny_model_dir, tiny_score_model_dir,
                                                                  pairs_dir, tmp_path, two_rank_runs, trainer,
                                                                  stage, extra):
    """The same loop for pairs: DPO (its reference whole on every rank) and a reward model (the
    score head whole)."""
    import importlib

    model = tiny_score_model_dir if trainer == "rm" else tiny_model_dir
    single = tmp_path / "single"
    importlib.import_module(f"posttrain.cli.train_{trainer}").main(pair_flags(model, pairs_dir, single,
                                                                              *extra))
    split, proc = two_rank_runs[trainer]  # the same flags, --ds.zero_stage `stage`, tensor parallel 2
    proc.ok()
    assert sorted(rank_shares(proc.stderr)) == [0, 1], proc.stderr[-3000:]
    # the norm: DeepSpeed's own under ZeRO 1/2 (see above). Weights: equal up to the rounding of the split
    # sums, as Adam at ADAM_EPS passes it on (rounding.py)
    for key, rtol in (("train/loss", 1e-5), ("train/grad_norm", 1e-4), ("eval/loss", 1e-5)):
        assert len(rows(single, key)) == len(rows(split, key)) > 0, key
        assert rows(split, key) == pytest.approx(rows(single, key), rel=rtol), key
    tolerance = adam_weight_tolerance(1e-3, rows(single, "train/grad_norm"))
    assert_weights_within(weights(single), weights(split), tolerance)


@pytest.mark.e2e
def test_tensor_parallel_checkpoints_resume_on_the_same_layout(two_rank_runs):
    """Engine states are per rank (DeepSpeed's model and optimizer files per tensor-parallel rank): a run
    resumed from step 2 ends with the uninterrupted run's weights; the --ckpt.save_hf export is whole; a run
    with another layout stops with the reason."""
    from transformers import AutoModelForCausalLM

    full, proc = two_rank_runs["full"]  # resume_flags with tensor parallel 2 and --ckpt.save_hf, into ckpt_a
    proc.ok()
    export = AutoModelForCausalLM.from_pretrained(full.parent / "ckpt_a" / "global_step2_hf")
    assert export.model.layers[0].mlp.down_proj.weight.shape == (128, 352)
    # step 2 resumed on the same layout, and on the same 2 ranks without tensor parallelism
    (resumed_run, resumed), (_, other) = two_rank_runs["resumed"], two_rank_runs["other"]
    resumed.ok()
    wa, wb = weights(full), weights(resumed_run)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert other.returncode != 0
    assert re.search("was written on 2 rank\\(s\\), ZeRO-1, tensor parallel 2, this run is 2 rank\\(s\\), "
                     "ZeRO-1: a tensor-parallel engine state resumes only on the layout that wrote it",
                     other.stderr[-4000:]), other.stderr[-4000:]
