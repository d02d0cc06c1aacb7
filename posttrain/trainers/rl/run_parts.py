"""The RL trainer's state, grouped by what it is about (`ppo.RLTrainer` holds one of each):
`PromptData`, the run's prompts and generation budgets (`load_prompt_data`), and `LoopState`, where the
loop stands in the prompts and in the policy versions, with the async producer (`loop_state`)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from posttrain.config import ConfigError, PPOConfig
from posttrain.data import PromptDataset, load_rows
from posttrain.data.capping import capped_note
from posttrain.data.errors import check_dropped
from posttrain.data.images import image_reading
from posttrain.models.vision import export_savers, vision_processor
from posttrain.trainers.rl.async_pipeline import RolloutPipeline
from posttrain.trainers.rl.collect import GroupBuffer, PromptStream
from posttrain.trainers.rl.eval_rollouts import dataset_name
from posttrain.utils.log import info


@dataclass
class PromptData:
    """The run's prompt data: the training prompts; the evaluation prompts and the name their metrics
    carry (None without --eval.dataset); the actor's image processor (None: a text model) and the savers
    an exported policy folder is written with (the tokenizer, and a VLM's image processor); the
    generation budgets (`generation_budgets`)."""
    prompts: PromptDataset
    eval_prompts: PromptDataset | None
    eval_name: str | None
    processor: object | None
    savers: list
    max_new_tokens: int
    sample_max_len: int | None


def load_prompt_data(cfg: PPOConfig, tok, tools=None) -> PromptData:
    """The prompt and evaluation datasets of `cfg`, tokenized by `tok`; prompts longer than
    --data.max_len minus --rollout.max_new_tokens are dropped (`check_dropped` refuses too many). `tools`:
    a tool file's (`agents.tool_env.ToolFile`), whose schemas and system prompt the prompts are rendered
    with."""
    processor = vision_processor(cfg.actor.model_name_or_path, tok)
    savers = export_savers(tok, processor)
    if processor is not None and cfg.ds.shared_prefix:
        info("vision-language actor: padded batches (--ds.shared_prefix off: the model computes its "
             "rotary positions per row from the image grid)")
    kw = dict(input_key=cfg.data.input_key, label_key=cfg.data.label_key,
              input_template=cfg.data.input_template, apply_chat_template=cfg.data.apply_chat_template,
              processor=processor, extra_columns=bool(cfg.reward.func_path
                                                      or str(cfg.reward.remote_url or "").endswith(".py")),
              **image_reading(cfg.data),
              **({"tools": tools.schemas, "system_prompt": tools.system_prompt} if tools else {}))
    rows = load_rows(cfg.data.prompt_dataset, cfg.data.prompt_probs, cfg.data.prompt_split, cfg.train.seed,
                     cfg.data.max_samples)
    limit = cfg.data.max_len - (cfg.rollout.max_new_tokens or 1)
    prompts = PromptDataset(rows, tok, max_prompt_len=limit, **kw)
    report = check_dropped("prompt dataset", prompts.dropped, len(prompts) + len(prompts.dropped),
                           f"the prompt is longer than {limit} tokens (--data.max_len minus "
                           "--rollout.max_new_tokens)", cfg.data.max_dropped_frac)
    if report:
        info(report)
    if prompts.num_capped:
        info(capped_note("prompt dataset", prompts.num_capped, limit, tok, f"{limit} prompt tokens"))
    sample_max_len, max_new_tokens = generation_budgets(cfg, [p.token_ids for p in prompts])
    eval_prompts, eval_name = None, None
    if cfg.eval.dataset:
        eval_rows = load_rows(cfg.eval.dataset, None, cfg.eval.split, cfg.train.seed, cfg.data.max_samples)
        eval_prompts = PromptDataset(eval_rows, tok, max_prompt_len=limit, **kw)
        eval_name = dataset_name(cfg.eval.dataset)
    return PromptData(prompts, eval_prompts, eval_name, processor, savers, max_new_tokens, sample_max_len)


def generation_budgets(cfg: PPOConfig, prompt_ids: list[list[int]]) -> tuple[int | None, int]:
    """(sample_max_len, max_new_tokens). --rollout.max_new_tokens set: that many for every sample
    (sample_max_len None). Unset: each sample may generate `--data.max_len - len(its prompt)` tokens
    (OpenRLHF), passed per sample (sample_max_len = --data.max_len); `max_new_tokens` is then the largest
    budget (the constant of seq_sum_norm), and --reward.overlong_buffer_len must fit the smallest
    (validation compares it with a set budget)."""
    if cfg.rollout.max_new_tokens:
        return None, cfg.rollout.max_new_tokens
    largest = max(1, cfg.data.max_len - min(map(len, prompt_ids)))
    smallest = max(1, cfg.data.max_len - max(map(len, prompt_ids)))
    info(f"--rollout.max_new_tokens unset: each sample may generate --data.max_len - len(its prompt) "
         f"tokens ({smallest} to {largest} here)")
    buffer = cfg.reward.overlong_buffer_len
    if buffer and smallest < buffer:
        raise ConfigError(f"--reward.overlong_buffer_len {buffer:g} is longer than the smallest generation "
                          f"budget ({smallest} tokens: --data.max_len minus the longest prompt, "
                          "--rollout.max_new_tokens unset); lower the buffer or raise the budget")
    return cfg.data.max_len, largest


@dataclass
class LoopState:
    """Where the RL loop stands besides its step count. `stream`: the prompt stream (the next prompt to
    draw); `trained_cursor`: the prompt cursor after the last batch trained (what a checkpoint keeps);
    `oversampled`: the group buffer of --rollout.vllm_generate_batch_size (None: each batch is one draw).
    Async RL (`async_pipeline`): `pipeline`, the producer (None until `before_loop` starts one, and in
    sync runs); `gen_lock`, the lock generation and weight sync share; `policy_version`, the step count
    at the engines' last sync."""
    stream: PromptStream
    oversampled: GroupBuffer | None
    trained_cursor: int = 0
    policy_version: int = 0
    pipeline: RolloutPipeline | None = None
    gen_lock: threading.Lock = field(default_factory=threading.Lock)


def loop_state(cfg: PPOConfig, num_prompts: int) -> LoopState:
    """The state of a fresh run over `num_prompts` prompts (a resume then sets the cursors)."""
    gen = cfg.rollout.vllm_generate_batch_size
    oversampled = (GroupBuffer(cfg.rollout.batch_size, cfg.rollout.n_samples_per_prompt)
                   if gen and gen != cfg.rollout.batch_size else None)
    return LoopState(PromptStream(num_prompts, cfg.train.seed), oversampled)
