"""SFT end to end on the tiny local model: learning, split invariance, packing, resume, errors."""
import shutil

import pytest
import torch
from sft_helpers import assert_same_weights

from posttrain.utils.metrics import read_metrics


def test_sft_loss_falls_and_run_dir_is_complete(run_sft, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_PLOTS", "1")  # the suite's runs skip their charts (tests/conftest.py)
    out = run_sft("--train.max_epochs", 3, "--eval.steps", 4, "--adam.lr", 3e-3)
    rows = read_metrics(out / "metrics.jsonl")
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    train = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(train) == 24 and len(evals) >= 6
    assert evals[-1] < 0.6 * evals[0], evals
    assert sum(train[-4:]) / 4 < 0.5 * sum(train[:4]) / 4
    assert {"config.yaml", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert {p.name for p in (out / "plots").iterdir()} == {"train.png", "eval.png"}


@pytest.mark.slow
def test_micro_batch_accumulation_and_dynamic_batch_give_same_weights(run_sft):
    one = run_sft("--train.micro_batch_size", 8, name="one")
    accum = run_sft("--train.micro_batch_size", 2, name="accum")
    dyn = run_sft("--train.micro_batch_size", 1, "--train.dynamic_batch_enable",
                  "--train.max_tokens_per_gpu", 70, name="dyn")
    packed = run_sft("--train.micro_batch_size", 4, "--ds.packing_samples", name="packed")
    for other in (accum, dyn, packed):
        assert_same_weights(one, other, atol=2e-6)
    steps = read_metrics(dyn / "metrics.jsonl")
    # the token budget really split differently
    assert any(r["train/micro_batches"] not in (8,) for r in steps)


def test_packed_and_padded_batches_give_same_logprobs_and_loss(tiny_model_dir, arithmetic_dir):
    from posttrain.data import SFTDataset, load_rows
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.sft import SFTObjective

    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, "fp32")
    ds = SFTDataset(load_rows(str(arithmetic_dir), None, "train", 0, 5), tok, 48, input_key="prompt",
                    output_key="response", apply_chat_template=True)
    items = [ds[i] for i in range(5)]
    units = sum(SFTObjective(0, False).units(it) for it in items)
    losses = {}
    for packing in (False, True):
        obj = SFTObjective(tok.pad_token_id, packing)
        model.zero_grad()
        loss, stats = obj.loss(model, obj.collate(items), units)
        loss.backward()
        losses[packing] = (loss.item(), stats, model.model.embed_tokens.weight.grad.clone())
    assert losses[True][0] == pytest.approx(losses[False][0], abs=1e-6)
    assert losses[True][1]["loss_count"] == losses[False][1]["loss_count"] == units
    torch.testing.assert_close(losses[True][2], losses[False][2], atol=1e-6, rtol=0)
    # no label crosses a sample boundary: the first token of every packed sample is never a target
    packed = SFTObjective(0, True).collate(items)
    starts = (packed["position_ids"][0] == 0).nonzero().flatten()
    assert len(starts) == 5 and packed["loss_mask"][0, starts].sum() == 0


def test_resume_reproduces_uninterrupted_run(run_sft, tmp_path):
    ckpt_a = tmp_path / "ckpt_a"
    # 64 samples / batch 8 = 8 steps per epoch; 2 epochs = 16 steps, checkpoints at 6 and 12
    full = run_sft("--train.max_epochs", 2, "--ckpt.path", ckpt_a, "--ckpt.save_steps", 6,
                   "--ckpt.max_num", 5, name="full")
    assert sorted(p.name for p in ckpt_a.glob("global_step*")) == ["global_step12", "global_step6"]
    # "crash" after step 6: only that checkpoint survives; resume runs across the epoch boundary
    ckpt_b = tmp_path / "ckpt_b"
    ckpt_b.mkdir()
    shutil.copytree(ckpt_a / "global_step6", ckpt_b / "global_step6")
    resumed = run_sft("--train.max_epochs", 2, "--ckpt.path", ckpt_b, "--ckpt.save_steps", 6,
                      "--ckpt.load_enable", name="resumed")
    assert_same_weights(full, resumed, atol=1e-6)
    loss_full = [r["train/loss"] for r in read_metrics(full / "metrics.jsonl") if "train/loss" in r]
    loss_res = [(r["step"], r["train/loss"]) for r in read_metrics(resumed / "metrics.jsonl")
                if "train/loss" in r]
    assert [s for s, _ in loss_res] == list(range(7, 17))
    assert [v for _, v in loss_res] == pytest.approx(loss_full[6:], abs=1e-6)


def test_corrupt_checkpoint_falls_back_to_older_one(run_sft, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    run_sft("--ckpt.path", ckpt, "--ckpt.save_steps", 3, "--ckpt.save_hf", name="first")  # checkpoints 3, 6
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "global_step3_hf")  # --ckpt.save_hf export loads
    newest = ckpt / "global_step6"
    engine_files = sorted(p for p in (newest / "engine").rglob("*") if p.is_file())
    victim = max(engine_files, key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    capsys.readouterr()
    run_sft("--ckpt.path", ckpt, "--ckpt.save_steps", 3, "--ckpt.load_enable", name="second")
    err = capsys.readouterr().err
    assert "skipping checkpoint" in err and "global_step6" in err
    assert "resumed from" in err and "global_step3" in err
    assert (ckpt / "global_step3").exists()  # the older, good checkpoint is never lost


def test_rotation_keeps_the_checkpoint_with_the_best_eval_loss(run_sft, tmp_path):
    """--ckpt.max_num 2, a checkpoint every step, an evaluation every 2: rotation deletes a checkpoint without
    an evaluation first, then the worse eval loss, so the newest and the best evaluated one survive."""
    from posttrain.utils.checkpoint import read_manifest

    ckpt = tmp_path / "ckpt"
    out = run_sft("--ckpt.path", ckpt, "--ckpt.save_steps", 1, "--ckpt.max_num", 2, "--eval.steps", 2)
    losses = {r["step"]: r["eval/loss"] for r in read_metrics(out / "metrics.jsonl") if "eval/loss" in r}
    assert sorted(losses) == [2, 4, 6, 8]
    best = min((2, 4, 6), key=losses.get)
    assert sorted(p.name for p in ckpt.glob("global_step*")) == sorted([f"global_step{best}", "global_step8"])
    metric = read_manifest(ckpt / f"global_step{best}")["meta"]["metric"]
    assert metric == {"key": "eval/loss", "value": losses[best], "step": best, "higher_is_better": False}


def test_load_enable_without_checkpoint_starts_fresh(run_sft, tmp_path, capsys):
    run_sft("--ckpt.path", tmp_path / "empty", "--ckpt.load_enable", name="fresh")
    assert "no valid checkpoint" in capsys.readouterr().err


def test_pretrain_mode_trains_on_every_token(tiny_model_dir, tmp_path):
    from posttrain.cli import train_sft
    from posttrain.data.synthetic import write_jsonl

    data = tmp_path / "text"
    write_jsonl([{"text": f"the number {i} follows {i - 1}"} for i in range(1, 33)], data / "train.jsonl")
    out = tmp_path / "pt"
    train_sft.main(["--model.model_name_or_path", tiny_model_dir, "--data.dataset", str(data),
                    "--data.input_key", "text", "--model.pretrain_mode_enable", "--train.batch_size", "8",
                    "--train.micro_batch_size", "4", "--train.max_epochs", "2", "--adam.lr", "3e-3",
                    "--ckpt.output_dir", str(out)])
    losses = [r["train/loss"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]


def test_multiturn_sft_runs(tiny_model_dir, tmp_path):
    from posttrain.cli import train_sft
    from posttrain.data.synthetic import make_arithmetic_rows, write_jsonl

    rows = make_arithmetic_rows(16, seed=5, difficulty=0)
    convs = [{"messages": a["messages"] + b["messages"]} for a, b in zip(rows[::2], rows[1::2])]
    write_jsonl(convs, tmp_path / "chat" / "train.jsonl")
    out = tmp_path / "mt"
    train_sft.main(["--model.model_name_or_path", tiny_model_dir, "--data.dataset", str(tmp_path / "chat"),
                    "--data.input_key", "messages", "--data.apply_chat_template", "--data.multiturn",
                    "--train.batch_size", "4", "--train.micro_batch_size", "2",
                    "--ckpt.output_dir", str(out)])
    # 2 steps x 2 epochs (SFT default)
    assert len([r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]) == 4
    cfg = (out / "config.yaml").read_text()
    assert "multiturn: true" in cfg


def test_lora_sft_saves_an_adapter_that_loads_on_the_base(run_sft, tiny_model_dir):
    out = run_sft("--ds.lora.rank", 4, "--ds.lora.alpha", 8, "--ds.lora.target_modules", "q_proj", "v_proj",
                  "--adam.lr", 1e-2, "--train.max_epochs", 2)
    names = {p.name for p in out.iterdir()}
    assert "adapter_config.json" in names and "adapter_model.safetensors" in names
    assert "model.safetensors" not in names  # only the adapter is saved, as in OpenRLHF
    losses = [r["train/loss"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert losses[-1] < losses[0]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_muon_optimizer_trains(run_sft):
    out = run_sft("--optim", "muon", "--muon.lr", 0.02, "--adam.lr", 3e-3, "--train.max_epochs", 2)
    losses = [r["train/loss"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert losses[-1] < 0.8 * losses[0]
