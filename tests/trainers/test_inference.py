"""`posttrain chat` / `generate`: sampling a saved model with the RL rollout engine and reward code
(posttrain/trainers/inference.py, posttrain/cli/chat.py, posttrain/cli/generate.py)."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from posttrain.config.backends import vllm_unavailable

ROOT = Path(__file__).resolve().parents[2]
REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return {"rewards": torch.tensor([float(len(q) - len(p)) for q, p in zip(queries, prompts)])}
'''


def _greedy_replies(model_dir, turns, max_new_tokens):
    """The replies `model.generate` gives greedily to each user turn of `turns` ("/reset" clears), the
    history rendered with the tokenizer's chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    history, replies = [], []
    for turn in turns:
        if turn == "/reset":
            history = []
            continue
        history.append({"role": "user", "content": turn})
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=1,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        reply = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


@pytest.mark.e2e
def test_chat_over_a_pipe_replies_the_greedy_continuation_of_the_history(tiny_model_dir):
    sft = tiny_model_dir  # random weights: replies that depend on the whole history
    turns = ["hello", "how are you?", "/reset", "how are you?"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli.main", "chat", "--model.model_name_or_path",
                           str(sft), "--rollout.temperature", "0", "--rollout.max_new_tokens", "6",
                           "--rollout.engine", "hf"], input="\n".join(turns) + "\n", capture_output=True,
                          check=False, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    replies = _greedy_replies(str(sft), turns, 6)
    assert replies[1] != replies[2]  # the same message: with the first turn in its history, then without
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("chatting with")
    expected = "\n".join([replies[0], replies[1], "(history cleared)", replies[2]])
    assert "\n".join(lines[1:]) == expected


@pytest.mark.e2e
def test_chat_ends_with_status_0_on_ctrl_c(tiny_model_dir):
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli.main", "chat", "--model.model_name_or_path",
                             tiny_model_dir, "--rollout.engine", "hf"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().startswith("chatting with")  # waiting for the first line
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")
def test_generate_samples_on_vllm(generated):
    rows = generated("--rollout.engine", "vllm")
    assert [(r["index"], r["sample"]) for r in rows] == [(g, j) for g in range(5) for j in range(3)]
    assert all(r["reward"] > 0 and r["output"] for r in rows)


def test_chat_without_a_chat_template_concatenates_and_says_so(tiny_model_dir, tmp_path, capsys):
    import shutil

    from posttrain.cli import chat

    model = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, model)
    for name in ("chat_template.jinja",):
        (model / name).unlink(missing_ok=True)
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    history = chat.main(["--model.model_name_or_path", str(model), "--rollout.temperature", "0",
                         "--rollout.max_new_tokens", "3", "--rollout.engine", "hf"],
                        stdin=io.StringIO("hello\nhi again\n"), stdout=io.StringIO())
    assert [m["role"] for m in history] == ["user", "assistant", "user", "assistant"]
    assert capsys.readouterr().err.count("has no chat template") == 1


def test_chat_loads_a_lora_adapter_folder(sft_nano, tmp_path):
    """An adapter folder samples like the model its merge gives (`posttrain lora-merge`)."""
    from peft import LoraConfig, get_peft_model

    from posttrain.cli import chat, lora_combiner
    from posttrain.models import load_causal_lm

    sft, _ = sft_nano
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(load_causal_lm(str(sft)), lora)
    peft.save_pretrained(tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(sft)
    lora_combiner.main(["--lora_path", str(tmp_path / "adapter"), "--output_path", str(tmp_path / "merged"),
                        "--ds.param_dtype", "fp32"])
    flags = ["--rollout.temperature", "0", "--rollout.max_new_tokens", "5", "--rollout.engine", "hf"]
    folders = (tmp_path / "adapter", tmp_path / "merged", sft)
    talk = [chat.main(["--model.model_name_or_path", str(path), *flags], stdout=io.StringIO(),
                      stdin=io.StringIO("What is 3 + 4?\n")) for path in folders]
    assert talk[0] == talk[1]
    assert talk[0] != talk[2]  # the adapter acts


@pytest.fixture
def generated(sft_nano, tmp_path):
    sft, data = sft_nano
    (tmp_path / "length.py").write_text(REWARD)

    def run(*extra, reward=True):
        from posttrain.cli import generate

        out = tmp_path / "out.jsonl"
        generate.main(["--model.model_name_or_path", str(sft), "--data.dataset", str(data / "test.jsonl"),
                       "--data.input_key", "prompt", "--data.apply_chat_template", "--data.max_samples", "5",
                       "--rollout.n_samples_per_prompt", "3", "--rollout.max_new_tokens", "6",
                       "--rollout.engine", "hf", "--output", str(out),
                       *(["--reward.remote_url", str(tmp_path / "length.py")] if reward else []), *extra])
        return [json.loads(line) for line in out.read_text().splitlines()]
    return run


def test_generate_writes_n_scored_samples_per_prompt_the_best_of_n_and_pairs(generated, sft_nano):
    rows = generated()
    assert len(rows) == 15
    assert [(r["index"], r["sample"]) for r in rows] == [(g, j) for g in range(5) for j in range(3)]
    source = [json.loads(line) for line in (sft_nano[1] / "test.jsonl").read_text().splitlines()][:5]
    for r in rows:
        assert r["answer"] == source[r["index"]]["answer"] and r["response"] == source[r["index"]]["response"]
        assert r["prompt"] == source[r["index"]]["prompt"]  # the input as in the dataset
        assert r["prompt_text"].startswith("<|im_start|>user\n" + r["prompt"])  # as the model was given it
        assert r["reward"] > 0  # the reward file's score: the decoded response's length (with its eos)
    assert len({r["output"] for r in rows}) > 5  # sampled (temperature 1), not one answer per prompt
    best = generated("--post_processor", "rs")
    assert [r["index"] for r in best] == list(range(5))
    for b in best:
        group = [r for r in rows if r["index"] == b["index"]]
        assert b == max(group, key=lambda r: r["reward"])  # the same seed: the same samples
    pairs = generated("--post_processor", "iter_dpo")
    for p in pairs:
        group = [r for r in rows if r["index"] == p["index"]]
        assert p["chosen_reward"] == max(r["reward"] for r in group) > p["rejected_reward"]
        assert p["rejected_reward"] == min(r["reward"] for r in group)
    assert "reward" not in generated(reward=False)[0]


@pytest.mark.parametrize("flags, message", [
    (["--data.input_key", "question"], "question"),
    (["--data.dataset", "no/such.jsonl"], "no/such.jsonl"),
    (["--post_processor", "rs"], "--post_processor rs: needs a reward"),
    (["--output", "/tmp"], "--output /tmp is a folder"),
    (["--output", "/etc/hostname/o.jsonl"], "is a file, not a folder"),
])
def test_generate_user_mistakes_are_one_line_and_exit_2(sft_nano, tmp_path, capsys, flags, message):
    from posttrain.cli import generate

    sft, data = sft_nano
    base = ["--model.model_name_or_path", str(sft), "--data.dataset", str(data / "test.jsonl"),
            "--data.input_key", "prompt", "--rollout.engine", "hf", "--output", str(tmp_path / "o.jsonl")]
    with pytest.raises(SystemExit) as e:
        generate.main(base + flags)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[posttrain]")]
    assert len(err) == 1 and err[0].startswith("posttrain generate: error:") and message in err[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_engine_choice():
    """auto: the HF engine on a CPU (as one-process RL); vLLM for an adapter folder is refused, with why."""
    from posttrain.config import ConfigError
    from posttrain.trainers.inference import _engine_kind

    if not torch.cuda.is_available():
        assert _engine_kind("auto", None)[0] == "hf"
    assert _engine_kind("hf", None) == ("hf", "--rollout.engine hf")
    with pytest.raises(ConfigError, match="--rollout.engine vllm: .*(adapter|vLLM)"):
        _engine_kind("vllm", "some/base")


def test_generate_scores_with_a_reward_model(generated, tiny_score_model_dir):
    import math

    rows = generated("--reward.model_name_or_path", tiny_score_model_dir, reward=False)
    assert len(rows) == 15 and all(math.isfinite(r["reward"]) for r in rows)
    assert len({r["reward"] for r in rows}) > 1  # the score head's value of each sample


def test_an_iter_dpo_pair_never_has_the_same_text_twice():
    """Two copies of the best text scored apart (a reward model's batch noise) are not a pair."""
    from posttrain.cli.generate import post_process

    rows = [{"index": 0, "output": o, "reward": r, "sample": j} for j, (o, r) in
            enumerate([("42", 0.9), ("41", 0.2), ("42", 0.1)])]
    pair, = post_process(rows, "iter_dpo")
    assert (pair["chosen"], pair["rejected"], pair["rejected_reward"]) == ("42", "41", 0.2)
    assert post_process([{**r, "output": "42"} for r in rows], "iter_dpo") == []


@pytest.mark.parametrize("command", ["generate", "eval"])
def test_data_keys_are_checked_before_any_part_of_the_model_is_read(command, tiny_model_dir, tmp_path,
                                                                    capsys):
    """A wrong --data.input_key and a --data.label_key the file lacks (eval's default 'label'): one error
    naming both, with the file's keys and the close match, exit 2, before the tokenizer is read (here a
    damaged one, which would fail otherwise)."""
    import importlib
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").write_text("{not json")
    prompts = ROOT / "examples" / "data" / "prompts.jsonl"
    main = importlib.import_module(f"posttrain.cli.{'evaluate' if command == 'eval' else command}").main
    with pytest.raises(SystemExit) as e:
        main(["--model.model_name_or_path", str(model), "--data.dataset", str(prompts), "--data.input_key",
              "promt", "--data.label_key", "label", "--output", str(tmp_path / "o.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posttrain {command}: error: missing or broken inputs (2 problems):")
    keys = f"missing from {prompts} (its keys: [prompt, answer])"
    assert f"--data.input_key 'promt': {keys}; did you mean 'prompt'?" in err
    assert f"--data.label_key 'label': {keys}; name one of them with --data.label_key" in err


def test_chat_drops_the_oldest_turns_when_the_conversation_outgrows_the_context(tiny_model_dir, tmp_path,
                                                                                capsys):
    """A model with a 96-token context and 16 tokens kept for each reply: the oldest turns are left out, with
    a note, so that every prompt fits; a message too long on its own is answered with a line saying so, and
    the conversation goes on."""
    import shutil

    from transformers import AutoTokenizer

    from posttrain.cli import chat

    model = shutil.copytree(tiny_model_dir, tmp_path / "short")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    turns = [f"message {i}: what is {i} plus {i}, and why?" for i in range(8)]
    out = io.StringIO()
    history = chat.main(["--model.model_name_or_path", str(model), "--rollout.temperature", "0",
                         "--rollout.max_new_tokens", "16", "--rollout.engine", "hf"], stdout=out,
                        stdin=io.StringIO("\n".join([*turns[:-1], "a b c " * 40, turns[-1]]) + "\n"))
    err = capsys.readouterr().err
    assert "note: the conversation outgrew the model's context (96 tokens, 16 of them kept for the reply" \
        in err
    assert "(message too long: it and --rollout.max_new_tokens 16 exceed the model's context of 96" in \
        out.getvalue()
    users = [m["content"] for m in history if m["role"] == "user"]
    assert users[-1] == turns[-1] and turns[0] not in users  # the newest kept, the oldest left out
    assert users == turns[len(turns) - len(users):]
    assert [m["role"] for m in history[:2]] == ["user", "assistant"]
    tok = AutoTokenizer.from_pretrained(model)
    prompt = tok.apply_chat_template(history[:-1], tokenize=False, add_generation_prompt=True)
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) + 16 <= 96  # the last prompt fitted


def test_chat_refuses_a_reply_budget_as_long_as_the_context(tiny_model_dir, capsys):
    from posttrain.cli import chat

    with pytest.raises(SystemExit) as e:
        chat.main(["--model.model_name_or_path", tiny_model_dir, "--rollout.max_new_tokens", "4096"],
                  stdin=io.StringIO(""), stdout=io.StringIO())
    assert e.value.code == 2
    assert "--rollout.max_new_tokens 4096: the model's context is 4096 tokens" in capsys.readouterr().err


def test_a_lora_adapter_with_a_relative_base_path(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """adapter_config.json's base_model_name_or_path "../base" is read against the adapter folder (from any
    current folder); one found nowhere is one line naming the field and --model.base_model."""
    import shutil

    from peft import LoraConfig, get_peft_model

    from posttrain.cli import chat
    from posttrain.models import load_causal_lm

    base = shutil.copytree(tiny_model_dir, tmp_path / "runs" / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    get_peft_model(load_causal_lm(str(base)), lora).save_pretrained(tmp_path / "runs" / "adapter")
    config = tmp_path / "runs" / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "../base"}))
    monkeypatch.chdir(tmp_path)
    flags = ["--model.model_name_or_path", "runs/adapter", "--rollout.max_new_tokens", "3",
             "--rollout.engine", "hf"]
    assert len(chat.main(flags, stdin=io.StringIO("hi\n"), stdout=io.StringIO())) == 2
    assert f"merged into its base {os.path.join('runs', 'base')}" in capsys.readouterr().err

    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "./gone"}))
    with pytest.raises(SystemExit) as e:
        chat.main(flags, stdin=io.StringIO("hi\n"), stdout=io.StringIO())
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    adapter = os.path.join("runs", "adapter")
    assert err == (f"posttrain chat: error: --model.model_name_or_path runs/adapter: a LoRA adapter; "
                   f"{os.path.join(adapter, 'adapter_config.json')}: base_model_name_or_path './gone' "
                   f"is found neither beside the adapter ({os.path.join(adapter, 'gone')}) nor in the "
                   "current folder; pass the base model with --model.base_model, or write its path into "
                   "base_model_name_or_path")


def test_generate_gives_a_reward_file_the_rows_other_columns(tiny_model_dir, tmp_path):
    """`--reward.remote_url FILE.py` in `generate` gets the prompt rows' other columns by keyword, as in
    `posttrain ppo` (the label column under its own name too)."""
    from posttrain.cli import generate

    rows = [{"prompt": f"Q: {i}+1=", "answer": str(i + 1), "weight": 0.25 * i} for i in range(3)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "by_column.py").write_text(
        "def reward_func(queries, prompts, labels, weight, answer):\n"
        "    return [w + float(a) for w, a in zip(weight, answer)]\n")
    out = tmp_path / "out.jsonl"
    data = str(tmp_path / "data.jsonl")
    generate.main(["--model.model_name_or_path", tiny_model_dir, "--data.dataset", data,
                   "--data.input_key", "prompt", "--data.label_key", "answer",
                   "--rollout.max_new_tokens", "2", "--rollout.n_samples_per_prompt", "1",
                   "--rollout.engine", "hf", "--output", str(out),
                   "--reward.remote_url", str(tmp_path / "by_column.py")])
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward"] for r in got] == [0.25 * i + i + 1 for i in range(3)]
