"""Sampling from a saved model for `posttrain chat`, `generate` and `eval`: the model (a run folder, an HF
folder or hub id, a LoRA adapter folder merged into its base), the RL rollout engines (HF, or vLLM where
it runs: `--rollout.engine`), the RL prompt loading, the RL reward sources and `SingleTurnSampler`: the
samples, rewards and eval metrics are the ones `posttrain ppo` computes for the same model, prompts and
seed."""
from __future__ import annotations

import functools
import os

import torch

from posttrain.config.backends import vllm_unavailable
from posttrain.config.errors import ConfigError
from posttrain.config.inert import inert_flags
from posttrain.data import PromptDataset, load_rows
from posttrain.data.templates import render_chat
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.models.folders import ADAPTER_CONFIG, adapter_base, check_model_folder, position_limit
from posttrain.rollout import SamplingParams
from posttrain.rollout.engine_builder import make_rollout_engine
from posttrain.rollout.single_turn import SingleTurnSampler
from posttrain.trainers.rl.eval_rollouts import dataset_name, eval_metrics
from posttrain.trainers.session import pick_device
from posttrain.utils.log import info

MATH_GRADER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "rewards", "examples",
                           "math_reward.py")
VLLM_KW = dict(enforce_eager=True, trust_remote_code=False, distributed_executor_backend="uni",
               kv_cache_memory_bytes=256 * 2**20)


def write_jsonl_output(path: str, rows: list[dict]) -> None:
    """`rows` as JSON lines into --output `path` (its folder made); an unwritable path is a `UserError`."""
    import json

    from posttrain.utils.errors import UserError

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(r, default=str) + "\n" for r in rows)
    except OSError as e:
        raise UserError(f"--output {path}: cannot write it ({e.strerror or e}); name a file in a writable "
                        "folder") from None


class Policy:
    """A saved model to sample from: `open` reads its tokenizer (cheap: the data can be checked before the
    weights load), `start` loads the engine. `templated`: the tokenizer has a chat template; `context`: the
    model's position limit (None when its config names none)."""

    def __init__(self, cfg) -> None:
        self.cfg, self.path, self.engine = cfg, cfg.model.model_name_or_path, None
        for text in inert_flags(cfg, "cuda" if torch.cuda.is_available() else "cpu"):
            info(f"note: {text}")
        check_model_folder(self.path)
        self.base = _adapter_base(self.path, cfg.model.base_model)
        if self.base is not None:
            check_model_folder(self.base)
        own = os.path.isfile(os.path.join(os.path.expanduser(self.path), "tokenizer_config.json"))
        tok_path = self.path if own or self.base is None else self.base
        self.tokenizer = load_tokenizer(tok_path, chat_template=cfg.data.tokenizer_chat_template)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        if not self.templated:
            info(f"{self.path}: the tokenizer has no chat template; prompts are the messages' texts, each "
                 "followed by a newline (pass --data.tokenizer_chat_template to use one)")

    @functools.cached_property
    def context(self) -> int | None:
        """The tokens the model attends over (its config's position limit; None: no limit), read when asked
        (chat)."""
        return position_limit(self.base or self.path)

    def start(self, device=None) -> Policy:
        """Load the engine `--rollout.engine` picks (auto: vLLM on a CUDA GPU where it runs and the folder is
        a whole model, else the HF engine; said at start-up). ConfigError for --rollout.engine vllm where vLLM
        cannot run."""
        cfg, tok = self.cfg, self.tokenizer
        kind, why = _engine_kind(cfg.rollout.engine, self.base)
        info(f"engine: {kind} ({why})")
        dtype = cfg.model.param_dtype or ("bf16" if torch.cuda.is_available() else "fp32")
        if kind == "vllm":
            from posttrain.rollout.hf_engine import resolve_eos_ids

            dtypes = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
            self.engine = make_rollout_engine("vllm", self.path, eos_token_ids=resolve_eos_ids(tok),
                                              dtype=dtypes[dtype], seed=cfg.train.seed, **VLLM_KW)
            return self
        model = load_causal_lm(self.base or self.path, dtype=dtype, tokenizer=tok)
        if self.base is not None:
            from peft import PeftModel

            info(f"LoRA adapter {self.path} merged into its base {self.base}")
            model = PeftModel.from_pretrained(model, os.path.expanduser(self.path)).merge_and_unload()
        self.engine = make_rollout_engine("hf", model.to(device or pick_device()).eval(), tok,
                                          pad_token_id=tok.pad_token_id)
        return self

    def render(self, messages: list[dict]) -> str:
        """The chat history as the prompt text of the next reply: the chat template with a generation prompt,
        or, for a tokenizer without one, the messages' contents each followed by a newline."""
        if self.templated:
            return render_chat(self.tokenizer, messages, add_generation_prompt=True)
        return "".join(f"{m['content']}\n" for m in messages)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def _adapter_base(path: str, base: str | None) -> str | None:
    """The base model of a LoRA adapter folder (`base`, else adapter_config.json's), or None when `path` is
    not an adapter folder."""
    folder = os.path.expanduser(path)
    if (not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG))
            or os.path.isfile(os.path.join(folder, "config.json"))):
        return None
    try:
        recorded = base or adapter_base(folder)
    except ValueError as e:
        raise ConfigError(f"--model.model_name_or_path {path}: a LoRA adapter; {e}") from None
    if not recorded:
        raise ConfigError(f"--model.model_name_or_path {path}: a LoRA adapter whose {ADAPTER_CONFIG} names "
                          "no base model; pass it with --model.base_model")
    return recorded


def _engine_kind(asked: str, adapter_base: str | None) -> tuple[str, str]:
    """(engine, why). auto: vLLM on a CUDA GPU where it runs; on a CPU the HF engine, as in a one-process RL
    run (`config.backends.one_process_engine`: vLLM's CPU build was no faster there and pins torch's threads
    for the whole process)."""
    if asked == "hf":
        return "hf", "--rollout.engine hf"
    if asked == "auto" and not torch.cuda.is_available():
        return "hf", ("--rollout.engine auto on a CPU: vLLM's CPU build reached 0.5-1.08x the HF engine's "
                      "tokens/s (bench/RESULTS.md); --rollout.engine vllm runs it")
    adapter = ("a LoRA adapter folder samples on the HF engine (merged into its base; `posttrain lora-merge` "
               "makes a folder vLLM loads)")
    why = vllm_unavailable() or (adapter if adapter_base else None)
    if why and asked == "vllm":
        raise ConfigError(f"--rollout.engine vllm: {why}")
    return ("hf", why) if why else ("vllm", f"--rollout.engine {asked}")


def sampling_params(cfg) -> SamplingParams:
    """--rollout.temperature / top_p / max_new_tokens / n_samples_per_prompt and --train.seed."""
    r = cfg.rollout
    return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                          n=r.n_samples_per_prompt, seed=cfg.train.seed)


def load_prompts(cfg, tokenizer) -> tuple[list[dict], PromptDataset]:
    """The rows of --data.dataset and their prompts, rendered as `posttrain ppo` renders
    --data.prompt_dataset, each with its row's other columns (and chat messages) for a reward file's keyword
    arguments (references to the rows, not copies; only a reward function reads them)."""
    d = cfg.data
    rows = load_rows(d.dataset, None, d.split, cfg.train.seed, d.max_samples)
    prompts = PromptDataset(rows, tokenizer, input_key=d.input_key, label_key=d.label_key,
                            input_template=d.input_template, apply_chat_template=d.apply_chat_template,
                            extra_columns=True)
    return rows, prompts


def load_reward(cfg, tokenizer, device=None, default: str | None = None):
    """The reward source of --reward.remote_url / --reward.model_name_or_path (`default`, a reward file, when
    neither is given), or None."""
    from posttrain.rewards import make_reward_source

    url, model = cfg.reward.remote_url, cfg.reward.model_name_or_path
    if not (url or model or default):
        return None
    if not (url or model):
        info(f"no --reward.remote_url or --reward.model_name_or_path: the math grader {default}")
        url = default
    return make_reward_source(url, model, tokenizer=tokenizer, device=str(device or pick_device()))


class _Unscored:
    """A reward source that scores nothing (generate without a reward): every reward is 0 and not written."""

    def score(self, queries, prompts, labels):
        from posttrain.rewards.result import RewardResult

        return RewardResult(rewards=torch.zeros(len(queries)))


def sample(policy: Policy, prompts, params: SamplingParams, reward=None):
    """`SingleTurnSampler.run` over `prompts`: the ScoredRollouts of n samples per prompt
    (group-contiguous)."""
    sampler = SingleTurnSampler(policy.engine, reward or _Unscored(), policy.tokenizer)
    return sampler.run(list(prompts), params)


def evaluate(policy: Policy, prompts, params: SamplingParams, reward, dataset: str) -> dict[str, float]:
    """pass@1, pass@k (k = params.n > 1) and the mean response length: `posttrain ppo`'s `eval_<name>_*`."""
    return eval_metrics(SingleTurnSampler(policy.engine, reward, policy.tokenizer), prompts, params,
                        dataset_name(dataset))


def prepare(cfg, default_reward: str | None = None):
    """`generate`'s and `eval`'s set-up, cheapest checks first: --output, then every input path and data key
    at once (`inputs.check_sampling_inputs`, as the trainers check theirs: before the model is read),
    then the tokenizer, the data and the reward (before the weights load), then the engine. Returns
    (policy, rows, prompts, reward)."""
    from posttrain.trainers.inputs import check_sampling_inputs

    check_sampling_inputs(cfg)
    policy = Policy(cfg)
    rows, prompts = load_prompts(cfg, policy.tokenizer)
    reward = load_reward(cfg, policy.tokenizer, default=default_reward)
    policy.start()
    return policy, rows, prompts, reward
