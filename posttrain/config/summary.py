"""Derived batch sizes and the start-up summary of a config."""

from __future__ import annotations

from typing import Any

from posttrain.config.flag_values import format_value
from posttrain.config.hardware import resolved_values
from posttrain.config.spec import changed_values, flag_sources, flag_specs, get_path
from posttrain.config.trainers import CommandConfig, TrainerConfig


def data_parallel_size(cfg: TrainerConfig, world_size: int) -> int:
    """The ranks that take different samples: the world size, divided by the ranks a model copy spans
    (`DSConfig.model_ranks`; sft, rm, dpo: a tensor- or context-parallel group takes the same samples) when
    that divides it."""
    single_model = cfg.trainer in ("sft", "rm", "dpo", "kd", "kto", "prm")
    ws = max(int(world_size), 1)
    same = cfg.ds.model_ranks if single_model else 1
    return ws // same if ws % same == 0 else ws


def micro_batch_tokens(cfg: TrainerConfig, per_gpu: int | None, tensor: int | None = None) -> int | None:
    """A micro-batch's token budget with dynamic batching, from a `--*.max_tokens_per_gpu` value: x
    --ds.ring_attn_size x the tensor-parallel size, the GPUs of a ring-attention / tensor-parallel group that
    compute one micro-batch together (as OpenRLHF); None stays None. `tensor`: the model's own tensor-parallel
    size (ppo's reference is not split: 1), default the trained models' (`DSConfig.model_ranks`)."""
    group = cfg.ds.model_ranks if tensor is None else cfg.ds.ring_attn_size * tensor
    return None if per_gpu is None else per_gpu * group


def derived_sizes(cfg: TrainerConfig, world_size: int = 1) -> dict[str, Any]:
    """Sizes implied by the batch flags for `world_size` ranks, `data_parallel_size` of them taking different
    samples (`world_size` unless a model copy spans several ranks; below, "world_size" means that size).

    world_size; samples_per_rank_per_step = train.batch_size / world_size;
    gradient_accumulation_steps = micro-batches per rank per optimizer step
      = batch_size / (micro_batch_size * world_size) (None with dynamic batching: set by the token budget);
    micro_batches_per_step = micro-batches per optimizer step over all ranks (None with dynamic batching).
    PPO adds prompts_per_rollout, samples_per_rollout = rollout.batch_size * n_samples_per_prompt,
    optimizer_steps_per_rollout = samples_per_rollout / train.batch_size * train.max_epochs.
    Divisions are floor divisions; `validate` rejects sizes that do not divide."""
    t = cfg.train
    out: dict[str, Any] = {"world_size": max(int(world_size), 1)}
    ws = data_parallel_size(cfg, world_size)  # with tensor parallelism, per tensor-parallel group
    if ws != out["world_size"]:
        out["data_parallel_size"] = ws
    out["samples_per_rank_per_step"] = t.batch_size // ws
    if t.dynamic_batch_enable:
        out.update(
            micro_batches_per_step=None,
            gradient_accumulation_steps=None,
            max_tokens_per_micro_batch=micro_batch_tokens(cfg, t.max_tokens_per_gpu),
        )
    else:
        accum = t.batch_size // max(t.micro_batch_size * ws, 1)
        out.update(micro_batches_per_step=accum * ws, gradient_accumulation_steps=accum)
    if cfg.trainer == "ppo":
        ro = cfg.rollout
        samples = ro.batch_size * ro.n_samples_per_prompt
        out.update(
            prompts_per_rollout=ro.batch_size,
            samples_per_rollout=samples,
            optimizer_steps_per_rollout=samples // max(t.batch_size, 1) * t.max_epochs,
        )
    return out


def format_config(cfg: CommandConfig, derived: dict[str, Any] | None = None) -> str:
    """Readable multi-line summary: every flag grouped by section (`*` marks values changed from the
    trainer default, `(reason)` on values resolved at start-up: hardware defaults, and auto values such
    as `--actor.loss_agg` resolved by validation), then the derived sizes."""
    changed = changed_values(cfg)
    resolved = resolved_values(cfg)
    groups: dict[str, list[str]] = {}
    for spec in flag_specs(type(cfg)):
        value = get_path(cfg, spec.path)
        mark = "*" if spec.path in changed and spec.path not in resolved else " "
        note = ""
        if spec.path in resolved:
            asked, _, why = resolved[spec.path]
            note = f"  ({why})" if asked is None else f"  (asked {format_value(asked)}; {why})"
            if asked is not None:
                mark = "*"
        shown = format_value(value) if value not in (None, "") else repr(value)
        name = spec.path[len(spec.section) + 1 :] if spec.section else spec.path
        groups.setdefault(spec.section, []).append(f" {mark} {name} = {shown}{note}")
    lines = [f"posttrain {cfg.trainer} configuration (* = set, differs from the default)"]
    for section_name, entries in groups.items():
        lines.append(f"[{section_name or 'top-level'}]")
        lines.extend(entries)
    if derived:
        lines.append("[derived sizes]")
        lines.extend(f"   {k} = {v}" for k, v in derived.items())
    return "\n".join(lines)


ECHO_LINES = 40  # the start-up echo fits one screen


def format_set_flags(cfg: CommandConfig, derived: dict[str, Any] | None = None,
                     full: str = "config.yaml") -> str:
    """The start-up echo: the flags the user set, each with its value and where it came from (command line,
    `--config` file, TRL config translation; a value start-up changed says so), at most one screen of them;
    the derived sizes on one line; last, where the full configuration is (`full`). A config built in code
    (not parsed) lists the flags that differ from the defaults instead."""
    sources = flag_sources(cfg) if cfg.flag_sources is not None else \
        dict.fromkeys(changed_values(cfg), "differs from the default")
    resolved = resolved_values(cfg)
    lines = []
    for path, source in sources.items():
        note = ""
        if path in resolved and resolved[path][0] is not None:
            note = f"; asked {format_value(resolved[path][0])}: {resolved[path][2]}"
        value = get_path(cfg, path)
        shown = format_value(value) if value not in (None, "") else repr(value)
        lines.append(f"  --{path} {shown}  ({source}{note})")
    if len(lines) > ECHO_LINES:
        lines[ECHO_LINES - 1:] = [f"  ... and {len(lines) - ECHO_LINES + 1} more"]
    head = f"posttrain {cfg.trainer}: {len(sources)} flag(s) set" + (":" if sources else ", all defaults")
    tail = []
    if derived:
        tail.append("derived sizes: " + ", ".join(f"{k} = {v}" for k, v in derived.items()))
    tail.append(f"every flag's value: {full}")
    return "\n".join([head, *lines, *tail])
