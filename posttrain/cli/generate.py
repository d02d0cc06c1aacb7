"""`posttrain generate`: sample every prompt of --data.dataset --rollout.n_samples_per_prompt times into
--output (JSONL, one row per sample: the dataset row's columns, `prompt` (its --data.input_key value, as in
the dataset), `prompt_text` (the rendered prompt the model was given), `output`, `index` (the row's),
`sample` (0..n-1), and `reward` when a reward scores them). `--post_processor rs` keeps each prompt's best
sample; `iter_dpo` writes one row per prompt with `chosen` and `rejected` (its best and worst samples) in
place of `output`: rejection sampling and iterative DPO data.
Flags: `posttrain generate --help` (`posttrain.config.inference.GenerateConfig`)."""
from __future__ import annotations

import sys

from posttrain.cli.exits import user_errors

PROG = "posttrain generate"


def main(argv: list[str] | None = None) -> str:
    """Write --output and return its path. Bad flags, files or keys: one `posttrain generate: error:` line,
    exit status 2."""
    from posttrain.config import parse_config
    from posttrain.trainers.inputs import check_sampling_inputs

    with user_errors(PROG):
        cfg = parse_config("generate", sys.argv[1:] if argv is None else argv)
        check_sampling_inputs(cfg)
        from posttrain.trainers.inference import prepare, sample, sampling_params, write_jsonl_output

        policy, rows, prompts, reward = prepare(cfg)
        scored = sample(policy, prompts.prompts, sampling_params(cfg), reward)
    n = cfg.rollout.n_samples_per_prompt
    out = []
    for g, (source, prompt) in enumerate(zip(rows, prompts.prompts)):  # no prompt is dropped (no length cap)
        row = {k: v for k, v in source.items() if not k.startswith("__")}
        samples = []
        for j in range(n):
            i = g * n + j
            sample_row = {**row, "prompt": row[cfg.data.input_key], "prompt_text": prompt.text,
                          "output": scored.rollouts[i].response_text, "index": g, "sample": j}
            if reward is not None:
                sample_row["reward"] = float(scored.rewards[i])
            samples.append(sample_row)
        out += post_process(samples, cfg.post_processor)
    with user_errors(PROG):
        write_jsonl_output(cfg.output, out)
    post = f", --post_processor {cfg.post_processor}" if cfg.post_processor else ""
    print(f"{len(out)} rows ({len(prompts.prompts)} prompts x {n} samples{post}) written to {cfg.output}")
    return cfg.output


def post_process(samples: list[dict], post_processor: str | None) -> list[dict]:
    """A prompt's rows to write: all samples (None), its best one (rs: the first of equal rewards), or one
    pair {prompt, chosen, rejected, chosen_reward, rejected_reward} of its best and of its worst whose text
    differs (iter_dpo; none if all tie or no text differs: `posttrain dpo` refuses identical pairs)."""
    if not post_processor:
        return samples
    ranked = sorted(samples, key=lambda s: -s["reward"])  # stable: the earliest of equal rewards first
    if post_processor == "rs":
        return ranked[:1]
    best = ranked[0]
    worst = next((s for s in reversed(ranked) if s["output"] != best["output"]), best)
    if best["reward"] == worst["reward"]:  # all tie, or every other sample is the same text
        return []
    rest = {k: v for k, v in best.items() if k not in ("output", "reward", "sample")}
    return [{**rest, "chosen": best["output"], "rejected": worst["output"], "chosen_reward": best["reward"],
             "rejected_reward": worst["reward"]}]


if __name__ == "__main__":
    main()
