"""DPO trainer: log 2 at initialisation, prompt masking, IPO / cDPO / NLL values by hand, accuracy
rising on held-out pairs, LoRA (reference = adapters disabled), and an OpenRLHF-style launch."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from posttrain.utils.metrics import read_metrics

LN2 = math.log(2.0)


def dpo_flags(model, data, out, *extra):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data),
            "--data.prompt_key", "prompt", "--data.apply_chat_template", "--data.max_len", "48",
            "--train.batch_size", "16", "--train.micro_batch_size", "8", "--ckpt.output_dir", str(out),
            "--logger.logging_steps", "1", *map(str, extra)]


@pytest.fixture(scope="module")
def pref_dir(tmp_path_factory):
    """64 training and 32 held-out pairs of single-digit additions whose preference the nano model can
    learn in a few steps: a full sentence with the right answer ("The answer is 7.") over a bare wrong
    number ("9"). (Right-over-wrong bare numbers needs arithmetic the 1M-parameter model does not learn
    in a test's budget: held-out reward accuracy stays near chance.) The SFT-ed model, trained on bare
    numbers, prefers the rejected side."""
    from posttrain.data.synthetic import make_preference_rows, write_jsonl

    path = tmp_path_factory.mktemp("pref")
    rows = [dict(r, chosen=f"The answer is {r['chosen']}.") for r in make_preference_rows(96, seed=5)]
    write_jsonl(rows[:64], path / "train.jsonl")
    write_jsonl(rows[64:], path / "test.jsonl")
    return path


def unpaired(pairs: list[dict]) -> list[dict]:
    """Pairs as KTO's unpaired rows (TRL's columns): chosen -> desirable, rejected -> undesirable."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs for side in ("chosen", "rejected")]


@pytest.fixture(scope="module")
def unpaired_dir(pref_dir, tmp_path_factory):
    """`pref_dir`'s pairs as unpaired rows (`unpaired`), train.jsonl and test.jsonl."""
    from posttrain.data.readers import read_file
    from posttrain.data.synthetic import write_jsonl

    path = tmp_path_factory.mktemp("unpaired")
    for split in ("train", "test"):
        write_jsonl(unpaired(read_file(str(pref_dir / f"{split}.jsonl"))), path / f"{split}.jsonl")
    return path


def kto_flags(model, data, out, *extra):
    return ["--model.model_name_or_path", str(model), "--data.dataset", str(data),
            "--data.apply_chat_template", "--data.max_len", "48", "--train.batch_size", "32",
            "--train.micro_batch_size", "16", "--ckpt.output_dir", str(out), *map(str, extra)]


def heldout_logprob_gap(model_dir, pref_dir) -> float:
    """Mean over held-out pairs of log π(chosen) - log π(rejected) (summed response log-probs) of a
    saved model, computed outside the trainer."""
    from posttrain.data.preference_dataset import PreferenceDataset
    from posttrain.data.readers import read_file
    from posttrain.models import forward_logits, load_causal_lm, load_tokenizer, sequence_logprobs
    from posttrain.trainers.dpo import DPOObjective

    tok = load_tokenizer(model_dir)
    rows = read_file(str(pref_dir / "test.jsonl"))
    items = list(PreferenceDataset(rows, tok, 48, prompt_key="prompt", apply_chat_template=True))
    batch = DPOObjective(pad_id=tok.pad_token_id, packing=False).collate(items)
    with torch.no_grad():
        logps = sequence_logprobs(forward_logits(load_causal_lm(model_dir), batch), batch)[0]
    return float((logps[: len(items)] - logps[len(items):]).mean())


@pytest.fixture(scope="module")
def dpo_run(sft_nano, pref_dir, tmp_path_factory):
    """DPO from the SFT-ed nano model: 2 epochs of 4 steps, evaluated on the held-out pairs."""
    from posttrain.cli import train_dpo

    out = tmp_path_factory.mktemp("dpo") / "run"
    final = train_dpo.main(dpo_flags(sft_nano[0], pref_dir, out, "--train.max_epochs", 2, "--adam.lr", "1e-3",
                                     "--eval.dataset", pref_dir, "--eval.split", "test"))
    return out, final


# ---- objective values on a hand-made batch ---------------------------------------------------------
class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are a fixed [N, T, V] tensor (a leaf, so its gradient can be read)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())

    def forward(self, **kwargs):
        assert kwargs["input_ids"].shape == self.logits.shape[:2]
        return SimpleNamespace(logits=self.logits)


def hand_batch():
    """One pair over a 4-token vocabulary. chosen = [0 1 | 2 3] (prompt 0 1, two response tokens),
    rejected = [0 1 | 2] (one response token, padded to 4 with id 0). The reference is uniform (every
    token log(1/4)); the policy puts logit ln 3 on each chosen response label (p = 3/6 = 1/2) and is
    uniform on the rejected response, with large logits on the prompt label and the padding that
    must not count. Summed response log-probs:
      π_c = 2·log(1/2) = -2 ln2,   π_r = log(1/4) = -2 ln2,
      ref_c = 2·log(1/4) = -4 ln2, ref_r = -2 ln2      →  h = (π_c - π_r) - (ref_c - ref_r) = 2 ln2."""
    from posttrain.trainers.dpo import DPOObjective

    items = [{"chosen_ids": [0, 1, 2, 3], "chosen_mask": [0, 0, 1, 1],
              "rejected_ids": [0, 1, 2], "rejected_mask": [0, 0, 1], "margin": 0.0}]
    batch = DPOObjective(pad_id=0, packing=False).collate(items)
    policy = torch.zeros(2, 4, 4)
    policy[0, 1, 2] = policy[0, 2, 3] = math.log(3.0)  # chosen response labels 2, 3 (predicted at t = 1, 2)
    policy[0, 0, 1] = policy[1, 0, 1] = 5.0  # prompt label 1 (predicted at t = 0): masked
    policy[1, 3] = 7.0  # padding: masked
    return batch, FixedLogits(policy), FixedLogits(torch.zeros(2, 4, 4))


@pytest.mark.parametrize("kind, expected", [
    # DPO: -logσ(β h), β = 0.1, h = 2 ln2
    ("dpo", -math.log(1 / (1 + math.exp(-0.2 * LN2)))),  # 0.626233
    # cDPO ε = 0.1: -(0.9) logσ(0.2 ln2) - 0.1 logσ(-0.2 ln2) = 0.9·0.626233 + 0.1·0.764862
    ("cdpo", 0.640096),
    # IPO: (h - 1/(2β))² = (2 ln2 - 5)²
    ("ipo", (2 * LN2 - 5) ** 2),  # 13.058868
    # cDPO + NLL 0.5: the chosen response's token-mean NLL is ln 2
    ("cdpo_nll", 0.640096 + 0.5 * LN2),
])
def test_objective_values_and_rewards_by_hand(kind, expected):
    from posttrain.trainers.dpo import DPOObjective

    batch, policy, ref = hand_batch()
    obj = DPOObjective(pad_id=0, packing=False, beta=0.1, ipo=kind == "ipo",
                       label_smoothing=0.1 if kind.startswith("cdpo") else 0.0,
                       nll_loss_coef=0.5 if kind == "cdpo_nll" else 0.0, ref_model=ref)
    loss, stats = obj.loss(policy, batch, num_units=1)
    loss = loss.detach()
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert stats["loss_sum"] == pytest.approx(expected, abs=1e-5) and stats["loss_count"] == 1
    assert stats["chosen_reward_sum"] == pytest.approx(0.2 * LN2, abs=1e-6)  # β(π_c - ref_c) = 0.1 · 2 ln2
    assert stats["rejected_reward_sum"] == pytest.approx(0.0, abs=1e-6)  # β(π_r - ref_r) = 0
    assert stats["margin_sum"] == pytest.approx(0.2 * LN2, abs=1e-6) and stats["acc_sum"] == 1.0
    assert stats["nll_sum"] == pytest.approx(LN2, abs=1e-6)
    # the loss is the micro-batch's share of a step of `num_units` pairs
    half, _ = obj.loss(policy, batch, num_units=2)
    assert float(half.detach()) == pytest.approx(expected / 2, abs=1e-6)


class NoReference(torch.nn.Module):
    """A reference that fails the test if anything runs it."""

    def forward(self, **kwargs):
        raise AssertionError("a reference-free loss ran the reference model")


@pytest.mark.parametrize("kind, expected, rewards, extra", [
    # hand_batch's token means: a_c = π_c/2 = -ln2, a_r = π_r/1 = -2 ln2; the chosen NLL is ln 2.
    # ORPO λ = 0.1: log odds(y_c) = -ln2 - log(1/2) = 0, log odds(y_r) = -2ln2 - log(3/4) = -ln3, so
    # L = ln3 and -logσ(ln3) = -log(3/4); loss = NLL + λ·ln(4/3); rewards λ·a
    ("orpo", LN2 + 0.1 * math.log(4 / 3), (-0.1 * LN2, -0.2 * LN2), {"or_loss_sum": 0.1 * math.log(4 / 3),
                                                                    "log_odds_ratio_sum": math.log(3.0)}),
    # SimPO β = 2, γ = 0.5: -logσ(2(a_c - a_r) - 0.5) = -logσ(2 ln2 - 0.5) = log(1 + e^(0.5 - 2 ln2))
    # = log(1 + e^0.5 / 4); rewards β·a
    ("simpo", math.log(1 + math.exp(0.5) / 4), (-2 * LN2, -4 * LN2),
     {"simpo_loss_sum": math.log(1 + math.exp(0.5) / 4)}),
    # CPO β = 2, α = 0.5: π_c = π_r, so -logσ(0) = ln2, plus 0.5 · ln2 (NLL); rewards β·π
    ("cpo", 1.5 * LN2, (-4 * LN2, -4 * LN2), {"cpo_loss_sum": LN2}),
], ids=["orpo", "simpo", "cpo"])
def test_reference_free_objective_values_by_hand(kind, expected, rewards, extra):
    """ORPO / SimPO / CPO on hand_batch, with a reference that must not run (and none at all: the policy
    has no LoRA adapters to disable, which DPO would need)."""
    from posttrain.trainers.dpo import DPOObjective

    batch, policy, _ = hand_batch()
    for ref in (NoReference(), None):
        obj = DPOObjective(pad_id=0, packing=False, beta=2.0, loss_type=kind, cpo_alpha=0.5, ref_model=ref)
        assert obj.reference_free
        loss, stats = obj.loss(policy, batch, num_units=1)
        assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
        assert stats["loss_sum"] == pytest.approx(expected, abs=1e-6) and stats["loss_count"] == 1
        assert stats["nll_sum"] == pytest.approx(LN2, abs=1e-6)
        assert (stats["chosen_reward_sum"], stats["rejected_reward_sum"]) == pytest.approx(rewards, abs=1e-6)
        assert stats["margin_sum"] == pytest.approx(rewards[0] - rewards[1], abs=1e-6)
        assert stats["acc_sum"] == float(rewards[0] > rewards[1])
        for key, value in extra.items():
            assert stats[key] == pytest.approx(value, abs=1e-6), key
        loss.backward()  # the gradient reaches the policy's response logits
        assert policy.logits.grad[0, 1:3].abs().sum() > 0
        policy.logits.grad = None


def test_prompt_and_padding_get_no_gradient():
    from posttrain.trainers.dpo import DPOObjective

    batch, policy, ref = hand_batch()
    loss, _ = DPOObjective(pad_id=0, packing=False, nll_loss_coef=0.3, ref_model=ref).loss(policy, batch, 1)
    loss.backward()
    g = policy.logits.grad.abs().sum(-1)  # [2 rows, 4 positions]
    # position t predicts token t+1: chosen 1 (prompt) 2 3 (response) -; rejected 1 (prompt) 2
    # (response) pad -
    assert g[0, 0] == 0 and g[1, 0] == 0, "the prompt of chosen and rejected must be masked"
    assert g[1, 2] == 0 and g[1, 3] == 0 and g[0, 3] == 0, "padding / the last position must be masked"
    assert g[0, 1] > 0 and g[0, 2] > 0 and g[1, 1] > 0


def test_response_logprobs_cover_the_response_only_padded_and_packed(tiny_model_dir):
    """On real pairs: the summed log-probs of a padded and of a packed batch both equal, for every side,
    the sum over the tokens after the chat-template prompt of that sequence run alone."""
    from posttrain.algorithms.losses import token_logprobs
    from posttrain.data.preference_dataset import PreferenceDataset
    from posttrain.data.synthetic import make_preference_rows
    from posttrain.models import forward_logits, load_causal_lm, load_tokenizer, sequence_logprobs
    from posttrain.trainers.dpo import DPOObjective

    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir)
    rows = make_preference_rows(3, seed=2)
    items = list(PreferenceDataset(rows, tok, 48, prompt_key="prompt", apply_chat_template=True))
    expected = []
    for side in ("chosen", "rejected"):
        for row, it in zip(rows, items):
            prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
            k = len(tok(prompt, add_special_tokens=False)["input_ids"])
            ids = torch.tensor([it[f"{side}_ids"]])
            assert ids[0, :k].tolist() == it["chosen_ids"][:k] == it["rejected_ids"][:k]  # shared prompt
            with torch.no_grad():
                lp = token_logprobs(model(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])[0]
            expected.append(float(lp[k - 1:].sum()))  # labels k.. (the response and its EOS)
    for packing in (False, True):
        batch = DPOObjective(pad_id=tok.pad_token_id, packing=packing).collate(items)
        with torch.no_grad():
            got = sequence_logprobs(forward_logits(model, batch), batch)[0]
        torch.testing.assert_close(got, torch.tensor(expected), atol=2e-5, rtol=0)


def test_ipo_with_label_smoothing_is_refused_before_anything_loads(tmp_path, capsys):
    from posttrain.cli import train_dpo

    with pytest.raises(SystemExit) as exit_info:  # the model path does not even exist
        train_dpo.main(dpo_flags(tmp_path / "no-model", tmp_path, tmp_path / "out", "--model.ipo_enable",
                                 "--model.label_smoothing", 0.1))
    assert exit_info.value.code == 2
    assert "--model.label_smoothing 0.1 is cDPO's; IPO (--model.ipo_enable)" in capsys.readouterr().err


# ---- real runs ----------------------------------------------------------------------------------------
def test_loss_is_log2_at_step_0_and_rewards_are_logged(dpo_run):
    out, _ = dpo_run
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    first = train[0]
    assert first["train/loss"] == pytest.approx(LN2, abs=1e-5)
    assert first["train/chosen_reward"] == pytest.approx(0, abs=1e-6)
    assert first["train/rejected_reward"] == pytest.approx(0, abs=1e-6)
    assert first["train/margin"] == pytest.approx(0, abs=1e-6) and first["train/acc"] == 0.0
    assert len(train) == 8 and all("train/nll" in r for r in train)
    assert train[-1]["train/loss"] < LN2 and train[-1]["train/margin"] > 0


def test_dpo_raises_chosen_over_rejected_accuracy(dpo_run, sft_nano, pref_dir):
    out, final = dpo_run
    # reward accuracy β(π - ref) on held-out pairs: 0 at initialisation (all ties), chance 0.5
    assert final["eval/acc"] > 0.9 and final["eval/margin"] > 0
    # the saved policy's log-prob gap chosen - rejected grows (margin / β, recomputed outside the trainer)
    before, after = heldout_logprob_gap(sft_nano[0], pref_dir), heldout_logprob_gap(out, pref_dir)
    assert after - before == pytest.approx(final["eval/margin"] / 0.1, rel=1e-3)
    assert after - before > 1.0, (before, after)


def test_lora_dpo_uses_the_base_as_reference_and_saves_an_adapter(sft_nano, pref_dir, tmp_path, capsys):
    from posttrain.cli.main import main

    out = tmp_path / "lora"
    main(["dpo", *dpo_flags(sft_nano[0], pref_dir, out, "--ds.lora.rank", 4, "--ds.lora.alpha", 8,
                            "--adam.lr", "5e-3", "--data.max_samples", 48)])
    assert "adapters disabled" in capsys.readouterr().err
    names = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert train[0]["train/loss"] == pytest.approx(LN2, abs=1e-5)
    assert train[-1]["train/margin"] > 0


def heldout_acc(model_dir, pref_dir, loss_type: str) -> float:
    """The share of held-out pairs whose chosen side gets the higher `loss_type` reward (token-mean
    log-probs for ORPO / SimPO, summed ones for CPO) under a saved model, computed outside the run."""
    from posttrain.data.preference_dataset import PreferenceDataset
    from posttrain.data.readers import read_file
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.dpo import DPOObjective

    tok = load_tokenizer(model_dir)
    rows = read_file(str(pref_dir / "test.jsonl"))
    items = list(PreferenceDataset(rows, tok, 48, prompt_key="prompt", apply_chat_template=True))
    obj = DPOObjective(pad_id=tok.pad_token_id, packing=False, loss_type=loss_type)
    with torch.no_grad():
        return obj.loss(load_causal_lm(model_dir), obj.collate(items), len(items))[1]["acc_sum"] / len(items)


@pytest.fixture(scope="module")
def ok_pref_dir(tmp_path_factory):
    """pref_dir's additions with a constant chosen reply, "ok", over the bare wrong number. A reference-free
    loss compares the policy's own log-probs of the two replies, so the chosen one must become likelier
    than the rejected one outright: a short constant reply the nano model learns in a few steps (the
    sentence of pref_dir takes CPO's summed log-probs far longer), and which the SFT-ed model, trained on
    bare numbers, ranks below every rejected number at the start."""
    from posttrain.data.synthetic import make_preference_rows, write_jsonl

    path = tmp_path_factory.mktemp("ok_pref")
    rows = [dict(r, chosen="ok") for r in make_preference_rows(96, seed=5)]
    write_jsonl(rows[:64], path / "train.jsonl")
    write_jsonl(rows[64:], path / "test.jsonl")
    return path


@pytest.mark.parametrize("loss_type", ["orpo", "simpo", "cpo"])
def test_reference_free_losses_raise_preference_accuracy_without_a_reference(sft_nano, ok_pref_dir, tmp_path,
                                                                             capsys, loss_type):
    """`posttrain dpo --model.loss_type orpo|simpo|cpo` from the SFT-ed nano model, one epoch of 4 steps:
    no reference model is loaded (a --ref.model_name_or_path given is reported as having no effect), and
    the held-out reward accuracy rises from 0 to above 0.9 (the run's eval and a recomputation on the saved
    model agree)."""
    from posttrain.cli import train_dpo

    out = tmp_path / "run"
    final = train_dpo.main(dpo_flags(sft_nano[0], ok_pref_dir, out, "--model.loss_type", loss_type,
                                     "--adam.lr", "1e-2", "--eval.dataset", ok_pref_dir, "--eval.split",
                                     "test", "--ref.model_name_or_path", sft_nano[0]))
    err = capsys.readouterr().err
    assert f"no reference model: --model.loss_type {loss_type} is reference-free" in err
    assert "(frozen" not in err and "has no effect here: no reference model is loaded" in err
    train = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    term = {"orpo": "train/or_loss", "simpo": "train/simpo_loss", "cpo": "train/cpo_loss"}[loss_type]
    assert len(train) == 4 and all(term in r and "train/nll" in r for r in train)
    before, after = heldout_acc(sft_nano[0], ok_pref_dir, loss_type), heldout_acc(out, ok_pref_dir, loss_type)
    assert before == 0.0 and final["eval/acc"] > 0.9, (before, final)
    assert after == pytest.approx(final["eval/acc"], abs=1e-6)


@pytest.mark.e2e
def test_openrlhf_train_dpo_script_runs_with_only_the_module_renamed(tiny_model_dir, tmp_path):
    """examples/scripts/train_dpo_llama.sh of OpenRLHF (0.10.2 dotted flags): model and data point at
    local tiny ones, sizes shrunk, GPU-only flags (bf16, flash attention, wandb) left out. Chat data
    without a prompt key: each side is a whole conversation."""
    from posttrain.data.synthetic import make_preference_rows, write_jsonl

    data = tmp_path / "pairs.jsonl"
    write_jsonl([{"chosen": r["chosen_messages"], "rejected": r["rejected_messages"]}
                 for r in make_preference_rows(16, seed=3)], data)
    out = tmp_path / "checkpoint" / "llama3-8b-dpo"
    cmd = [sys.executable, "-m", "posttrain.cli.train_dpo",
           "--ckpt.output_dir", out, "--ckpt.save_steps", "-1", "--logger.logging_steps", "1",
           "--eval.steps", "-1", "--train.batch_size", "8", "--train.micro_batch_size", "2",
           "--model.model_name_or_path", tiny_model_dir, "--ds.param_dtype", "fp32",
           "--train.max_epochs", "1", "--data.max_len", "64", "--adam.lr", "5e-7", "--model.beta", "0.1",
           "--data.dataset", data, "--data.apply_chat_template", "--data.chosen_key", "chosen",
           "--data.rejected_key", "rejected", "--ckpt.load_enable", "--ds.packing_samples",
           "--model.gradient_checkpointing_enable", "--ref.offload"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["train/loss"] == pytest.approx(LN2, abs=1e-5)
    assert "gradient_accumulation_steps = 4" in proc.stderr
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def zero3_common() -> list:
    from rounding import ADAM_EPS

    return ["--data.max_samples", 48, "--adam.lr", "1e-3", "--adam.eps", ADAM_EPS]


def kto_common() -> list:
    from rounding import ADAM_EPS

    return ["--data.max_samples", 64, "--train.batch_size", 16, "--adam.lr", "1e-3", "--adam.eps", ADAM_EPS]


def ring_common() -> list:
    from rounding import ADAM_EPS

    return ["--data.max_samples", 32, "--adam.lr", "1e-3", "--adam.eps", ADAM_EPS, "--ds.packing_samples",
            "--model.gradient_checkpointing_enable", "--train.micro_batch_size", 4]


REFERENCE_FREE = {"simpo": ("--model.beta", 2.0, "--model.simpo_gamma", 0.5),
                  "orpo": ("--model.orpo_lambda", 0.5),
                  "cpo": ("--model.beta", 0.5, "--model.cpo_alpha", 0.5)}


def reference_free_common(loss: str) -> list:
    return [*zero3_common(), "--model.loss_type", loss, *REFERENCE_FREE[loss]]


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model_dir, pref_dir, unpaired_dir, tmp_path_factory):
    """This module's 2-rank runs, in one launch (`torchrun_cases`): "zero3" (token-budget micro-batches,
    ZeRO-3), "ring" (ring attention 2, ZeRO-3), "simpo", "orpo" and "cpo" (reference-free, packed, ZeRO-3) and
    "kto" (`posttrain kto`, ZeRO-3, 2 micro-batches per rank) -> (run folder, its `CaseRun`)."""
    from sft_helpers import torchrun_cases

    root = tmp_path_factory.mktemp("two_ranks")
    flags = {"zero3": (*zero3_common(), "--train.micro_batch_size", 2, "--ds.zero_stage", 3,
                       "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", 85),
             "ring": (*ring_common(), "--ds.zero_stage", 3, "--ds.ring_attn_size", 2,
                      "--ds.ring_attn_head_stride", 2),
             **{loss: (*reference_free_common(loss), "--ds.zero_stage", 3, "--ds.packing_samples",
                       "--train.micro_batch_size", 4) for loss in REFERENCE_FREE}}
    cases = [("posttrain.cli.train_dpo", dpo_flags(tiny_model_dir, pref_dir, root / case, *more))
             for case, more in flags.items()]
    cases.append(("posttrain.cli.train_kto", kto_flags(tiny_model_dir, unpaired_dir, root / "kto",
                                                       *kto_common(), "--train.micro_batch_size", 4,
                                                       "--ds.zero_stage", 3)))
    runs = torchrun_cases(cases, root / "logs")
    return {case: (root / case, proc) for case, proc in zip([*flags, "kto"], runs)}


@pytest.mark.e2e
def test_two_process_zero3_matches_single_process(tiny_model_dir, pref_dir, tmp_path, two_rank_runs):
    """Pairs as units: 2 ranks x token-budget micro-batches (ZeRO-3; policy and reference loaded straight
    into shards, each rank holding half of each) give the losses and weights of one process with one
    micro-batch per step. The budget of 85 tokens (a pair is 82-86) splits some steps' 8 pairs per
    rank into 4 micro-batches on one rank and 5 on the other: the padded micro-batch runs the sharded
    reference's collective forward too. The first update is taken at lr 0 (warm-up), so the third step
    is the one whose policy differs from the reference (margin != 0)."""
    from sft_helpers import assert_loaded_as_shards, assert_same_grad_norms, assert_weights_within_rounding

    from posttrain.cli import train_dpo

    single = tmp_path / "single"
    train_dpo.main(dpo_flags(tiny_model_dir, pref_dir, single, *zero3_common(), "--train.micro_batch_size",
                             16))
    multi, proc = two_rank_runs["zero3"]
    proc.ok()
    assert "world_size = 2" in proc.stderr
    assert "reference model: " in proc.stderr and "held as ZeRO-3 shards across the 2 ranks" in proc.stderr
    for role in ("model", "reference model"):
        assert_loaded_as_shards(proc.stderr, role)
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, multi)]
    assert [r["train/micro_batches"] for r in runs[1]] == [4, 5, 5]  # rank 0's; rank 1 has 5, 5, 4
    losses = [[r["train/loss"] for r in run] for run in runs]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) and losses[0][0] == pytest.approx(LN2, abs=1e-5)
    assert runs[0][-1]["train/margin"] > 0.1
    assert runs[1][-1]["train/margin"] == pytest.approx(runs[0][-1]["train/margin"], abs=1e-5)
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)  # the ranks' all-reduce sums in another order


@pytest.mark.e2e
def test_kto_on_two_ranks_matches_single_process(tiny_model_dir, unpaired_dir, tmp_path, two_rank_runs):
    """`posttrain kto` on 2 ranks (ZeRO-3, the reference as shards, 2 micro-batches of 4 rows per rank) gives
    the losses, KL estimates and weights of one process with one micro-batch of the step's 16 rows: the KL
    pairs follow the step's order and its sums are all-reduced."""
    from sft_helpers import assert_same_grad_norms, assert_weights_within_rounding

    from posttrain.cli import train_kto

    single = tmp_path / "single"
    train_kto.main(kto_flags(tiny_model_dir, unpaired_dir, single, *kto_common()))
    multi, proc = two_rank_runs["kto"]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "held as ZeRO-3 shards across the 2 ranks" in proc.stderr
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, multi)]
    for key, tol in (("train/loss", 1e-6), ("train/kl", 1e-5), ("train/chosen_reward", 1e-5)):
        assert [r[key] for r in runs[1]] == pytest.approx([r[key] for r in runs[0]], abs=tol), key
    assert len(runs[0]) == 4 and runs[0][-1]["train/kl"] > 0
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)


def _dpo_formula(margin: float, beta: float, ipo: bool, eps: float) -> float:
    """The per-pair loss from the logged margin β·h (h: the policy-minus-reference log-ratio gap)."""
    if ipo:
        return (margin / beta - 1.0 / (2.0 * beta)) ** 2
    logsig = torch.nn.functional.logsigmoid
    m = torch.tensor(margin, dtype=torch.float64)
    return float(-(1.0 - eps) * logsig(m) - eps * logsig(-m))


@pytest.mark.parametrize("flags, ipo, eps", [(("--model.ipo_enable",), True, 0.0),
                                             (("--model.label_smoothing", "0.3"), False, 0.3)],
                         ids=["ipo", "cdpo"])
def test_ipo_and_cdpo_runs_log_their_loss_formula(sft_nano, pref_dir, tmp_path, flags, ipo, eps):
    """`posttrain dpo` with one pair per step: every step's logged loss is the IPO / cDPO loss of that
    step's logged margin (same forward). From step 2 on the policy has moved, so the margin is not 0
    and the formula differs from plain DPO's: the flag must have acted."""
    from posttrain.cli.main import main

    beta = 0.5
    out = tmp_path / "run"
    main(["dpo", *dpo_flags(sft_nano[0], pref_dir, out, "--train.batch_size", 1,
                            "--train.micro_batch_size", 1, "--data.max_samples", 3, "--adam.lr", "5e-2",
                            "--model.beta", beta, *flags)])
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/margin"] == pytest.approx(0, abs=1e-6)  # policy == reference at step 1
    assert rows[0]["train/loss"] == pytest.approx(1 / (2 * beta) ** 2 if ipo else LN2, abs=1e-5)
    for r in rows:
        assert r["train/loss"] == pytest.approx(_dpo_formula(r["train/margin"], beta, ipo, eps), rel=1e-4,
                                                abs=1e-6)
    moved = [r for r in rows[1:] if abs(r["train/margin"]) > 1e-2]
    assert moved, rows  # a margin away from 0, where the formulas disagree
    for r in moved:
        assert abs(_dpo_formula(r["train/margin"], beta, False, 0.0) - r["train/loss"]) > 1e-3


@pytest.mark.e2e
def test_ring_attention_over_two_ranks_matches_single_process(tiny_model_dir, pref_dir, tmp_path,
                                                              two_rank_runs):
    """OpenRLHF's train_dpo_llama.sh flags (packing, ZeRO-3, gradient checkpointing; sizes ours) with
    --ds.ring_attn_size 2: both ranks take the same packed pairs and each computes half of every row, the
    policy and the reference alike; each pair's log-probs are summed over the two ranks. Losses, margins and
    weights equal the single-process run's."""
    from sft_helpers import assert_same_grad_norms, assert_weights_within_rounding

    from posttrain.cli import train_dpo

    single = tmp_path / "single"
    train_dpo.main(dpo_flags(tiny_model_dir, pref_dir, single, *ring_common()))
    ring, proc = two_rank_runs["ring"]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "--ds.ring_attn_size 2 has no effect" not in proc.stderr
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, ring)]
    for key in ("train/loss", "train/margin"):
        assert [r[key] for r in runs[0]] == pytest.approx([r[key] for r in runs[1]], abs=1e-5), key
    assert_same_grad_norms(single, ring)
    assert_weights_within_rounding(single, ring)  # the split attention sums in another order


@pytest.mark.e2e
@pytest.mark.parametrize("loss", list(REFERENCE_FREE))
def test_a_reference_free_loss_packed_over_two_ranks_matches_one_unpacked_process(
        loss, tiny_model_dir, pref_dir, tmp_path, two_rank_runs):
    """SimPO, ORPO and CPO (reference-free) packed, 2 ranks under ZeRO-3, equal one padded process: the token
    means a = π/|y| (SimPO, ORPO's odds and its NLL term) and the sums π (CPO) come out the same from packed
    rows, and no rank loads or runs a reference (no shards, no collective reference forward)."""
    from sft_helpers import assert_same_grad_norms, assert_weights_within_rounding

    from posttrain.cli import train_dpo

    single = tmp_path / "single"
    train_dpo.main(dpo_flags(tiny_model_dir, pref_dir, single, *reference_free_common(loss),
                             "--train.micro_batch_size", 16))
    multi, proc = two_rank_runs[loss]
    proc.ok()
    assert "world_size = 2" in proc.stderr and "(frozen" not in proc.stderr
    assert f"no reference model: --model.loss_type {loss} is reference-free" in proc.stderr
    runs = [[r for r in read_metrics(d / "metrics.jsonl") if "train/loss" in r] for d in (single, multi)]
    term = {"simpo": "train/simpo_loss", "orpo": "train/or_loss", "cpo": "train/cpo_loss"}[loss]
    for key in ("train/loss", term, "train/margin", "train/acc"):
        assert [r[key] for r in runs[0]] == pytest.approx([r[key] for r in runs[1]], abs=1e-5), key
    assert len(runs[0]) == 3 and runs[0][-1]["train/loss"] < runs[0][0]["train/loss"]
    assert_same_grad_norms(single, multi)
    assert_weights_within_rounding(single, multi)
