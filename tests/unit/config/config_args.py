"""Minimal valid command lines per trainer, shared by the config tests."""

BASE = {
    "sft": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    "rm": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    "dpo": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    "kd": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl",
           "--teacher.model_name_or_path", "t"],
    "kto": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl"],
    "prm": ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl", "--model.placeholder_token", "@"],
    "ppo": [
        "--actor.model_name_or_path",
        "m",
        "--data.prompt_dataset",
        "p.jsonl",
        "--reward.remote_url",
        "r.py",
        "--rollout.batch_size",
        "16",
        "--train.batch_size",
        "16",
    ],
}
