"""The configs of `posttrain chat`, `posttrain generate` and `posttrain eval`: sampling from a saved model
(a run folder, an HF model folder or a LoRA adapter folder). Flags carry the trainers' names
(`--model.model_name_or_path`, `--data.*`, `--rollout.*`, `--reward.*`, `--train.seed`) and are read by
the same dotted-flag parser (help, `--config run.yaml`, typo hints, one-line errors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from posttrain.config.facts import Inert
from posttrain.config.sections import PARAM_DTYPES
from posttrain.config.spec import ParsedFields, opt, section

ENGINES = ("auto", "vllm", "hf")
POST_PROCESSORS = ("rs", "iter_dpo")  # OpenRLHF 0.9's batch_inference names (its csft is not built)
NO_REWARD = Inert("no --reward.remote_url or --reward.model_name_or_path: nothing scores the samples",
                  lambda v, c, dev: not (c.reward.remote_url or c.reward.model_name_or_path))


@dataclass
class InferModelConfig:
    """The model to sample from."""

    model_name_or_path: str | None = opt(None, "a run folder, HF model folder or hub id, or a LoRA adapter "
                                         "folder", required="the model to sample from")
    base_model: str | None = opt(None, "a LoRA adapter's base model; unset: the base_model_name_or_path "
                                 "of its adapter_config.json", extension=True)
    param_dtype: str | None = opt(None, "weights dtype; default auto: bf16 on GPU, fp32 on CPU",
                                  choices=PARAM_DTYPES, extension=True)


@dataclass
class InferRolloutConfig:
    """Sampling (the trainers' --rollout.* names)."""

    temperature: float = opt(1.0, "sampling temperature; 0: greedy", ge=0)
    top_p: float = opt(1.0, "nucleus sampling threshold", gt=0, le=1)
    max_new_tokens: int = opt(256, "max generated tokens per sample", ge=1)
    n_samples_per_prompt: int = opt(1, "samples per prompt", ge=1,
                                    inert=Inert("chat samples one reply per message", None, ("chat",)))
    engine: str = opt("auto", "auto (vLLM on a CUDA GPU where it is installed, else the HF engine), vllm "
                      "(also vLLM's CPU build) or hf", choices=ENGINES, extension=True)


@dataclass
class InferTrainConfig:
    """The seed (the trainers' --train.seed)."""

    seed: int = opt(42, "sampling seed: the same seed, model and prompts give the same samples", ge=0)


@dataclass
class InferChatDataConfig:
    """The chat template."""

    tokenizer_chat_template: str | None = opt(None, "override the tokenizer's chat template (Jinja text or a "
                                              "file)")


@dataclass
class InferDataConfig(InferChatDataConfig):
    """The prompt dataset (as `posttrain ppo`'s --data.prompt_dataset)."""

    dataset: str | None = opt(None, "prompt dataset: a .jsonl/.json/.parquet file, a folder or an HF name",
                              required="the prompts to sample")
    input_key: str = opt("input", "JSON key of the prompt (text or chat messages)")
    label_key: str | None = opt(None, "JSON key of the label passed to the reward function")
    apply_chat_template: bool = opt(False, "render the prompt with the tokenizer's chat template")
    input_template: str | None = opt(None, "a template with one {} for the prompt (without "
                                     "--data.apply_chat_template)")
    split: str = opt("train", "dataset split")
    max_samples: int = opt(100000000, "use at most this many prompts", gt=0)


@dataclass
class InferRewardConfig:
    """Scoring the samples: a reward_func .py file, a reward server URL or a reward model."""

    remote_url: str | None = opt(None, "a .py file defining reward_func, or an http(s):// reward server")
    model_name_or_path: str | None = opt(None, "a reward model folder (a score head)")


@dataclass
class ChatConfig(ParsedFields):
    """posttrain chat: talk to a model on the terminal (history kept, chat template applied; /reset clears the
    history, Ctrl-D or Ctrl-C ends)."""

    trainer: ClassVar[str] = "chat"
    model: InferModelConfig = section(InferModelConfig)
    data: InferChatDataConfig = section(InferChatDataConfig)
    rollout: InferRolloutConfig = section(InferRolloutConfig)
    train: InferTrainConfig = section(InferTrainConfig)


@dataclass
class GenerateConfig(ParsedFields):
    """posttrain generate: sample every prompt of a dataset n times into a JSONL file, optionally scored by a
    reward and reduced to the best sample per prompt or best/worst pairs (rejection sampling / iterative DPO
    data)."""

    trainer: ClassVar[str] = "generate"
    model: InferModelConfig = section(InferModelConfig)
    data: InferDataConfig = section(InferDataConfig)
    rollout: InferRolloutConfig = section(InferRolloutConfig)
    train: InferTrainConfig = section(InferTrainConfig)
    reward: InferRewardConfig = section(InferRewardConfig)
    output: str | None = opt(None, "the JSONL file to write: one row per sample",
                             required="where the samples go")
    post_processor: str | None = opt(
        None, "needs a reward: rs (rejection sampling: each prompt's best sample) or iter_dpo (iterative "
        "DPO: each prompt's best and worst samples as one chosen/rejected pair; none when all tie)",
        choices=POST_PROCESSORS, extension=True, inert=NO_REWARD)


@dataclass
class EvalCmdConfig(ParsedFields):
    """posttrain eval: pass@k and mean reward of a model on a labelled dataset, the numbers --eval.dataset
    logs during `posttrain ppo`."""

    trainer: ClassVar[str] = "eval"
    model: InferModelConfig = section(InferModelConfig)
    data: InferDataConfig = section(InferDataConfig, label_key="label")
    rollout: InferRolloutConfig = section(InferRolloutConfig, temperature=0.6, n_samples_per_prompt=4)
    train: InferTrainConfig = section(InferTrainConfig)
    reward: InferRewardConfig = section(InferRewardConfig)
    output: str | None = opt(None, "also write the metrics to this JSON file", extension=True)


INFERENCE_CONFIGS: dict[str, type] = {"chat": ChatConfig, "generate": GenerateConfig, "eval": EvalCmdConfig}
