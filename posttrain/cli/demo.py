"""`posttrain demo [--quick]` — the main job on the embedded default (tiny local model, one
process, CPU), every stage through the same entry points a user runs:

  init-tiny → SFT on a sloppy demonstrator's answers → from the SFT model:
    (a) RL with the verifiable reward (GRPO),
    (b) a reward model on preference pairs → PPO with that reward model (critic, GAE),
    (c) DPO on the same pairs,
and one table of held-out accuracy after each, plus the RM's held-out preference accuracy.
Then a task where turns matter (`posttrain.agents.examples.calculator`): multiplication with a
calculator tool. SFT on transcripts where the demonstrator uses the tool only sometimes (otherwise it
guesses), multi-turn RL with the environment's reward (`--train.agent_func_path`), and a single-turn
control trained the same way without the tool; greedy held-out success for each. Last, a task only the
image answers (`posttrain.data.synthetic_vision`): the colour of a shape, on a tiny vision-language model.
SFT on a sloppy demonstrator (it names a random colour in 70% of its answers), GRPO with the verifiable
reward, and a control trained the same way on blank images.

The task is locally generated two-digit addition. The demonstrator answers exactly but, in most
answers, adds a rounded estimate ("81, roughly 80"), so the last number of its answer, which the
grader reads, is usually wrong: SFT learns the arithmetic and the habit. The verifiable reward, the
preference pairs (exact answer preferred over the habit or a wrong number) and the RM trained on
them each carry the signal that removes it."""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DemoScale:
    size: str
    difficulty: int
    n_train: int
    n_test: int
    habit: float  # probability that a demonstration carries the rounded tail
    epochs: int
    batch_size: int
    lr: float
    rl_prompts: int
    rl_lr: float
    n_pairs: int
    rm_epochs: int
    rm_lr: float
    ppo_prompts: int
    ppo_lr: float
    critic_lr: float
    dpo_epochs: int
    dpo_lr: float
    agent_train: int  # calculator transcripts for SFT
    agent_lr: float  # SFT on the calculator transcripts
    agent_prompts: int  # RL prompts of the calculator task
    agent_rl_lr: float
    vision_sft_rows: int  # colour task (vision-language): the sloppy demonstrator's rows
    vision_sft_epochs: int
    vision_rl_steps: int


FULL = DemoScale(size="tiny", difficulty=1, n_train=8000, n_test=200, habit=0.7, epochs=3, batch_size=32,
                 lr=2e-3, rl_prompts=1600, rl_lr=3e-4, n_pairs=2000, rm_epochs=3, rm_lr=5e-4,
                 ppo_prompts=1600, ppo_lr=1e-4, critic_lr=1e-3, dpo_epochs=1, dpo_lr=1e-4, agent_train=4000,
                 agent_lr=1e-3, agent_prompts=3840, agent_rl_lr=3e-4, vision_sft_rows=512,
                 vision_sft_epochs=4, vision_rl_steps=80)
QUICK = DemoScale(size="nano", difficulty=0, n_train=1200, n_test=100, habit=0.7, epochs=2, batch_size=16,
                  lr=3e-3, rl_prompts=80, rl_lr=3e-4, n_pairs=256, rm_epochs=1, rm_lr=1e-3, ppo_prompts=64,
                  ppo_lr=3e-4, critic_lr=1e-3, dpo_epochs=1, dpo_lr=1e-4, agent_train=400, agent_lr=3e-3,
                  agent_prompts=32, agent_rl_lr=3e-4, vision_sft_rows=192, vision_sft_epochs=2,
                  vision_rl_steps=4)

STAGES = ("after SFT", "after DPO", "after PPO with the RM", "after RL (GRPO, verifiable reward)")
AGENT_STAGES = ("after SFT (tool available)", "after multi-turn RL with the tool",
                "single-turn control: RL, no tool")
VISION_STAGES = ("after SFT (sloppy demonstrator)", "after RL (GRPO, verifiable reward)",
                 "blank-image control: SFT + RL")
VISION_SLOPPY = 0.7  # the colour demonstrator names a random colour in 70% of its answers
VISION_RL_LR = 5e-4
RM_STAGE = "reward model: held-out preference acc."
BASE = "base (random init)"
TOOL_USE = 0.4  # the calculator demonstrator calls the tool in 40% of its transcripts, else guesses


def _accuracy(model_dir: Path, rows: list[dict]) -> tuple[float, list[dict]]:
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.trainers.task_eval import greedy_accuracy

    tok = load_tokenizer(str(model_dir))
    model = load_causal_lm(str(model_dir), dtype="fp32")
    return greedy_accuracy(model, tok, rows)


def split_held_out(rows: list[dict], n_test: int) -> tuple[list[dict], list[dict], bool]:
    """Test prompts never seen in training, when the task has enough distinct prompts; the easiest
    task (single-digit addition) has only 100, so there the test prompts are training facts too."""
    distinct = list(dict.fromkeys(r["prompt"] for r in rows))
    if len(distinct) < 4 * n_test:
        return rows[:-n_test], rows[-n_test:], False
    held = set(distinct[-n_test:])
    test = list({r["prompt"]: r for r in rows if r["prompt"] in held}.values())
    return [r for r in rows if r["prompt"] not in held], test, True


def write_data(scale: DemoScale, out: Path, seed: int) -> dict:
    """data/sft (demonstrations) and data/pairs (preference pairs): train.jsonl + test.jsonl each;
    the test prompts of both are the same held-out problems."""
    from posttrain.data.synthetic import make_arithmetic_rows, make_preference_rows, write_jsonl

    n = scale.n_train + 2 * scale.n_test
    train, test, disjoint = split_held_out(
        make_arithmetic_rows(n, seed=seed, difficulty=scale.difficulty, rounding_habit=scale.habit),
        scale.n_test)
    held = {r["prompt"] for r in test}
    pairs = make_preference_rows(n, seed=seed, difficulty=scale.difficulty, rounding_habit=0.5)
    pair_train = [p for p in pairs if p["prompt"] not in held][: scale.n_pairs]
    pair_test = list({p["prompt"]: p for p in pairs if p["prompt"] in held}.values())
    if not disjoint:  # single-digit task: every prompt is a training fact, hold out pairs by row
        pair_train, pair_test = pairs[: scale.n_pairs], pairs[-scale.n_test:]
    for name, tr, te in (("sft", train, test), ("pairs", pair_train, pair_test)):
        write_jsonl(tr, out / "data" / name / "train.jsonl")
        write_jsonl(te, out / "data" / name / "test.jsonl")
    return {"train": train, "test": test, "disjoint": disjoint}


def sft_flags(scale: DemoScale, base: Path, data: Path, out: Path, seed: int) -> list[str]:
    """The SFT launch, written with the same flags as an OpenRLHF 0.10.2 train_sft.sh."""
    return [
        "--model.model_name_or_path", str(base), "--data.dataset", str(data),
        "--data.input_key", "prompt", "--data.output_key", "response", "--data.apply_chat_template",
        "--data.max_len", "64", "--eval.dataset", str(data), "--eval.split", "test", "--eval.steps", "100",
        "--train.batch_size", str(scale.batch_size), "--train.micro_batch_size", str(scale.batch_size),
        "--train.max_epochs", str(scale.epochs), "--train.seed", str(seed),
        "--adam.lr", str(scale.lr), "--lr_warmup_ratio", "0.05", "--adam.weight_decay", "0.0",
        "--ckpt.output_dir", str(out), "--ckpt.overwrite", "--ckpt.save_steps", "-1",
        "--logger.logging_steps", "5",
    ]


def _rl_common(sft: Path, data: Path, out: Path, seed: int, prompts: int, lr: float, kl: float) -> list[str]:
    return [
        "--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
        "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
        "--data.max_len", "64", "--data.max_samples", str(prompts), "--algo.kl.init_coef", str(kl),
        "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "10",
        "--rollout.micro_batch_size", "64", "--train.batch_size", "128", "--train.micro_batch_size", "64",
        "--actor.adam.lr", str(lr), "--actor.lr_warmup_ratio", "0.05", "--train.seed", str(seed),
        "--eval.dataset", str(data), "--eval.split", "test", "--eval.steps", "25", "--eval.temperature", "0",
        "--eval.n_samples_per_prompt", "1", "--ckpt.output_dir", str(out), "--ckpt.overwrite",
        "--logger.logging_steps", "1",
    ]


def rl_flags(scale: DemoScale, sft: Path, data: Path, out: Path, seed: int) -> list[str]:
    """GRPO with the shipped verifiable reward (OpenRLHF train_ppo_ray flags)."""
    from posttrain.rewards.examples import ARITHMETIC

    return _rl_common(sft, data, out, seed, scale.rl_prompts, scale.rl_lr, kl=0.0) + [
        "--reward.remote_url", ARITHMETIC, "--algo.advantage.estimator", "group_norm"]


def _pair_flags(sft: Path, pairs: Path, out: Path, seed: int, epochs: int, lr: float) -> list[str]:
    return [
        "--model.model_name_or_path", str(sft), "--data.dataset", str(pairs), "--data.prompt_key", "prompt",
        "--data.chosen_key", "chosen", "--data.rejected_key", "rejected", "--data.apply_chat_template",
        "--data.max_len", "64", "--train.batch_size", "32", "--train.micro_batch_size", "32",
        "--train.max_epochs", str(epochs), "--train.seed", str(seed), "--adam.lr", str(lr),
        "--lr_warmup_ratio", "0.05", "--eval.dataset", str(pairs), "--eval.split", "test",
        "--eval.steps", "-1", "--ckpt.output_dir", str(out), "--ckpt.overwrite", "--ckpt.save_steps", "-1",
        "--logger.logging_steps", "5",
    ]


def rm_flags(scale: DemoScale, sft: Path, pairs: Path, out: Path, seed: int) -> list[str]:
    """A reward model initialised from the SFT model (a fresh score head), OpenRLHF train_rm flags."""
    return _pair_flags(sft, pairs, out, seed, scale.rm_epochs, scale.rm_lr)


def ppo_rm_flags(scale: DemoScale, sft: Path, rm: Path, data: Path, out: Path, seed: int) -> list[str]:
    """PPO with the learned reward model (normalised by its stored mean/std), a critic initialised
    from it, as OpenRLHF's train_ppo_ray does by default, and a KL penalty to the SFT model in the
    reward, which keeps the policy where the RM has seen data (without it, the policy learns the
    RM's blind spots: tens-digit errors, which no preference pair shows)."""
    return _rl_common(sft, data, out, seed, scale.ppo_prompts, scale.ppo_lr, kl=0.05) + [
        "--reward.model_name_or_path", str(rm), "--reward.normalize_enable", "--critic.model_name_or_path",
        str(rm), "--critic.adam.lr", str(scale.critic_lr), "--algo.advantage.estimator", "gae"]


def dpo_flags(scale: DemoScale, sft: Path, pairs: Path, out: Path, seed: int) -> list[str]:
    """DPO from the SFT model (also the reference), OpenRLHF train_dpo flags."""
    return _pair_flags(sft, pairs, out, seed, scale.dpo_epochs, scale.dpo_lr) + ["--model.beta", "0.1"]


def agent_data(scale: DemoScale, out: Path, seed: int) -> list[dict]:
    """data/agent: calculator transcripts (train.jsonl) and held-out problems (test.jsonl)."""
    from posttrain.agents.examples.calculator import make_calculator_rows
    from posttrain.data.synthetic import write_jsonl

    rows = make_calculator_rows(scale.agent_train + scale.n_test, seed=seed, tool_use=TOOL_USE)
    train, test = rows[: scale.agent_train], rows[scale.agent_train:]
    write_jsonl(train, out / "data" / "agent" / "train.jsonl")
    write_jsonl(test, out / "data" / "agent" / "test.jsonl")
    return test


def agent_sft_flags(scale: DemoScale, base: Path, data: Path, out: Path, seed: int) -> list[str]:
    """Multi-turn SFT on the transcripts (loss on every assistant turn), OpenRLHF train_sft flags."""
    return [
        "--model.model_name_or_path", str(base), "--data.dataset", str(data), "--data.input_key", "messages",
        "--data.apply_chat_template", "--data.multiturn", "--data.max_len", "96",
        "--train.batch_size", "32", "--train.micro_batch_size", "32", "--train.max_epochs", str(scale.epochs),
        "--train.seed", str(seed), "--adam.lr", str(scale.agent_lr), "--lr_warmup_ratio", "0.05",
        "--adam.weight_decay", "0.0", "--ckpt.output_dir", str(out), "--ckpt.overwrite",
        "--ckpt.save_steps", "-1",
        "--logger.logging_steps", "5",
    ]


def agent_rl_flags(scale: DemoScale, sft: Path, data: Path, out: Path, seed: int,
                   agent_file: str) -> list[str]:
    """Multi-turn RL: episodes of the agent file, rewards from its environment (train_ppo_ray flags)."""
    return [
        "--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
        "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
        "--data.max_len", "96", "--data.max_samples", str(scale.agent_prompts),
        "--train.agent_func_path", agent_file, "--algo.advantage.estimator", "group_norm",
        "--algo.kl.init_coef", "0", "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8",
        "--rollout.max_new_tokens", "12", "--rollout.micro_batch_size", "64", "--train.batch_size", "128",
        "--train.micro_batch_size", "64", "--actor.adam.lr", str(scale.agent_rl_lr),
        "--actor.lr_warmup_ratio", "0.05", "--train.seed", str(seed), "--ckpt.output_dir", str(out),
        "--ckpt.overwrite", "--logger.logging_steps", "1",
    ]


def run_arithmetic_task(scale: DemoScale, base: Path, out: Path, seed: int, timed) -> dict:
    """The arithmetic task: the base model at `base`, SFT, then from it DPO, a reward model and PPO with it,
    and GRPO; greedy held-out accuracy after each (keys: STAGES), the RM's held-out preference accuracy,
    the test rows, whether their prompts are unseen in training, the model folders and GRPO's samples."""
    from posttrain.cli import train_dpo, train_ppo_ray, train_rm, train_sft
    from posttrain.models import build_tiny

    build_tiny(str(base), arch="llama", size=scale.size, head="lm", seed=seed, overwrite=True)
    data = write_data(scale, out, seed)
    sft_data, pairs = out / "data" / "sft", out / "data" / "pairs"
    test = data["test"]
    acc: dict[str, float] = {BASE: _accuracy(base, test)[0]}
    d = {name: out / name for name in ("sft", "rl", "rm", "ppo_rm", "dpo")}
    timed(STAGES[0], train_sft.main, sft_flags(scale, base, sft_data, d["sft"], seed), "posttrain demo (sft)")
    acc[STAGES[0]] = _accuracy(d["sft"], test)[0]
    timed(STAGES[1], train_dpo.main, dpo_flags(scale, d["sft"], pairs, d["dpo"], seed),
          "posttrain demo (dpo)")
    acc[STAGES[1]] = _accuracy(d["dpo"], test)[0]
    rm_eval = timed("reward model", train_rm.main, rm_flags(scale, d["sft"], pairs, d["rm"], seed),
                    "posttrain demo (rm)")
    timed(STAGES[2], train_ppo_ray.main, ppo_rm_flags(scale, d["sft"], d["rm"], sft_data, d["ppo_rm"], seed),
          "posttrain demo (ppo with rm)")
    acc[STAGES[2]] = _accuracy(d["ppo_rm"], test)[0]
    timed(STAGES[3], train_ppo_ray.main, rl_flags(scale, d["sft"], sft_data, d["rl"], seed),
          "posttrain demo (grpo)")
    acc[STAGES[3]], samples = _accuracy(d["rl"], test)
    return {"accuracy": acc, "rm_preference_accuracy": rm_eval.get("eval/acc", float("nan")), "test": test,
            "disjoint": data["disjoint"], "models": d, "samples": samples}


def run_agent_task(scale: DemoScale, base: Path, out: Path, seed: int, timed) -> dict[str, float]:
    """The calculator task: SFT → multi-turn RL, and the single-turn control; greedy held-out success."""
    from posttrain.agents.examples import CALCULATOR_AGENT, CALCULATOR_NO_TOOL
    from posttrain.cli import train_ppo_ray, train_sft
    from posttrain.trainers.task_eval import agent_success

    test = agent_data(scale, out, seed)
    data, sft, rl, single = (out / "data" / "agent", out / "agent_sft", out / "agent_rl",
                             out / "agent_single_turn")
    timed(AGENT_STAGES[0], train_sft.main, agent_sft_flags(scale, base, data, sft, seed),
          "posttrain demo (agent sft)")
    success = {AGENT_STAGES[0]: agent_success(sft, test, CALCULATOR_AGENT)[0]}
    timed(AGENT_STAGES[1], train_ppo_ray.main, agent_rl_flags(scale, sft, data, rl, seed, CALCULATOR_AGENT),
          "posttrain demo (multi-turn rl)")
    success[AGENT_STAGES[1]] = agent_success(rl, test, CALCULATOR_AGENT)[0]
    timed(AGENT_STAGES[2], train_ppo_ray.main,
          agent_rl_flags(scale, sft, data, single, seed, CALCULATOR_NO_TOOL),
          "posttrain demo (single-turn control)")
    success[AGENT_STAGES[2]] = agent_success(single, test, CALCULATOR_NO_TOOL)[0]
    return success


def _vision_flags(base: Path, sft_data: str, rl_data: str, out: Path, seed: int, scale: DemoScale):
    """(SFT flags, RL flags) of the colour task: SFT on the sloppy demonstrator, then GRPO with the
    verifiable colour reward, the vision tower frozen."""
    common = ["--data.input_key", "prompt", "--data.apply_chat_template", "--data.max_images_per_prompt", "1",
              "--data.max_len", "64", "--logger.logging_steps", "1", "--train.seed", str(seed)]
    sft = ["--model.model_name_or_path", str(base), "--data.dataset", sft_data,
           "--data.output_key", "response", "--train.batch_size", "16", "--train.micro_batch_size", "16",
           "--train.max_epochs", str(scale.vision_sft_epochs), "--adam.lr", "2e-3",
           "--ckpt.output_dir", str(out / "sft"), "--ckpt.overwrite", *common]
    rl = ["--actor.model_name_or_path", str(out / "sft"), "--data.prompt_dataset", rl_data,
          "--data.label_key", "answer",
          "--reward.remote_url",
          str(Path(__file__).resolve().parents[1] / "rewards" / "examples" / "colour_reward.py"),
          "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
          "--rollout.n_samples_per_prompt", "8", "--rollout.batch_size", "16",
          "--rollout.max_new_tokens", "4", "--rollout.micro_batch_size", "64", "--train.batch_size", "128",
          "--train.micro_batch_size", "64", "--train.max_steps", str(scale.vision_rl_steps),
          "--actor.adam.lr", str(VISION_RL_LR), "--actor.lr_warmup_ratio", "0",
          "--actor.freeze_visual_encoder", "--ckpt.output_dir", str(out / "rl"), "--ckpt.overwrite", *common]
    return sft, rl


def run_vision_task(scale: DemoScale, out: Path, seed: int, timed) -> dict[str, float]:
    """The colour task on a tiny vision-language model: SFT on a demonstrator that names the right colour in
    30% of its answers (plus chance), then GRPO with the verifiable reward; the control trains the same way on
    blank images. Greedy held-out accuracy on real images after each."""
    from posttrain.cli import train_ppo_ray, train_sft
    from posttrain.data.synthetic_vision import colour_rows, write_colour_dataset
    from posttrain.models import build_tiny
    from posttrain.trainers.task_eval import colour_accuracy

    base, data = out / "vision_base", out / "data" / "vision"
    build_tiny(str(base), size="nano", seed=seed, overwrite=True, vision=True, verbose=False)
    test = colour_rows(scale.n_test, seed=seed + 3, folder=data / "test")
    acc = {BASE: colour_accuracy(base, test)[0]}
    for blank, folder, stages in ((False, out / "vision", VISION_STAGES[:2]),
                                  (True, out / "vision_blank", VISION_STAGES[2:])):
        kind = "blank" if blank else "images"
        sft_data = write_colour_dataset(data / kind, scale.vision_sft_rows, seed + 1, blank=blank, name="sft",
                                        sloppy=VISION_SLOPPY)
        rl_data = write_colour_dataset(data / kind, 16 * scale.vision_rl_steps, seed + 2, blank=blank,
                                       name="rl")
        sft, rl = _vision_flags(base, sft_data, rl_data, folder, seed, scale)
        timed(stages[0] if not blank else f"{stages[0]} (sft)", train_sft.main, sft)
        if not blank:
            acc[stages[0]] = colour_accuracy(folder / "sft", test)[0]
        timed(stages[-1], train_ppo_ray.main, rl)
        acc[stages[-1]] = colour_accuracy(folder / "rl", test)[0]
    return acc


@dataclass(frozen=True)
class MeasuredRange:
    """Where one row of the demo's table landed over MEASURED_SEEDS seeds (held-out %, min-max), and the
    first words of that row in the Results tables of README.md and docs/getting-started.md, which show
    the same range."""
    low: float
    high: float
    readme: str
    guide: str


# Where `make demo` lands over MEASURED_SEEDS seeds (42, 1, 2): the "range" column of the README and the
# guide, printed beside each row's own number. How each was measured: bench/RESULTS.md ("The demo's rows
# over 3 seeds"). Another seed or CPU reads another number inside (or near) these ranges; a number far
# outside them is worth a look. The calculator's SFT range joins two machines' runs of the same seeds.
MEASURED_SEEDS = 3
# Keyed by (task, stage): each task (arithmetic, calculator, colour) prints its own section of the table, and
# one stage name can be a row of two tasks ("after RL (GRPO, verifiable reward)": arithmetic and colour).
MEASURED: dict[tuple[str, str], MeasuredRange] = {
    ("arithmetic", BASE): MeasuredRange(0.0, 0.0, "base model", "base (random init"),
    ("arithmetic", STAGES[0]): MeasuredRange(9.5, 12.0, "SFT (", "after SFT ("),
    ("arithmetic", STAGES[1]): MeasuredRange(95.0, 98.5, "DPO (", "after DPO ("),
    ("arithmetic", STAGES[2]): MeasuredRange(88.5, 98.5, "PPO with the reward model",
                                             "after PPO with the reward model"),
    ("arithmetic", STAGES[3]): MeasuredRange(87.0, 99.0, "GRPO with the verifiable reward",
                                             "after RL with the verifiable reward"),
    ("arithmetic", RM_STAGE): MeasuredRange(94.0, 99.0, "reward model (", "reward model ("),
    ("calculator", AGENT_STAGES[0]): MeasuredRange(16.0, 30.5, "calculator task: multi-turn SFT",
                                                   "calculator task (multiplication"),
    ("calculator", AGENT_STAGES[1]): MeasuredRange(90.5, 94.5, "calculator task: multi-turn RL",
                                                   "calculator: after multi-turn RL"),
    ("calculator", AGENT_STAGES[2]): MeasuredRange(0.0, 1.0, "calculator task: single-turn control",
                                                   "calculator: single-turn control"),
    ("colour", BASE): MeasuredRange(0.0, 0.0, "colour task: base model", "colour: base (random init"),
    ("colour", VISION_STAGES[0]): MeasuredRange(45.5, 71.0, "colour task (vision-language",
                                                "colour task (vision-language"),
    ("colour", VISION_STAGES[1]): MeasuredRange(71.5, 85.0, "colour task: GRPO", "colour: after GRPO"),
    ("colour", VISION_STAGES[2]): MeasuredRange(24.0, 26.0, "colour task: blank-image control",
                                                "colour: blank-image control"),
}


def measured_range(task: str, stage: str) -> str:
    """The printed range of the row `stage` of `task` ("lo-hi%"), "" where none was measured."""
    r = MEASURED.get((task, stage))
    return f"{r.low:.1f}-{r.high:.1f}%" if r else ""


def _row(task: str, stage: str, value: float, minutes: float | None, quick: bool) -> str:
    measured = "" if quick else measured_range(task, stage)
    return f"  {stage:<42}{value:>9.1%}{'' if minutes is None else f'{minutes:>9.1f}':>9}{measured:>18}"


def print_table(summary: dict) -> None:
    quick = summary.get("quick", False)
    header = (f"  {'stage':<42}{'accuracy':>9}{'minutes':>9}"
              f"{'' if quick else f'{MEASURED_SEEDS} seeds (README)':>18}")
    minutes = summary["minutes"]
    print("\nheld-out accuracy on", summary["task"], f"({summary['held_out_prompts']} prompts, greedy)")
    print(header)
    for stage, acc in summary["accuracy"].items():
        print(_row("arithmetic", stage, acc, minutes.get(stage), quick))
    print(_row("arithmetic", RM_STAGE, summary["rm_preference_accuracy"], minutes["reward model"], quick))
    print(f"\nheld-out success on {summary['agent_task']} ({summary['held_out_prompts']} problems, greedy "
          f"episodes)")
    for stage, acc in summary["agent_success"].items():
        print(_row("calculator", stage, acc, minutes[stage], quick))
    print(f"\nheld-out accuracy on {summary['vision_task']} ({summary['held_out_prompts']} images, greedy)")
    for stage, acc in summary["vision_accuracy"].items():
        print(_row("colour", stage, acc, minutes.get(stage), quick))
    drawn = " and plots" if summary.get("plots") else ""
    print(f"done in {summary['seconds'] / 60:.1f} min; models, metrics{drawn} under {summary['output']}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="posttrain demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="runs/demo", help="folder for models, data, metrics and plots")
    p.add_argument("--quick", action="store_true", help="a smaller, faster variant (used by the tests)")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    scale = QUICK if args.quick else FULL
    out = Path(args.output)
    t0 = time.time()
    minutes: dict[str, float] = {}

    def timed(stage: str, fn, *a):
        start = time.time()
        result = fn(*a)
        minutes[stage] = round((time.time() - start) / 60, 2)
        return result

    base = out / "base"
    arith = run_arithmetic_task(scale, base, out, args.seed, timed)
    acc, test, d = arith["accuracy"], arith["test"], arith["models"]
    agent = run_agent_task(scale, base, out, args.seed, timed)
    vision = run_vision_task(scale, out, args.seed, timed)

    summary = {"task": f"arithmetic difficulty {scale.difficulty}, demonstrations with the rounding habit "
                       f"in {scale.habit:.0%}", "held_out_prompts": len(test),
               "held_out_prompts_unseen_in_training": arith["disjoint"], "accuracy": acc,
               "rm_preference_accuracy": arith["rm_preference_accuracy"], "minutes": minutes,
               "agent_task": f"multiplication with a calculator tool (demonstrator uses it in "
                             f"{TOOL_USE:.0%})",
               "agent_success": agent,
               "vision_task": f"the colour of a shape in an image (vision-language; the demonstrator names a "
                              f"random colour in {VISION_SLOPPY:.0%} of its answers)",
               "vision_accuracy": vision, "seconds": round(time.time() - t0, 1), "output": str(out),
               "quick": args.quick,
               "plots": {name: str(path / "plots") for name, path in d.items() if (path / "plots").is_dir()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with (out / "samples_final.jsonl").open("w") as f:
        for s in arith["samples"]:
            f.write(json.dumps(s) + "\n")
    print_table(summary)
    return summary


if __name__ == "__main__":
    main()
