"""Reward-model training: the reward position, loss invariances, learning on held-out pairs, the
value-head prefix round trip, the OpenRLHF-style launch command, LoRA, reward statistics and errors."""
import json
import math
import os
import shlex
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain.data.preference_dataset import PreferenceDataset
from posttrain.data.synthetic import make_preference_rows, write_jsonl
from posttrain.models import forward_values, load_score_model, load_tokenizer
from posttrain.models.setup import ModelSetup
from posttrain.trainers.rm import RMObjective
from posttrain.trainers.single_model_loop import summarize
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is fastest


def carry_pairs(n: int, seed: int) -> list[dict]:
    """Difficulty-0 additions (`make_preference_rows`) whose rejected answer has the carry wrong:
    a + b - 10 when a + b >= 10 (carry forgotten), a + b + 10 otherwise (carry invented). Judging
    the answer alone gets at most 75% of these pairs right; the rest needs the prompt (does a + b
    carry?). The pairs' own rejected answers (a + b ± 1..5) need exact addition, which the SFT-ed nano
    model does not know (its log-probs prefer the right answer in ~50% of pairs) and an RM on it
    learns only slowly (~80% held-out after 300 steps of 64 pairs)."""
    rows = make_preference_rows(n, seed=seed, difficulty=0)
    for row in rows:
        value = int(row["chosen"])
        row["rejected"] = str(value - 10 if value >= 10 else value + 10)
    return rows


@pytest.fixture(scope="module")
def carry_dir(tmp_path_factory):
    """train.jsonl (512 pairs, seed 1) and test.jsonl (64 held-out pairs, seed 2)."""
    path = tmp_path_factory.mktemp("carry")
    write_jsonl(carry_pairs(512, seed=1), path / "train.jsonl")
    write_jsonl(carry_pairs(64, seed=2), path / "test.jsonl")
    return path


@pytest.fixture(scope="module")
def nano_rm(tiny_model_dir):
    torch.manual_seed(0)
    return load_score_model(tiny_model_dir, new_head_ok=True), load_tokenizer(tiny_model_dir)


def pairs(tok, n, seed=1, **kw):
    ds = PreferenceDataset(make_preference_rows(n, seed=seed), tok, 48, prompt_key="prompt", **kw)
    return [ds[i] for i in range(len(ds))]


def test_reward_is_read_at_the_last_real_token_left_right_and_packed(nano_rm):
    model, tok = nano_rm
    items = pairs(tok, 3, apply_chat_template=True)
    seqs = [it["chosen_ids"] for it in items] + [it["rejected_ids"] for it in items]
    assert len({len(s) for s in seqs}) > 1  # the padding really differs between rows
    with torch.no_grad():
        alone = torch.stack([forward_values(model, {"input_ids": torch.tensor([s])})[0, -1] for s in seqs])
        obj = RMObjective(tok.pad_token_id, packing=False)
        right = obj.collate(items)
        width = right["input_ids"].shape[1]
        left_ids = torch.full_like(right["input_ids"], tok.pad_token_id)
        left_mask = torch.zeros_like(right["attention_mask"])
        for i, s in enumerate(seqs):
            left_ids[i, width - len(s):] = torch.tensor(s)
            left_mask[i, width - len(s):] = 1
        packed = RMObjective(tok.pad_token_id, packing=True).collate(items)
        for batch in (right, {"input_ids": left_ids, "attention_mask": left_mask}, packed):
            torch.testing.assert_close(RMObjective.rewards(model, batch), alone, atol=1e-5, rtol=0)
    # a right-padded row's last real token is not the last column
    assert right["attention_mask"][:, -1].min() == 0


def test_trained_reward_is_the_reward_serve_rm_reads_from_ppo_queries(nano_rm, tmp_path):
    """Regression: the chat template renders a newline after <|im_end|>; a side that kept it was
    scored at the newline in training, while PPO's reward source scores a generated response at
    its EOS, so the RM's preferences did not carry over to PPO."""
    from posttrain.models import save_pretrained
    from posttrain.rewards.reward_model import RewardModelSource

    model, tok = nano_rm
    rows = make_preference_rows(4, seed=5)
    items = PreferenceDataset(rows, tok, 48, prompt_key="prompt", apply_chat_template=True)
    save_pretrained(model, tok, tmp_path / "rm")
    source = RewardModelSource(tmp_path / "rm")
    obj = RMObjective(tok.pad_token_id, packing=False)
    with torch.no_grad():
        trained = obj.rewards(model, obj.collate([items[i] for i in range(4)]))
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                       add_generation_prompt=True) for r in rows]
    queries = [p + r[side] + tok.eos_token for side in ("chosen", "rejected") for p, r in zip(prompts, rows)]
    read = source.score(queries, prompts * 2, [r["answer"] for r in rows] * 2).rewards
    torch.testing.assert_close(read.float(), trained, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bos", [False, True])
def test_ppo_scores_the_sampled_ids_as_the_rm_trained_on_them(nano_rm, tmp_path, bos):
    """PPO's reward-model source scores the rollout's own token ids (prompt + response as sampled):
    for a finished response (EOS sampled) exactly the reward the RM trainer computes for that pair,
    also with a BOS-adding tokenizer (no second BOS from re-tokenising); a truncated response (no
    EOS sampled) is scored at its last token, not as if it had finished."""
    import copy

    from tokenizers import processors

    from posttrain.data import PromptDataset
    from posttrain.models import save_pretrained
    from posttrain.rewards.reward_model import RewardModelSource
    from posttrain.rollout.single_turn import Rollout, score_rollouts

    model, tok = nano_rm
    if bos:
        tok = copy.deepcopy(tok)
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    rows = make_preference_rows(4, seed=5)
    items = PreferenceDataset(rows, tok, 48, prompt_key="prompt", apply_chat_template=True)
    save_pretrained(model, tok, tmp_path / "rm")
    source = RewardModelSource(tmp_path / "rm")
    obj = RMObjective(tok.pad_token_id, packing=False)
    with torch.no_grad():
        trained = obj.rewards(model, obj.collate([items[i] for i in range(4)]))
        cut = [{k: v[:-1] if k.endswith(("_ids", "_mask")) else v for k, v in items[i].items()}
               for i in range(4)]
        trained_cut = obj.rewards(model, obj.collate(cut))
    prompts = PromptDataset(rows, tok, input_key="prompt", apply_chat_template=True)
    sampled = [(prompts[i].token_ids, tok(r[side], add_special_tokens=False)["input_ids"])
               for side in ("chosen", "rejected") for i, r in enumerate(rows)]
    finished = [Rollout(p, out + [tok.eos_token_id], [0.0] * (len(out) + 1), "stop", "", "")
                for p, out in sampled]
    truncated = [Rollout(p, out, [0.0] * len(out), "length", "", "") for p, out in sampled]
    torch.testing.assert_close(score_rollouts(source, tok, finished).rewards.float(), trained, atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(score_rollouts(source, tok, truncated).rewards.float(), trained_cut, atol=1e-5,
                               rtol=0)
    assert not torch.allclose(trained, trained_cut)


def test_loss_formula_split_and_packing_invariance(nano_rm):
    model, tok = nano_rm
    items = pairs(tok, 4, input_template="{} ")
    for it, m in zip(items, (0.5, -1.0, 2.0, 0.0)):
        it["margin"] = m
    obj = RMObjective(tok.pad_token_id, packing=False, use_margin=True)

    def run(objective, groups):
        model.zero_grad()
        total, sums = 0.0, {}
        for g in groups:
            loss, stats = objective.loss(model, objective.collate(g), 4.0)
            loss.backward()
            total += float(loss.detach())
            sums = {k: sums.get(k, 0.0) + v for k, v in stats.items()}
        return total, sums, model.score.weight.grad.clone()

    whole, sums, grad = run(obj, [items])
    with torch.no_grad():
        r = obj.rewards(model, obj.collate(items))
    diff = r[:4] - r[4:] - torch.tensor([0.5, -1.0, 2.0, 0.0])
    assert whole == pytest.approx(float(torch.log1p(torch.exp(-diff)).mean()), abs=1e-6)  # -logσ(Δ - m)
    assert sums["acc_sum"] == float((r[:4] > r[4:]).sum()) and sums["loss_count"] == 4
    assert sums["reward_count"] == 8 and sums["reward_sum"] == pytest.approx(float(r.sum()), abs=1e-5)
    split, _, grad_split = run(obj, [items[:1], items[1:]])
    packed, _, grad_packed = run(RMObjective(tok.pad_token_id, packing=True, use_margin=True),
                                 [items[:3], items[3:]])
    assert split == pytest.approx(whole, abs=1e-6) and packed == pytest.approx(whole, abs=1e-6)
    torch.testing.assert_close(grad_split, grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad_packed, grad, atol=1e-6, rtol=0)
    logexp, _, _ = run(RMObjective(tok.pad_token_id, packing=False, loss_type="logexp"), [items])
    assert logexp == pytest.approx(float(torch.log1p(torch.exp(r[4:] - r[:4])).mean()), abs=1e-6)


def test_reward_mean_and_std_from_sums():
    # rewards 1, 2, 3, 6: mean 3, sample std sqrt(14/3)
    out = summarize({"reward_sum": 12.0, "reward_sqsum": 50.0, "reward_count": 4.0, "acc_sum": 1.0,
                     "acc_count": 2.0}, "eval")
    assert out == pytest.approx({"eval/reward_mean": 3.0, "eval/reward_std": math.sqrt(14 / 3),
                                 "eval/acc": 0.5})


def padded(seqs, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    return ids, mask


@pytest.mark.slow
def test_rm_learns_held_out_preferences_and_stores_reward_statistics(sft_nano, carry_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from posttrain.cli import train_rm
    from posttrain.rewards.reward_model import RewardModelSource

    sft, _ = sft_nano
    out = tmp_path / "rm"
    final = train_rm.main(["--model.model_name_or_path", str(sft), "--data.dataset", str(carry_dir),
                           "--data.prompt_key", "prompt", "--data.input_template", "{} ",
                           "--data.max_len", "32", "--eval.dataset", str(carry_dir), "--eval.split", "test",
                           "--train.batch_size", "16", "--train.micro_batch_size", "16",
                           "--train.max_epochs", "5", "--adam.lr", "1e-3", "--ckpt.output_dir", str(out)])
    assert final["eval/acc"] > 0.9, final
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(train) == 160 and sum(r["train/loss"] for r in train[-10:]) / 10 < 0.2
    assert train[0]["train/acc"] <= 0.75
    # the reward statistics of the held-out set are stored for --reward.normalize_enable
    config = json.loads((out / "config.json").read_text())
    assert ((config["mean"], config["std"])
            == pytest.approx((final["eval/reward_mean"], final["eval/reward_std"])))
    tok = load_tokenizer(out)
    held_out = PreferenceDataset(carry_pairs(64, seed=2), tok, 32, prompt_key="prompt", input_template="{} ")
    seqs = [it[f"{side}_ids"] for side in ("chosen", "rejected") for it in held_out]
    ids, mask = padded(seqs, tok.pad_token_id)
    source = RewardModelSource(out, normalize=True)
    normed = source.score([""] * len(seqs), sequences=ids, attention_mask=mask).rewards
    assert (float(normed.mean()) == pytest.approx(0.0, abs=1e-4)
            and float(normed.std()) == pytest.approx(1.0, abs=1e-4))
    # the default head name `score`: plain transformers loads the same reward model
    hf = AutoModelForSequenceClassification.from_pretrained(out, num_labels=1).eval()
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits[:, 0]
    torch.testing.assert_close(logits, source.values(ids, mask), atol=1e-5, rtol=0)


# OpenRLHF 0.10.2's examples/scripts/train_rm.sh with dotted flags, as in
# tests/unit/config/test_launch_scripts.py; the local model, dataset and output replace the hub names, and the
# GPU-only flags are left out (--ds.param_dtype bf16, --ds.attn_implementation flash_attention_2;
# --logger.wandb.key needs a network)
TRAIN_RM_SH = """
   --ckpt.output_dir {out} \\
   --ckpt.save_steps -1 \\
   --logger.logging_steps 1 \\
   --eval.steps -1 \\
   --train.batch_size 256 \\
   --train.micro_batch_size 1 \\
   --model.model_name_or_path {model} \\
   --train.max_epochs 1 \\
   --data.max_len 8192 \\
   --ds.zero_stage 3 \\
   --adam.lr 9e-6 \\
   --data.dataset {data} \\
   --data.apply_chat_template \\
   --data.chosen_key chosen \\
   --data.rejected_key rejected \\
   --ds.packing_samples \\
   --model.gradient_checkpointing_enable \\
   --ds.value_head_prefix value_head
"""


@pytest.mark.e2e
def test_train_rm_sh_runs_and_value_head_prefix_round_trips(sft_nano, tmp_path):
    from posttrain.rewards.reward_model import RewardModelSource

    sft, _ = sft_nano
    data, out = tmp_path / "data", tmp_path / "rm"
    rows = [{"chosen": r["chosen_messages"], "rejected": r["rejected_messages"]}
            for r in make_preference_rows(256, seed=3)]  # whole conversations, as in OpenRLHF's datasets
    write_jsonl(rows, data / "train.jsonl")
    flags = shlex.split(TRAIN_RM_SH.format(out=out, model=sft, data=data).replace("\\\n", " "))
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.train_rm", *flags], check=False,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert len(steps) == 1 and steps[0]["train/micro_batches"] == 256
    # the head is saved under the prefix (OpenRLHF naming), not as score.*
    saved = load_file(str(out / "model.safetensors"))
    assert "value_head.weight" in saved and not any(k.startswith("score.") for k in saved)
    model = load_score_model(out, value_head_prefix="value_head")
    torch.testing.assert_close(model.score.weight, saved["value_head.weight"], atol=0, rtol=0)
    with pytest.raises(ValueError, match="value_head_prefix='head'.*no tensor head.weight"):
        load_score_model(out, value_head_prefix="head")
    # without an eval set the statistics come from the training set: check them independently
    tok = load_tokenizer(out)
    ds = PreferenceDataset(rows, tok, 8192, apply_chat_template=True)
    ids, mask = padded([it[f"{side}_ids"] for side in ("chosen", "rejected") for it in ds], tok.pad_token_id)
    rewards = RewardModelSource(out, setup=ModelSetup(value_head_prefix="value_head")).values(ids, mask)
    config = json.loads((out / "config.json").read_text())
    assert config["mean"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    assert config["std"] == pytest.approx(float(rewards.std()), rel=1e-3)


def test_lora_rm_trains_and_saves_the_score_head_with_margins(sft_nano, tmp_path):
    from posttrain.cli import train_rm
    from posttrain.models.merge import merge_lora

    sft, _ = sft_nano
    data = tmp_path / "data"
    write_jsonl([{**r, "margin": 0.5} for r in carry_pairs(64, seed=4)], data / "train.jsonl")
    write_jsonl([{**r, "margin": 0.5} for r in carry_pairs(64, seed=2)], data / "test.jsonl")
    out = tmp_path / "lora"
    final = train_rm.main(["--model.model_name_or_path", str(sft), "--data.dataset", str(data),
                           "--data.prompt_key", "prompt", "--data.apply_chat_template",
                           "--data.max_len", "48", "--eval.dataset", str(data), "--eval.split", "test",
                           "--train.batch_size", "16", "--train.micro_batch_size", "8", "--adam.lr", "1e-2",
                           "--model.margin_loss_enable", "--ds.lora.rank", "4",
                           "--ds.lora.target_modules", "q_proj", "v_proj", "--ckpt.output_dir", str(out)])
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= names
    assert "model.safetensors" not in names
    adapter = load_file(str(out / "adapter_model.safetensors"))
    # B starts at 0: the adapters trained
    assert all(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    assert any("score" in k for k in adapter)  # the head is saved with the adapter (peft modules_to_save)
    config = json.loads((out / "config.json").read_text())
    assert config["mean"] == pytest.approx(final["eval/reward_mean"])
    # base + adapter, merged, scores the eval set exactly as training reported it
    merged = merge_lora(out, tmp_path / "merged").eval()
    tok = load_tokenizer(out)
    obj = RMObjective(tok.pad_token_id, packing=False)
    ds = PreferenceDataset(carry_pairs(64, seed=2), tok, 48, prompt_key="prompt", apply_chat_template=True)
    with torch.no_grad():
        _, stats = obj.loss(merged, obj.collate([ds[i] for i in range(len(ds))]), 64)
    assert stats["acc_sum"] / 64 == pytest.approx(final["eval/acc"])
    assert stats["reward_sum"] / 128 == pytest.approx(final["eval/reward_mean"], abs=1e-5)


def test_bad_preference_data_and_flags_fail_before_training(tiny_model_dir, tmp_path, capsys):
    from posttrain.cli import train_rm

    data = tmp_path / "bad"
    rows = make_preference_rows(4, seed=1)
    rows[2]["rejected"] = rows[2]["chosen"]
    write_jsonl(rows, data / "train.jsonl")
    base = ["--model.model_name_or_path", tiny_model_dir, "--data.dataset", str(data),
            "--data.prompt_key", "prompt", "--ckpt.output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exc:
        train_rm.main(base)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "train.jsonl" in err and "row 3" in err and "identical" in err
    with pytest.raises(SystemExit):
        train_rm.main([*base, "--data.chosen_key", "best"])
    assert ("missing from" in (err := capsys.readouterr().err) and "'best'" in err
            and "--data.chosen_key" in err)
    with pytest.raises(SystemExit):
        train_rm.main([*base, "--model.loss_type", "logexp", "--model.margin_loss_enable"])
    err = capsys.readouterr().err
    assert "--model.margin_loss_enable" in err and "--model.loss_type sigmoid" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_lora_score_head_gets_gradients(tiny_model_dir, nano_rm):
    _, tok = nano_rm
    model = load_score_model(tiny_model_dir, lora={"rank": 4, "target_modules": ["q_proj"]}, new_head_ok=True)
    obj = RMObjective(tok.pad_token_id, packing=False)
    loss, _ = obj.loss(model, obj.collate(pairs(tok, 4, input_template="{} ")), 4.0)
    loss.backward()
    trained = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is not None
               and p.grad.abs().sum() > 0}
    assert any("score" in n for n in trained) and any("lora_B" in n for n in trained)
    assert not any("embed_tokens" in n or "original_module" in n for n in trained)  # the base stays frozen


def value_head_flags(model, data, out, *extra) -> list[str]:
    from rounding import ADAM_EPS

    return [str(f) for f in (
        "--model.model_name_or_path", model, "--data.dataset", data, "--data.prompt_key", "prompt",
        "--data.apply_chat_template", "--data.max_len", 48, "--eval.dataset", data,
        "--eval.split", "test", "--train.batch_size", 16, "--adam.lr", "1e-3", "--adam.eps", ADAM_EPS,
        "--ds.value_head_prefix", "value_head",
        "--ckpt.save_steps", 2, "--ckpt.save_hf", "--ckpt.output_dir", out, *extra)]


def ring_flags(model, data, out, *extra) -> list[str]:
    from rounding import ADAM_EPS

    return [str(f) for f in (
        "--model.model_name_or_path", model, "--data.dataset", data,
        "--data.prompt_key", "prompt", "--data.apply_chat_template", "--data.max_len", 48,
        "--train.batch_size", 16, "--train.micro_batch_size", 4, "--adam.lr", "1e-3",
        "--adam.eps", ADAM_EPS, "--ds.packing_samples", "--ckpt.output_dir", out, *extra)]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_score_model_dir, tmp_path_factory):
    """This module's 2-rank runs, in one launch (`torchrun_cases`), and their inputs: "value_head_model" (the
    score model with its head stored as value_head.*) and "data" (32 training, 16 test pairs), the ZeRO-3 run
    of them ("zero3"); "ring_data" (32 training pairs) and the ring-attention run of the score model on them
    ("ring"): run -> (run folder, its `CaseRun`)."""
    import shutil

    from safetensors.torch import save_file
    from sft_helpers import torchrun_cases

    root = tmp_path_factory.mktemp("two_ranks")
    model = root / "value-head-rm"
    shutil.copytree(tiny_score_model_dir, model)
    state = load_file(str(model / "model.safetensors"))
    save_file({k.replace("score.", "value_head.", 1) if k.startswith("score.") else k: v
               for k, v in state.items()},
              str(model / "model.safetensors"), metadata={"format": "pt"})
    data, ring_data = root / "data", root / "ring_data"
    write_jsonl(carry_pairs(32, seed=4), data / "train.jsonl")
    write_jsonl(carry_pairs(16, seed=2), data / "test.jsonl")
    write_jsonl(carry_pairs(32, seed=4), ring_data / "train.jsonl")
    runs = torchrun_cases(
        [("posttrain.cli.train_rm", value_head_flags(model, data, root / "zero3", "--train.micro_batch_size",
                                                     4, "--ds.zero_stage", 3)),
         ("posttrain.cli.train_rm", ring_flags(tiny_score_model_dir, ring_data, root / "ring",
                                               "--ds.zero_stage", 3, "--ds.ring_attn_size", 2))],
        root / "logs")
    return {"value_head_model": model, "data": data, "ring_data": ring_data,
            "zero3": (root / "zero3", runs[0]), "ring": (root / "ring", runs[1])}


@pytest.mark.e2e
def test_two_process_zero3_value_head_prefix_matches_single_process(two_rank_runs, tmp_path):
    """A reward model whose head is stored as value_head.* (OpenRLHF naming), trained on 2 ranks under
    ZeRO-3: it loads straight into shards (half per rank), its head is copied into the sharded `score`
    head, and the final model, the --ckpt.save_hf export and the reward statistics equal the
    1-process run's."""
    from rounding import adam_weight_tolerance, assert_weights_within
    from sft_helpers import assert_loaded_as_shards, assert_weights_within_rounding, weights

    from posttrain.cli import train_rm

    single = tmp_path / "single"
    train_rm.main(value_head_flags(two_rank_runs["value_head_model"], two_rank_runs["data"], single,
                                   "--train.micro_batch_size", 16))
    multi, proc = two_rank_runs["zero3"]
    proc.ok()
    assert_loaded_as_shards(proc.stderr, "model")
    # the loaded models are the same (the stored head reached the shards): equal first-step loss and gradient
    steps = [[r for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r] for run in (single, multi)]
    for key in ("train/loss", "train/grad_norm"):
        assert steps[1][0][key] == pytest.approx(steps[0][0][key], abs=1e-6)
    # later steps: equal up to the rounding of summing in another order (1 micro-batch vs 2 ranks x 2)
    assert_weights_within_rounding(single, multi)
    saved = load_file(str(multi / "model.safetensors"))
    assert "value_head.weight" in saved and not any(k.startswith("score.") for k in saved)
    hf = [sorted(run.glob("checkpoints/global_step*_hf")) for run in (single, multi)]
    assert len(hf[0]) == len(hf[1]) == 1
    norms = [r["train/grad_norm"] for r in steps[0]]  # those before the step-2 copy among them
    assert_weights_within(weights(hf[0][0]), weights(hf[1][0]), adam_weight_tolerance(1e-3, norms))
    configs = [json.loads((run / "config.json").read_text()) for run in (single, multi)]
    assert configs[1]["mean"] == pytest.approx(configs[0]["mean"], abs=1e-5)
    assert configs[1]["std"] == pytest.approx(configs[0]["std"], abs=1e-5)


@pytest.mark.e2e
def test_ring_attention_over_two_ranks_matches_single_process(tiny_score_model_dir, tmp_path, two_rank_runs):
    """--ds.ring_attn_size 2 with packing: both ranks take the same packed pairs, each computes half of every
    row, and each side's reward is read at its last token from the row's values gathered over the two ranks.
    Losses, accuracies and the trained weights equal the single-process run's; the step logs what
    the ring moved."""
    from sft_helpers import assert_same_grad_norms, assert_weights_within_rounding

    from posttrain.cli import train_rm

    single = tmp_path / "single"
    train_rm.main(ring_flags(tiny_score_model_dir, two_rank_runs["ring_data"], single))
    ring, proc = two_rank_runs["ring"]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "has no effect" not in proc.stderr
    steps = [[r for r in read_metrics(run / "metrics.jsonl") if "train/loss" in r] for run in (single, ring)]
    for key in ("train/loss", "train/acc", "train/chosen_reward"):
        assert [r[key] for r in steps[1]] == pytest.approx([r[key] for r in steps[0]], abs=1e-5), key
    assert all(r["comm/cp_bytes"] > 0 and r["comm/cp_seconds"] > 0 for r in steps[1])
    assert_same_grad_norms(single, ring)
    assert_weights_within_rounding(single, ring)  # the split attention sums in another order
