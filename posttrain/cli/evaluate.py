"""`posttrain eval`: a model's pass@1 (the mean reward), pass@k (k = --rollout.n_samples_per_prompt > 1: the
mean over prompts of the best of k) and mean response length on a labelled dataset, scored by a reward file,
server or model (default: the math grader, `posttrain/rewards/examples/math_reward.py`). The numbers and names
are those `posttrain ppo --eval.dataset` logs (`eval_<dataset>_pass1`, ...): the same code computes them, so
the same checkpoint, prompts, temperature and samples give the same values. Flags: `posttrain eval --help`."""
from __future__ import annotations

import sys

from posttrain.cli.exits import user_errors

PROG = "posttrain eval"


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print one line per metric and return them. Bad flags, files or keys: one `posttrain eval: error:` line,
    exit status 2."""
    from posttrain.config import parse_config
    from posttrain.trainers.inputs import check_sampling_inputs

    with user_errors(PROG):
        cfg = parse_config("eval", sys.argv[1:] if argv is None else argv)
        check_sampling_inputs(cfg)
        from posttrain.trainers.inference import (
            MATH_GRADER,
            evaluate,
            prepare,
            sampling_params,
            write_jsonl_output,
        )

        policy, _, prompts, reward = prepare(cfg, default_reward=MATH_GRADER)
        metrics = evaluate(policy, prompts.prompts, sampling_params(cfg), reward, cfg.data.dataset)
    for key, value in metrics.items():
        print(f"{key} {value:.6g}")
    if cfg.output:
        with user_errors(PROG):
            write_jsonl_output(cfg.output, [metrics])
    return metrics


if __name__ == "__main__":
    main()
