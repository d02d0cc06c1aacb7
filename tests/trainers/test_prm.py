"""`posttrain prm` (trainers/prm.py): the step loss is Σ ℓ / (the optimizer step's labelled steps), so two
micro-batches (padded or packed) make the one-batch step; a nano model learns step labels it can read
(held-out step accuracy from its start to above the majority class); a resumed run (packed, LoRA) ends where
the uninterrupted one does; every export holds prm.json; bad rows, tokens and flags exit 2 with one line."""
import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from posttrain.utils.metrics import read_metrics


def prm_flags(model, data, out, *extra) -> list[str]:
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data),
            "--model.placeholder_token", "@", "--model.reward_tokens", "+", "-", "--data.max_len", "48",
            "--train.batch_size", "16", "--train.micro_batch_size", "16", "--adam.lr", "3e-3",
            "--ckpt.output_dir", str(out), "--eval.dataset", str(data), "--eval.split", "test",
            *map(str, extra)]


def parity_rows(n: int, seed: int) -> list[dict]:
    """Steps that are single digits ("7 @"), "+" for an even digit: labels a nano model reads in a few steps
    (the synthetic addition chains need arithmetic it does not learn in a test's budget). About 45% "+"."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = [rng.randrange(10) for _ in range(rng.randint(2, 4))]
        rows.append({"input": "\n".join(f"{d} @" for d in digits),
                     "label": ["+" if d % 2 == 0 else "-" for d in digits]})
    return rows


@pytest.fixture(scope="session")
def prm_dir(tmp_path_factory):
    """train.jsonl (128 rows) and test.jsonl (64 rows) of `parity_rows`."""
    from posttrain.data.synthetic import write_jsonl

    path = tmp_path_factory.mktemp("prm")
    write_jsonl(parity_rows(128, seed=0), path / "train.jsonl")
    write_jsonl(parity_rows(64, seed=1), path / "test.jsonl")
    return path


def logged(run, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run / "metrics.jsonl") if key in r]


def objective_and_items(tok, rows, packing=False):
    from posttrain.data.process_reward_dataset import ProcessRewardDataset
    from posttrain.trainers.prm import PRMObjective

    at, reward = tok.convert_tokens_to_ids("@"), [tok.convert_tokens_to_ids(t) for t in "+-"]
    items = ProcessRewardDataset(rows, tok, 48, placeholder="@", placeholder_id=at, reward_tokens=["+", "-"],
                                 token_id=tok.convert_tokens_to_ids).items
    return PRMObjective(tok.pad_token_id, packing, at, reward, soft=False), items


# ---- the loss -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [False, True])
def test_two_micro_batches_make_the_one_batch_step(tiny_model_dir, packing):
    """The step's loss and gradient from 2 micro-batches (each divided by the step's 11 steps) equal one
    micro-batch's, and the loss is the mean over the steps of −log softmax(z)_y, z the logits of "+" and "-"
    at each placeholder, each row run alone."""
    from posttrain.models import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    obj, items = objective_and_items(tok, parity_rows(4, seed=5), packing)
    n = sum(obj.units(it) for it in items)
    assert n == 11
    with torch.no_grad():
        by_hand = []
        for it in items:
            logits = model(input_ids=torch.tensor([it["input_ids"]])).logits[0]
            at = [i for i, t in enumerate(it["input_ids"]) if t == tok.convert_tokens_to_ids("@")]
            z = logits[at][:, [tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")]]
            by_hand += (-torch.log_softmax(z.float(), -1)[range(len(at)), it["step_labels"]]).tolist()
    grads, losses = [], []
    for groups in ([items], [items[:1], items[1:]]):
        model.zero_grad()
        total, stats_sum = 0.0, 0.0
        for group in groups:
            loss, stats = obj.loss(model, obj.collate(group), num_units=n)
            loss.backward()
            total, stats_sum = total + float(loss), stats_sum + stats["loss_sum"]
        losses.append(total)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        assert stats_sum == pytest.approx(sum(by_hand), rel=1e-5)
    assert losses[0] == pytest.approx(sum(by_hand) / n, rel=1e-5) and losses[1] == pytest.approx(losses[0],
                                                                                                  rel=1e-5)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-5)


def test_soft_labels_train_with_the_soft_cross_entropy(tiny_model_dir):
    """Probabilities as labels: the batch carries them as floats and the loss is the mean over the steps of
    −(p log s_+ + (1 − p) log s_−), s the softmax over the logits of "+" and "-" at the placeholder."""
    from posttrain.data.process_reward_dataset import ProcessRewardDataset
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.prm import PRMObjective

    tok, model = load_tokenizer(tiny_model_dir), load_causal_lm(tiny_model_dir)
    at, plus, minus = (tok.convert_tokens_to_ids(t) for t in "@+-")
    rows = [{"input": "1 @\n2 @", "label": [0.25, 1.0]}, {"input": "3 @", "label": [0.5]}]
    items = ProcessRewardDataset(rows, tok, 48, placeholder="@", placeholder_id=at, reward_tokens=["+", "-"],
                                 token_id=tok.convert_tokens_to_ids).items
    obj = PRMObjective(tok.pad_token_id, False, at, [plus, minus], soft=True)
    batch = obj.collate(items)
    assert batch["step_labels"].dtype == torch.float32 and batch["step_labels"].tolist() == [0.25, 1.0, 0.5]
    with torch.no_grad():
        loss, stats = obj.loss(model, batch, num_units=3)
        want = []
        for it in items:
            logits = model(input_ids=torch.tensor([it["input_ids"]])).logits[0]
            rows_at = [i for i, t in enumerate(it["input_ids"]) if t == at]
            for pos, p in zip(rows_at, it["step_labels"]):
                log_s = torch.log_softmax(logits[pos, [plus, minus]].float(), -1)
                want.append(float(-(p * log_s[0] + (1 - p) * log_s[1])))
    assert float(loss) == pytest.approx(sum(want) / 3, rel=1e-5) and stats["acc_count"] == 3


# ---- real runs ------------------------------------------------------------------------------------------
def heldout_accuracy(model_dir, data_dir) -> float:
    from posttrain.data.readers import read_file
    from posttrain.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(model_dir)
    obj, items = objective_and_items(tok, read_file(str(data_dir / "test.jsonl")))
    with torch.no_grad():
        _, stats = obj.loss(load_causal_lm(model_dir), obj.collate(items), 1.0)
    return stats["acc_sum"] / stats["acc_count"]


def test_a_nano_prm_learns_held_out_step_labels(tiny_model_dir, prm_dir, tmp_path):
    """8 steps on 128 rows: the held-out step accuracy rises from the untrained model's to well above the
    majority class's; the final folder holds prm.json and the summary names loss and acc."""
    from posttrain.cli.main import main
    from posttrain.models.prm_spec import PRMSpec, load_prm_spec

    out = tmp_path / "prm"
    main(["prm", *prm_flags(tiny_model_dir, prm_dir, out, "--train.max_epochs", 1, "--eval.steps", 8)])
    test = [json.loads(line) for line in (prm_dir / "test.jsonl").read_text().splitlines()]
    labels = [v for r in test for v in r["label"]]
    majority = max(labels.count("+"), labels.count("-")) / len(labels)
    start = heldout_accuracy(tiny_model_dir, prm_dir)
    end = logged(out, "eval/acc")[-1]
    assert end == pytest.approx(heldout_accuracy(out, prm_dir), abs=1e-6)
    assert end > start + 0.15 and end > majority + 0.1, (start, majority, end)
    losses = logged(out, "train/loss")
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert load_prm_spec(out) == PRMSpec("@", ["+", "-"], "\n")


def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tiny_model_dir, prm_dir, tmp_path):
    """Packed rows, a LoRA model, 2 micro-batches per step, a checkpoint (and its HF export, which holds
    prm.json) at step 2: a run resumed from it logs steps 3-4 as the straight run does and exports the same
    adapter."""
    from posttrain.cli import train_prm

    common = ("--data.max_samples", 32, "--train.batch_size", 8, "--train.micro_batch_size", 4,
              "--ds.packing_samples",
              "--ds.lora.rank", 4, "--ds.lora.alpha", 8, "--ckpt.save_steps", 2, "--ckpt.save_hf",
              "--data.step_separator", "\n\n")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_prm.main(prm_flags(tiny_model_dir, prm_dir, straight / "run", *common, "--ckpt.path",
                             straight / "ck"))
    spec = json.loads((straight / "ck" / "global_step2_hf" / "prm.json").read_text())
    assert spec == {"placeholder_token": "@", "reward_tokens": ["+", "-"], "step_separator": "\n\n"}
    shutil.copytree(straight / "ck" / "global_step2", resumed / "ck" / "global_step2")
    train_prm.main(prm_flags(tiny_model_dir, prm_dir, resumed / "run", *common, "--ckpt.path",
                             resumed / "ck", "--ckpt.load_enable"))

    def steps(run):
        return {r["step"]: (r["train/loss"], r["train/acc"]) for r in read_metrics(run / "metrics.jsonl")
                if "train/loss" in r and r["step"] > 2}

    assert steps(resumed / "run") == steps(straight / "run") and len(steps(straight / "run")) == 2
    want, got = (load_file(str(next((d / "run").glob("adapter_model.safetensors"), d / "run" /
                                    "model.safetensors"))) for d in (straight, resumed))
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=0, rtol=0)


def test_without_reward_tokens_the_vocabulary_is_trained_and_no_prm_json_is_written(tiny_model_dir, prm_dir,
                                                                                     tmp_path, capsys):
    from posttrain.cli import train_prm

    out = tmp_path / "vocab"
    argv = prm_flags(tiny_model_dir, prm_dir, out, "--data.max_samples", 16)
    at = argv.index("--model.reward_tokens")
    train_prm.main(argv[:at] + argv[at + 3:])
    assert not (out / "prm.json").exists() and (out / "model.safetensors").exists()
    assert "RL pass --reward.prm_reward_tokens" in capsys.readouterr().err
    first = logged(out, "train/loss")[0]
    assert first > 5.0  # cross entropy over ~2000 tokens of an untrained model, not over two


# ---- one-line errors ------------------------------------------------------------------------------------
def exit_2(argv, capsys) -> str:
    """The error of `posttrain prm argv`, which exits 2 with one `posttrain prm: error:` line (after the
    start-up's info lines) and nothing after it."""
    from posttrain.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["prm", *map(str, argv)])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [i for i, line in enumerate(err) if line.startswith("posttrain prm: error: ")]
    assert exit_info.value.code == 2 and len(errors) == 1 and errors[0] == len(err) - 1, err
    return err[-1]


@pytest.mark.parametrize("row,message", [
    ({"input": "1 @\n2 @", "label": ["+"]}, "row 2: 2 placeholders '@' in the text but 1 labels under"),
    ({"input": "1 @"}, "row 2: missing key 'label'"),
    ({"input": "1 @", "label": ["?"]}, "row 2: label '?' under 'label' is not one of --model.reward_tokens"),
    ({"prompt": "", "completions": [], "labels": []}, "row 2: key 'completions' must be a non-empty list"),
])
def test_bad_rows_exit_2_naming_file_and_row(tiny_model_dir, tmp_path, capsys, row, message):
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(json.dumps({"input": "1 @", "label": ["-"]}) + "\n" + json.dumps(row) + "\n")
    line = exit_2(prm_flags(tiny_model_dir, data, tmp_path / "out", "--eval.dataset", data, "--eval.split",
                            "train"), capsys)
    assert f"{data}, {message}" in line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing left behind


@pytest.mark.parametrize("flags,message", [
    (["--model.placeholder_token", "ки"], "the placeholder token 'ки' is 2 tokens in this tokenizer"),
    (["--model.reward_tokens", "+", "ab"], "the reward token 'ab' is 2 tokens"),
])
def test_a_token_that_is_not_one_token_exits_2(tiny_model_dir, prm_dir, tmp_path, capsys, flags, message):
    assert message in exit_2(prm_flags(tiny_model_dir, prm_dir, tmp_path / "out", *flags), capsys)


def test_flags_are_checked_before_anything_loads(tmp_path, capsys):
    """The model folder does not even exist: the flag rules answer first."""
    from posttrain.cli.main import main

    base = ["--model.model_name_or_path", tmp_path / "none", "--data.dataset", tmp_path]
    assert "--model.placeholder_token: required" in exit_2(base, capsys)
    at = ["--model.placeholder_token", "@"]
    assert "--model.reward_tokens +: needs at least two tokens" in exit_2(
        [*base, *at, "--model.reward_tokens", "+"], capsys)
    with pytest.raises(SystemExit):  # with another problem: --ds.ring_attn_size 2 needs 2 ranks
        main(["prm", *map(str, [*base, *at, "--ds.ring_attn_size", 2, "--ds.packing_samples"])])
    assert "--ds.ring_attn_size 2: posttrain prm reads the logits at every placeholder" in \
        capsys.readouterr().err
    for old, new in (("--placeholder_token", "--model.placeholder_token"),
                     ("--reward_tokens", "--model.reward_tokens")):
        assert f"unknown flag {old}: OpenRLHF 0.9's train_prm flag; use {new}" in exit_2(
            [*base, old, "x"], capsys)
    assert "unknown flag --input_key: renamed in OpenRLHF 0.10.2; use --data.input_key" in exit_2(
        [*base, *at, "--input_key", "x"], capsys)
