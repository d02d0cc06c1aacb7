"""`posttrain ppo --config grpo.yaml` (a TRL 1.16 GRPOConfig file) equals TRL's own GRPOTrainer on the first
update, and a TRL 1.16 RLOOConfig file TRL's RLOOTrainer: posttrain samples and trains one step on a tiny
model; TRL's trainer is then given the same prompts and the completions posttrain sampled (its tokenisation
and generation patched to return them), scores them with the same reward function and takes one step. Same
advantages, same parameters to 1e-5."""
import json
from collections import defaultdict

import pytest
import torch
import yaml

PROMPTS = ["3+4=", "2+5="]  # the same token length: TRL's left padding then moves no position
# Adam's first step is lr x g / (|g| + eps): with eps 1 and no clipping, it follows the gradient's size
FIELDS = {"num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 1, "max_completion_length": 6,
          "loss_type": "grpo", "learning_rate": 0.1, "adam_epsilon": 1.0, "max_grad_norm": 0.0,
          "lr_scheduler_type": "constant",
          "temperature": 1.0, "gradient_checkpointing": False, "bf16": False, "seed": 3, "report_to": "none",
          "logging_steps": 1}
# RLOOConfig has no loss_type; normalize_advantages marks the file as RLOO's (and whitens the advantages);
# RLOO's default beta 0.05 puts the sequence KL in the reward (0 at step 1: the policy is the reference)
KIND_FIELDS = {"grpo": FIELDS,
               "rloo": {**{k: v for k, v in FIELDS.items() if k != "loss_type"}, "normalize_advantages": True,
                        "beta": 0.05}}
REWARD = '''import json

LOG = {log!r}


def score(ids):
    return float(ids[0] % 5) + 0.25 * len(ids) if ids else 0.0


def reward_func(prompts, completions, completion_ids, **kwargs):
    with open(LOG, "a") as f:
        for prompt, ids in zip(prompts, completion_ids):
            f.write(json.dumps({{"prompt": prompt, "ids": list(ids)}}) + "\\n")
    return [score(ids) for ids in completion_ids]
'''


def score(ids):  # the reward file's score, for TRL
    return float(ids[0] % 5) + 0.25 * len(ids) if ids else 0.0


def likely_eos(model_dir, out) -> str:
    """The tiny model with EOS made likely (logit ~6.5 at every position, about a quarter of the samples): the
    completions end at different lengths, so the loss aggregations differ. (Final hidden states share a
    mean direction mu: the tied EOS row 6.5 mu / |mu|^2.)"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS])
    with torch.no_grad():
        mu = model(ids, output_hidden_states=True).hidden_states[-1].flatten(0, 1).mean(0)
        model.lm_head.weight[tokenizer.eos_token_id] = 6.5 * mu / (mu @ mu)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["grpo", "rloo"])
def posttrain_run(request, tiny_model_dir, tmp_path_factory):
    """(the TRL config's kind, the model, posttrain's run folder, the samples posttrain scored:
    [{"prompt", "ids"}])."""
    pytest.importorskip("trl")
    from posttrain.cli import train_ppo_ray

    kind = request.param
    root = tmp_path_factory.mktemp(f"{kind}_file")
    model_dir = likely_eos(tiny_model_dir, root / "model")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "reward.py").write_text(REWARD.format(log=str(root / "samples.jsonl")))
    out = root / "run"
    config = {**KIND_FIELDS[kind], "model_name_or_path": model_dir,
              "dataset_name": str(root / "prompts.jsonl"), "output_dir": str(out)}
    (root / f"{kind}.yaml").write_text(yaml.safe_dump(config))
    train_ppo_ray.main(["--config", str(root / f"{kind}.yaml"), "--reward.func_path",
                        f"{root / 'reward.py'}:reward_func"])
    samples = [json.loads(line) for line in (root / "samples.jsonl").read_text().splitlines()]
    return kind, model_dir, out, samples


def expected_advantages(kind: str, rewards: list[list[float]]) -> list[list[float]]:
    """Per prompt group: GRPO's (r - mean) / (std + 1e-4) (posttrain's group_norm with TRL's eps); RLOO's
    r - (mean of the other samples), then whitened over the whole batch with the unbiased std + 1e-4."""
    from posttrain.algorithms import group_baseline

    if kind == "grpo":
        return [group_baseline(torch.tensor(r), len(r), "group_norm", eps=1e-4).tolist() for r in rewards]
    loo = torch.tensor([[x - (sum(r) - x) / (len(r) - 1) for x in r] for r in rewards])
    return ((loo - loo.mean()) / (loo.flatten().std() + 1e-4)).tolist()


@pytest.mark.slow
def test_a_trl_1x_file_first_update_equals_trls_own_trainer(posttrain_run, tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kind, model_dir, out, samples = posttrain_run
    title = "GRPOConfig" if kind == "grpo" else "RLOOConfig"
    assert (out / f"trl_{kind}_translation.txt").read_text().startswith(f"TRL {title} (v1.16.0 semantics)")
    assert sorted(s["prompt"] for s in samples) == sorted(PROMPTS * 4)
    assert len({len(s["ids"]) for s in samples}) > 1  # completions of several lengths
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = {p: tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS}
    queue = defaultdict(list)
    for s in samples:
        queue[tuple(prompt_ids[s["prompt"]])].append(s["ids"])

    config, trainer_class = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else \
        (trl.RLOOConfig, trl.RLOOTrainer)
    args = config(output_dir=str(tmp_path / "trl"), use_cpu=True, save_strategy="no", **KIND_FIELDS[kind])
    trainer = trainer_class(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                            reward_funcs=lambda completion_ids, **_: [score(c) for c in completion_ids],
                            args=args, train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                            processing_class=tokenizer)
    trainer._tokenize_prompts = lambda prompts: ([prompt_ids[p] for p in prompts], None, {})
    sampled = lambda ids: [queue[tuple(i)].pop(0) for i in ids]  # noqa: E731
    # GRPOTrainer's returns (completion ids, sampling log-probs); RLOOTrainer's the completion ids alone
    trainer._generate_single_turn = (lambda ids, *_, **__: (sampled(ids), None)) if kind == "grpo" else \
        (lambda ids, *_, **__: sampled(ids))
    batches = []
    generate = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: batches.append(generate(inputs)) or batches[-1]
    trainer.train()

    # TRL's advantages, per (prompt, completion), computed by hand from the same rewards
    groups = {p: [s["ids"] for s in samples if s["prompt"] == p] for p in PROMPTS}
    advantages = expected_advantages(kind, [[score(c) for c in groups[p]] for p in PROMPTS])
    ours = {(tuple(prompt_ids[p]), tuple(c)): a for p, adv in zip(PROMPTS, advantages)
            for c, a in zip(groups[p], adv)}
    (batch,) = batches
    for ids, mask, completion, cmask, adv in zip(batch["prompt_ids"], batch["prompt_mask"],
                                                 batch["completion_ids"], batch["completion_mask"],
                                                 batch["advantages"]):
        key = (tuple(ids[mask.bool()].tolist()), tuple(completion[cmask.bool()].tolist()))
        assert abs(ours[key] - float(adv)) < 1e-6, key

    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    ours_after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    trl_after = trainer.model.state_dict()
    moved = 0.0
    for name, value in ours_after.items():
        torch.testing.assert_close(value, trl_after[name], rtol=0, atol=1e-5, msg=name)
        moved = max(moved, float((value - before[name]).abs().max()))
    assert moved > 1e-3  # the step moved the weights far beyond the tolerance
