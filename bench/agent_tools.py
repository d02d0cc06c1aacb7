"""The calculator task written as a tool file (`--train.tool_path`, scored by `final_answer_reward.py`)
against today's agent file (`--train.agent_func_path calculator_agent.py`), at `posttrain demo --quick`'s
scale (`--full`: the demo's full scale), over several seeds.

    .venv/bin/python bench/agent_tools.py [--seeds 1 2 3] [--full] [--compact-tools]
        [--tool-file environment|functions] [--skip-agent-file | --skip-tool-file]
        [--compact-results] [--temperature 1.0] [--tool-rl-lr LR] [--tool-sft-epochs N] [--reuse-sft]
        [--output runs/bench_agent_tools]
    .venv/bin/python bench/agent_tools.py --copy-check MODEL_DIR TRANSCRIPTS.jsonl

`--tool-file environment` (the default): `calculator_env.py`, whose per-episode `Calculator` knows the
question, so `calc()` with no arguments is the agent file's bare `calc` (the same information flow);
`functions`: `calculator_tools.py`, whose `multiply(a, b)` needs the model to copy the operands.
`--skip-agent-file` runs the tool file only, `--skip-tool-file` the agent file only (the columns of the
one left out read "-"). `--temperature`: the RL rollouts' (the demo's: 1.0); `--tool-rl-lr`: the tool
file's RL learning rate (the demo's agent file: 3e-4); `--tool-sft-epochs`: the tool file's SFT epochs (the
demo's agent file: 3 at full scale). `--reuse-sft`: keep the base and SFT models an
earlier run left in `--output` (RL starts over; a kept SFT model keeps the epochs it was trained with).

Per seed, as the demo's calculator task (`cli/demo.py run_agent_task`): the nano model (seed), SFT on the
demonstrator's transcripts (`make_calculator_rows` / `make_calculator_tool_rows`: the same problems and
the same choice of calling the tool or guessing, each in its own protocol), multi-turn RL with the demo's
flags, and greedy held-out success (reward 1) after SFT and after RL on the same 100 problems. The tool
version's prompts carry the tools' schemas (about 360 tokens with the tiny chat template) and its call is a
JSON object (about 48 tokens), so its --data.max_len is 512 (the agent file's: 96) and its per-turn cap 64
(12); everything else is the demo's. Prints one row per seed and the means. Not a test.

`--copy-check MODEL_DIR TRANSCRIPTS.jsonl`: how often an SFT model copies the tool's result into its
answer, teacher-forced: on the first 200 transcripts that call the tool, the transcript up to the final
answer is given and the answer decoded greedily (6 tokens); prints the fraction equal to the `answer` column.

`--compact-tools`: the tool version's SFT runs with `--data.tokenizer_chat_template` set to the tiny
template with each tool listed as one line, `name(arg, ...)`, instead of the Qwen-style preamble and JSON
schemas (calls and tool results render as before, so the Hermes parser still reads them); the SFT model
saves that template, so its RL and the held-out check use it too. A prompt is then 34 tokens instead of
364 (the agent file's: 20), which makes the full scale affordable on a CPU. `--compact-results` (with
`--compact-tools`): a tool's result renders as `= result` in the user turn, the agent file's feedback,
instead of Hermes's `<tool_response>` block, so the result sits 5 tokens before the answer instead of 17 and
the two versions differ only in the call (the Hermes JSON, 38 tokens, against the bare `calc`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from posttrain.agents.examples import CALCULATOR_AGENT, CALCULATOR_ENV, CALCULATOR_TOOLS, FINAL_ANSWER_REWARD  # noqa: E402
from posttrain.agents.examples.calculator import make_calculator_tool_rows  # noqa: E402
from posttrain.cli import demo, train_ppo_ray, train_sft  # noqa: E402
from posttrain.data.synthetic import write_jsonl  # noqa: E402
from posttrain.models import build_tiny  # noqa: E402
from posttrain.trainers.task_eval import agent_success  # noqa: E402

TOOL_MAX_LEN, TOOL_TURN_CAP = 512, 64


def compact_tools_template(compact_results: bool = False) -> str:
    """The tiny chat template with each tool rendered as `name(arg, ...)` on a line after `tools:`;
    `compact_results`: a tool's result renders as `= result` (the agent file's feedback) instead of
    Hermes's `<tool_response>` block."""
    from posttrain.models.tiny_tokenizer import CHATML_TEMPLATE, TOOLS_CLOSING, TOOLS_PREAMBLE

    one_line = ("{%- for tool in tools %}"
                "{%- set f = tool['function'] if tool['function'] is defined else tool %}"
                "{{- '\\n' + f['name'] + '(' + (f['parameters']['properties'] | list | join(', ')) + ')' }}"
                "{%- endfor %}")
    parts = {"{{- " + repr(TOOLS_PREAMBLE) + " }}": "{{- 'tools:' }}",
             "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}": one_line,
             "{{- " + repr(TOOLS_CLOSING + "<|im_end|>\n") + " }}": "{{- '<|im_end|>\\n' }}"}
    if compact_results:
        parts["{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"] = \
            "{{- '\\n= ' + message['content'] }}"
    template = CHATML_TEMPLATE
    for old, new in parts.items():
        if old not in template:
            raise RuntimeError("the tiny chat template changed: update compact_tools_template")
        template = template.replace(old, new)
    return template


def _set(flags: list[str], name: str, value: str) -> list[str]:
    flags = list(flags)
    flags[flags.index(name) + 1] = value
    return flags


def _sft(flags: list[str], out: Path, reuse: bool) -> None:
    """SFT, or (reuse) the model an earlier run of this script left in `out`."""
    if not (reuse and (out / "model.safetensors").exists()):
        train_sft.main(flags)


def run_agent_file(scale, base: Path, out: Path, seed: int, temperature: float = 1.0,
                   reuse: bool = False) -> tuple[float, float]:
    test = demo.agent_data(scale, out, seed)
    data, sft, rl = out / "data" / "agent", out / "agent_sft", out / "agent_rl"
    _sft(demo.agent_sft_flags(scale, base, data, sft, seed), sft, reuse)
    after_sft = agent_success(sft, test, CALCULATOR_AGENT)[0]
    rl_flags = demo.agent_rl_flags(scale, sft, data, rl, seed, CALCULATOR_AGENT)
    train_ppo_ray.main(rl_flags + ["--rollout.temperature", str(temperature)])
    return after_sft, agent_success(rl, test, CALCULATOR_AGENT)[0]


def run_tool_file(scale, base: Path, out: Path, seed: int, compact: bool = False, environment: bool = True,
                  temperature: float = 1.0, reuse: bool = False,
                  lr: float | None = None, compact_results: bool = False,
                  sft_epochs: int | None = None) -> tuple[float, float]:
    tool_file = CALCULATOR_ENV if environment else CALCULATOR_TOOLS
    rows = make_calculator_tool_rows(scale.agent_train + scale.n_test, seed=seed, tool_use=demo.TOOL_USE,
                                     environment=environment)
    train, test = rows[: scale.agent_train], rows[scale.agent_train:]
    data, sft, rl = out / "data" / "tools", out / "tool_sft", out / "tool_rl"
    write_jsonl(train, data / "train.jsonl")
    write_jsonl(test, data / "test.jsonl")
    sft_flags = _set(demo.agent_sft_flags(scale, base, data, sft, seed), "--data.max_len", str(TOOL_MAX_LEN))
    if sft_epochs is not None:
        sft_flags = _set(sft_flags, "--train.max_epochs", str(sft_epochs))
    if compact:
        (out / "compact_tools.jinja").write_text(compact_tools_template(compact_results))
        sft_flags += ["--data.tokenizer_chat_template", str(out / "compact_tools.jinja")]
    _sft(sft_flags, sft, reuse)
    check = dict(tool_path=tool_file, reward_file=FINAL_ANSWER_REWARD, max_len=TOOL_MAX_LEN,
                 max_new_tokens=TOOL_TURN_CAP)
    after_sft = agent_success(sft, test, None, **check)[0]
    rl_flags = demo.agent_rl_flags(scale, sft, data, rl, seed, CALCULATOR_AGENT)
    rl_flags = _set(_set(rl_flags, "--data.max_len", str(TOOL_MAX_LEN)), "--rollout.max_new_tokens",
                    str(TOOL_TURN_CAP))
    at = rl_flags.index("--train.agent_func_path")
    rl_flags[at: at + 2] = ["--train.tool_path", tool_file, "--reward.remote_url", FINAL_ANSWER_REWARD]
    if lr is not None:
        rl_flags = _set(rl_flags, "--actor.adam.lr", str(lr))
    train_ppo_ray.main(rl_flags + ["--rollout.temperature", str(temperature)])
    return after_sft, agent_success(rl, test, None, **check)[0]


def copy_accuracy(model_dir: str, transcripts: str, n: int = 200) -> float:
    """`--copy-check` (module doc): the fraction of the first `n` tool-calling transcripts (4 messages) whose
    greedy answer, after the rest of the transcript, equals the row's `answer`."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.data.readers import read_file
    from posttrain.models import load_tokenizer

    tok, model = load_tokenizer(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [r for r in read_file(transcripts) if len(r["messages"]) == 4][:n]
    right = 0
    for r in rows:
        kw = {"tools": r["tools"]} if r.get("tools") else {}
        ids = tok.apply_chat_template(r["messages"][:3], add_generation_prompt=True, tokenize=False, **kw)
        ids = tok(ids, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
        right += tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip() == r["answer"]
    return right / len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--full", action="store_true", help="the demo's full scale (default: --quick's)")
    p.add_argument("--compact-tools", action="store_true", help="list each tool as one line (see above)")
    p.add_argument("--compact-results", action="store_true",
                   help="with --compact-tools, a tool's result renders as `= result` (see above)")
    p.add_argument("--tool-file", choices=["environment", "functions"], default="environment")
    skip = p.add_mutually_exclusive_group()
    skip.add_argument("--skip-agent-file", action="store_true", help="run the tool file only")
    skip.add_argument("--skip-tool-file", action="store_true", help="run the agent file only")
    p.add_argument("--temperature", type=float, default=1.0, help="RL rollouts' sampling temperature")
    p.add_argument("--tool-rl-lr", type=float, help="the tool file's RL learning rate (default: the demo's)")
    p.add_argument("--tool-sft-epochs", type=int, help="the tool file's SFT epochs (default: the demo's)")
    p.add_argument("--reuse-sft", action="store_true", help="keep the SFT models an earlier run left")
    p.add_argument("--output", default="runs/bench_agent_tools")
    p.add_argument("--copy-check", nargs=2, metavar=("MODEL_DIR", "TRANSCRIPTS"),
                   help="only print how often the SFT model copies the tool's result (see above)")
    args = p.parse_args()
    if args.copy_check:
        print(f"{copy_accuracy(*args.copy_check):.1%}")
        return
    if args.compact_results and not args.compact_tools:
        p.error("--compact-results changes the --compact-tools template: give both")
    scale, results = demo.FULL if args.full else demo.QUICK, []
    for seed in args.seeds:
        out = Path(args.output) / f"seed{seed}"
        base = out / "base"
        if not (args.reuse_sft and base.exists()):
            build_tiny(str(base), arch="llama", size=scale.size, head="lm", seed=seed, overwrite=True)
        t0 = time.time()
        agent = None if args.skip_agent_file else run_agent_file(scale, base, out, seed, args.temperature,
                                                                 args.reuse_sft)
        t1 = time.time()
        tools = None if args.skip_tool_file else run_tool_file(
            scale, base, out, seed, args.compact_tools, args.tool_file == "environment", args.temperature,
            args.reuse_sft, args.tool_rl_lr, args.compact_results, args.tool_sft_epochs)
        results.append({"seed": seed, "agent_file": agent, "tool_file": tools,
                        "minutes": [round((t1 - t0) / 60, 1), round((time.time() - t1) / 60, 1)]})
        print(json.dumps(results[-1]), flush=True)
    print(f"\n| seed | agent file: SFT | agent file: RL | tool file ({args.tool_file}): SFT | tool file: RL "
          "| minutes (agent, tools) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        cells = [f"{v:.1%}" if v is not None else "-" for k in ("agent_file", "tool_file")
                 for v in (r[k] or (None, None))]
        print(f"| {r['seed']} | {' | '.join(cells)} | {r['minutes'][0]}, {r['minutes'][1]} |")
    means = []
    for k in ("agent_file", "tool_file"):
        ran = [r[k] for r in results if r[k]]
        means += [f"{sum(v[i] for v in ran) / len(ran):.1%}" if ran else "-" for i in (0, 1)]
    print(f"| mean | {' | '.join(means)} | |")


if __name__ == "__main__":
    main()
