"""KTO trainer (`posttrain kto`): the KL estimate pairs each row's prompt with the completion of the row
before it in the step (TRL's rotation), the same whatever the micro-batches and padded or packed; training
on the DPO test's pairs as unpaired rows raises the held-out chosen-over-rejected margin as DPO does; a
resumed run ends where the uninterrupted one does; bad rows and a one-row step exit 2 with one line."""
import json
import shutil

import pytest
import torch
from test_dpo import dpo_run, kto_flags, pref_dir, unpaired, unpaired_dir  # noqa: F401  (DPO's pairs, run)

from posttrain.utils.metrics import read_metrics


def write_rows(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- the KL estimate ------------------------------------------------------------------------------------
def test_kl_estimate_pairs_each_prompt_with_the_previous_rows_completion(tiny_model_dir):
    """`KTOObjective.prepare` on 6 rows in a shuffled step order equals mean(π(y'|x) - ref(y'|x)) with y' the
    completion TRL's rotation gives (row k: row k-1's, row 0: the last's), each sequence run alone; in one
    padded micro-batch or three packed ones."""
    from posttrain.algorithms.losses import token_logprobs
    from posttrain.data.synthetic import make_preference_rows
    from posttrain.data.unpaired_dataset import UnpairedDataset
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.kto import KTOObjective
    from posttrain.trainers.single_model_loop import StepRows

    tok = load_tokenizer(tiny_model_dir)
    policy, ref = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rows = unpaired(make_preference_rows(3, seed=4))
    items = list(UnpairedDataset(rows, tok, 48, apply_chat_template=True))
    order = [3, 0, 5, 1, 4, 2]
    completions = [items[i]["completion_ids"] for i in order]
    rotated = completions[-1:] + completions[:-1]  # TRL's add_kl_completion_ids on the step's rows
    want = []
    with torch.no_grad():
        for i, completion in zip(order, rotated):
            ids = torch.tensor([items[i]["prompt_ids"] + completion])
            start = len(items[i]["prompt_ids"]) - 1  # labels from the completion's first token
            logps = [token_logprobs(m(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])[0, start:].sum()
                     for m in (policy, ref)]
            want.append(float(logps[0] - logps[1]))
    expected = sum(want) / len(want)
    assert abs(expected) > 1e-3
    for packing, groups in ((False, [order]), (True, [[3, 0], [5, 1], [4, 2]])):
        obj = KTOObjective(pad_id=tok.pad_token_id, packing=packing, max_len=48, eos_id=tok.eos_token_id,
                           ref_model=ref)
        with torch.no_grad():
            obj.prepare(policy, StepRows(items, order, groups, len(groups), lambda b: b, lambda s: s))
        assert obj.kl == pytest.approx(expected, abs=1e-5), (packing, groups)


def test_loss_is_the_weighted_row_mean_over_the_step(tiny_model_dir):
    """The micro-batch loss is Σ ℓ / (the step's rows), ℓ from `kto_loss` on summed completion log-probs."""
    from posttrain.algorithms.preference import kto_loss
    from posttrain.data.synthetic import make_preference_rows
    from posttrain.data.unpaired_dataset import UnpairedDataset
    from posttrain.models import forward_logits, load_causal_lm, load_tokenizer, sequence_logprobs
    from posttrain.trainers.kto import KTOObjective

    tok = load_tokenizer(tiny_model_dir)
    policy, ref = load_causal_lm(tiny_model_dir), load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        ref.lm_head.weight.mul_(1.5)
    rows = unpaired(make_preference_rows(2, seed=1))
    items = list(UnpairedDataset(rows, tok, 48, apply_chat_template=True))
    obj = KTOObjective(pad_id=tok.pad_token_id, packing=False, max_len=48, eos_id=tok.eos_token_id, beta=0.5,
                       desirable_weight=1.5, undesirable_weight=0.5, ref_model=ref)
    obj.kl = 0.25
    batch = obj.collate(items)
    assert batch["desirable"].tolist() == [True, False, True, False]
    loss, stats = obj.loss(policy, batch, num_units=8)
    with torch.no_grad():
        pol, rf = (sequence_logprobs(forward_logits(m, batch), batch)[0] for m in (policy, ref))
    losses, rewards = kto_loss(pol, rf, batch["desirable"], 0.25, beta=0.5, desirable_weight=1.5,
                               undesirable_weight=0.5)
    assert loss.item() == pytest.approx(losses.sum().item() / 8, abs=1e-6)
    assert stats["loss_sum"] == pytest.approx(losses.sum().item(), abs=1e-5) and stats["loss_count"] == 4
    assert stats["kl_sum"] / stats["kl_count"] == pytest.approx(0.25)
    assert stats["chosen_reward_sum"] == pytest.approx(rewards[0::2].sum().item(), abs=1e-5)


# ---- real runs ------------------------------------------------------------------------------------------
def heldout_gaps(model_dir, pref_dir) -> torch.Tensor:  # noqa: F811
    """Per held-out pair, log π(chosen) - log π(rejected) (summed response log-probs) of a saved model."""
    from posttrain.data.preference_dataset import PreferenceDataset
    from posttrain.data.readers import read_file
    from posttrain.models import forward_logits, load_causal_lm, load_tokenizer, sequence_logprobs
    from posttrain.trainers.dpo import DPOObjective

    tok = load_tokenizer(model_dir)
    items = list(PreferenceDataset(read_file(str(pref_dir / "test.jsonl")), tok, 48, prompt_key="prompt",
                                   apply_chat_template=True))
    batch = DPOObjective(pad_id=tok.pad_token_id, packing=False).collate(items)
    with torch.no_grad():
        logps = sequence_logprobs(forward_logits(load_causal_lm(model_dir), batch), batch)[0]
    return logps[: len(items)] - logps[len(items):]


def test_kto_on_unpaired_rows_raises_the_chosen_over_rejected_margin(
        sft_nano, pref_dir, unpaired_dir, dpo_run, tmp_path):  # noqa: F811
    """The DPO test's 64 pairs as 128 unpaired rows, 2 epochs of 4 steps from the SFT-ed model: the held-out
    pairs' margin over the reference (chosen - rejected log-prob gap, now minus at the start) grows for
    nearly every pair, as DPO's does on the same pairs at the same steps (its run in test_dpo): KTO's
    preference accuracy (the share of held-out pairs whose margin grew) is within one pair of DPO's."""
    from posttrain.cli.main import main

    out = tmp_path / "kto"
    main(["kto", *kto_flags(sft_nano[0], unpaired_dir, out, "--train.max_epochs", 2, "--adam.lr", "1e-3")])
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(train) == 8
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-6) and train[0]["train/kl"] == 0.0
    assert train[-1]["train/loss"] < 0.5
    assert train[-1]["train/chosen_reward"] > 0 > train[-1]["train/rejected_reward"]
    before = heldout_gaps(sft_nano[0], pref_dir)
    margin = heldout_gaps(out, pref_dir) - before
    assert float((margin > 0).float().mean()) > 0.9 and float(margin.mean()) > 1.0, margin
    dpo_margin = heldout_gaps(dpo_run[0], pref_dir) - before
    kto_acc, dpo_acc = (float((m > 0).float().mean()) for m in (margin, dpo_margin))
    assert kto_acc >= dpo_acc - 1 / len(margin), (kto_acc, dpo_acc)


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tiny_model_dir, unpaired_dir,  # noqa: F811
                                                             tmp_path):
    """4 steps with a checkpoint at step 2; a new run resumed from that checkpoint logs the same losses for
    steps 3-4 and exports the same weights."""
    from safetensors.torch import load_file

    from posttrain.cli import train_kto

    common = ["--data.max_samples", 32, "--train.batch_size", 8, "--train.micro_batch_size", 4,
              "--ckpt.save_steps", 2, "--adam.lr", "1e-3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_kto.main(kto_flags(tiny_model_dir, unpaired_dir, straight / "run", *common, "--ckpt.path",
                             straight / "ck"))
    shutil.copytree(straight / "ck" / "global_step2", resumed / "ck" / "global_step2")
    train_kto.main(kto_flags(tiny_model_dir, unpaired_dir, resumed / "run", *common, "--ckpt.path",
                             resumed / "ck", "--ckpt.load_enable"))

    def losses(run):
        return {r["step"]: (r["train/loss"], r["train/kl"]) for r in read_metrics(run / "metrics.jsonl")
                if "train/loss" in r and r["step"] > 2}

    assert losses(resumed / "run") == losses(straight / "run") and len(losses(straight / "run")) == 2
    # the resumed run started at step 3: it trained steps 3-4 only
    assert [r["step"] for r in read_metrics(resumed / "run" / "metrics.jsonl") if "train/loss" in r] == [3, 4]
    want, got = (load_file(str(d / "run" / "model.safetensors")) for d in (straight, resumed))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


@pytest.mark.parametrize("bad,message", [
    ({"label": "yes"}, "row 2: key 'label' must be true or false"),
    ({"label": 2}, "row 2: key 'label' must be true or false (or OpenRLHF's 1 or 0"),
    ({"label": None, "drop": "label"}, "row 2: missing key 'label'"),
    ({"prompt": None, "drop": "prompt"}, "row 2: no prompt: the row has neither 'input' (OpenRLHF) nor"),
])
def test_bad_rows_exit_2_with_one_line(tiny_model_dir, tmp_path, capsys, bad, message):
    from posttrain.cli.main import main

    rows = unpaired([{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}] * 2)
    rows[1] = {k: v for k, v in {**rows[1], **bad}.items() if k not in ("drop", bad.get("drop"))}
    data = write_rows(tmp_path / "data" / "train.jsonl", rows)
    with pytest.raises(SystemExit) as exit_info:
        main(["kto", *kto_flags(tiny_model_dir, data, tmp_path / "out", "--train.batch_size", 2,
                                "--train.micro_batch_size", 2)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("posttrain kto: error: ")
    assert message in err[0] and str(data) in err[0]


def test_openrlhf_0_9_train_kto_weights_name_their_dotted_flags():
    from posttrain.config import ConfigError, parse_config

    for old, new in (("--desirable_loss_weight", "--model.desirable_weight"),
                     ("--undesirable_loss_weight", "--model.undesirable_weight")):
        with pytest.raises(ConfigError, match=f"unknown flag {old}: renamed in OpenRLHF 0.10.2; use {new}"):
            parse_config("kto", [old, "2"], check=False)
    cfg = parse_config("kto", ["--model.desirable_weight", "1.33", "--data.label_key", "ok"], check=False)
    assert cfg.model.desirable_weight == 1.33 and cfg.data.label_key == "ok" and cfg.model.beta == 0.1


def test_a_step_of_one_row_is_refused_before_anything_loads(tmp_path, capsys):
    from posttrain.cli import train_kto

    with pytest.raises(SystemExit) as exit_info:  # the model path does not even exist
        train_kto.main(kto_flags(tmp_path / "no-model", tmp_path, tmp_path / "out", "--train.batch_size", 1))
    assert exit_info.value.code == 2
    assert "--train.batch_size 1: KTO estimates its KL term from each row's prompt with another row's" \
        in capsys.readouterr().err


def test_an_eval_set_that_leaves_fewer_than_two_evaluated_rows_is_refused():
    """An evaluation runs the largest multiple of the data-parallel size of the rows: 3 rows on 4 ranks
    evaluate none, which used to fail at the first evaluation, after training had started."""
    from posttrain.data.errors import DataError
    from posttrain.trainers.kto import _check_eval_rows

    _check_eval_rows(2, 1, "e.jsonl")
    _check_eval_rows(3, 2, "e.jsonl")  # 2 evaluated
    with pytest.raises(DataError, match=r"e\.jsonl: 1 row, and KTO needs 2 evaluated rows"):
        _check_eval_rows(1, 1, "e.jsonl")
    with pytest.raises(DataError, match=r"3 rows \(4 data-parallel ranks evaluate 0: a multiple of 4\)"):
        _check_eval_rows(3, 4, "e.jsonl")
