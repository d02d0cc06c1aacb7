"""What the RL tests share besides fixtures: reward-function files (`REWARD_FUNCS`) and
`ppo_flags` (a small `posttrain ppo` run on the SFT-ed nano model). A module of its own, imported by name
(`from rl_runs import ppo_flags`): `from conftest import ...` would find whichever conftest
was imported last."""


REWARD_FUNCS = {
    # verifiable: the last integer of the response equals the label
    "correct.py": '''
import re
import torch

def reward_func(queries, prompts, labels, **kwargs):
    out = []
    for q, p, label in zip(queries, prompts, labels):
        nums = re.findall(r"-?\\d+", q[len(p):])
        out.append(1.0 if nums and nums[-1] == str(label) else 0.0)
    r = torch.tensor(out)
    return {"rewards": r, "scores": r, "extra_logs": {"accuracy": r}}
''',
    # dense and easy: answers starting with the digit 1
    "starts_with_1.py": '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    r = torch.tensor([1.0 if q[len(p):].strip().startswith("1") else 0.0 for q, p in zip(queries, prompts)])
    return {"rewards": r, "scores": r}
''',
    # rewards that differ within a group whatever the model writes (the parity of the response's length)
    "spread.py": '''
def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": [float(len(q) - len(p)) % 2 for q, p in zip(queries, prompts)]}
''',
    "raises_late.py": '''
import os
import torch

CALLS = {"n": 0}

def reward_func(queries, prompts, labels, **kwargs):
    CALLS["n"] += 1
    if CALLS["n"] > int(os.environ.get("POSTTRAIN_TEST_FAIL_AFTER", "3")):
        raise ZeroDivisionError("the grader divided by zero")
    return {"rewards": torch.zeros(len(queries))}
''',
    # every call scores higher than the one before: each evaluation beats every earlier one
    "rising.py": '''
CALLS = {"n": 0}

def reward_func(queries, prompts, labels, **kwargs):
    CALLS["n"] += 1
    return {"rewards": [float(CALLS["n"])] * len(queries)}
''',
    "zero.py": '''
def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": [0.0] * len(queries)}
''',
    "wrong_length.py": '''
def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": [0.0] * (len(queries) - 1)}
''',
    "nan.py": '''
def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": [float("nan")] * len(queries)}
''',
}


def ppo_flags(setup, out, *extra, reward="starts_with_1.py"):
    """The flags of a small run of `setup`'s SFT-ed nano model, scored by the reward file `reward` as
    --reward.remote_url (None: no --reward.remote_url; `extra` names the reward)."""
    sft, data, rewards = setup
    source = [] if reward is None else ["--reward.remote_url", str(rewards / reward)]
    return ["--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--data.max_len", "48", *source, "--rollout.batch_size", "8",
            "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "4",
            "--rollout.micro_batch_size", "16", "--train.batch_size", "32", "--train.micro_batch_size", "16",
            "--data.max_samples", "64", "--actor.adam.lr", "2e-3", "--actor.lr_warmup_ratio", "0",
            "--algo.kl.init_coef", "0", "--ckpt.output_dir", str(out), *map(str, extra)]
