"""The `data` section of each trainer: what rows are read and how they are tokenised (`DataConfig` and a
subclass per data layout: SFT, preference pairs, unpaired rows, step-labelled rows, PPO prompts), and the
image limits of the trainers that read images. Conventions as in `config/sections.py`."""

from __future__ import annotations

from dataclasses import dataclass

from posttrain.config.facts import Inert, needs
from posttrain.config.spec import opt

PRM_RAW_TEXT = Inert("posttrain prm tokenises each row's text as it is, as OpenRLHF's train_prm (put the "
                     "prompt's format in the data)", None, ("prm",))


@dataclass
class DataConfig:
    """Dataset loading and tokenisation."""

    max_len: int = opt(2048, "max tokens per sample (prompt + response)", gt=0)
    max_samples: int = opt(1000000, "max training samples", gt=0, on_resume="adjustable")
    input_template: str | None = opt(
        None, "plain-text prompt template containing {} (without a chat template)",
        check=lambda v: "{}" in v, message="must contain {} where the prompt goes", inert=PRM_RAW_TEXT,
    )
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template",
                                    inert=PRM_RAW_TEXT)
    tokenizer_chat_template: str | None = opt(None, "override the tokenizer's chat template")
    disable_fast_tokenizer: bool = opt(False, "load the slow (Python) tokenizer")
    max_dropped_frac: float = opt(
        0.1, "stop the run when more than this fraction of the rows is dropped because the prompt alone does "
        "not fit --data.max_len (the drops are always reported)", extension=True, ge=0, le=1,
        on_resume="adjustable")
    dataloader_num_workers: int = opt(
        0, "DataLoader worker processes", ge=0,
        inert=Inert("samples are tokenised once, up front, in the main process (no DataLoader workers)"),
        on_resume="volatile")


@dataclass
class DatasetDataConfig(DataConfig):
    """Dataset loading and tokenisation."""

    dataset: str | None = opt(None, "training dataset path(s) or HF name(s); comma-separate to mix",
                              required="a dataset path or HF name")
    dataset_probs: str | None = opt(None, "mixing probabilities, comma-separated (e.g. 0.3,0.7)")
    dataset_split: str = opt("train", "dataset split to train on")


IMAGE_MAX_BYTES = 64 * 2**20  # the defaults of the image limits (`posttrain.data.images.ImageLimits`)
IMAGE_MAX_PIXELS = 89_478_485  # PIL's own MAX_IMAGE_PIXELS, above which it warns of a decompression bomb
IMAGE_URL_TIMEOUT = 10.0
IMAGES_ON = needs("--data.max_images_per_prompt", lambda c: c.data.max_images_per_prompt > 0)
TEXT_ONLY = Inert("the run is text only (--data.max_images_per_prompt 0)",
                  lambda v, c, dev: c.data.max_images_per_prompt == 0, ("sft", "dpo", "ppo"))


@dataclass
class ImageLimitFields:
    """Bounds on reading one image reference (every trainer that reads images)."""

    max_image_bytes: int = opt(IMAGE_MAX_BYTES, "max bytes of one image (file, download, data: URI or "
                               "bytes), checked while reading", gt=0, extension=True, inert=IMAGES_ON)
    max_image_pixels: int = opt(IMAGE_MAX_PIXELS, "max pixels (width x height) of one image, checked from "
                                "its header before decoding", gt=0, extension=True, inert=IMAGES_ON)
    image_url_timeout: float = opt(IMAGE_URL_TIMEOUT, "seconds one image URL may take, download included",
                                   gt=0, finite=True, note="seconds", extension=True, inert=IMAGES_ON)


@dataclass
class ImageDataFields(ImageLimitFields):
    """Images in the rows, for a vision-language model (`posttrain sft` / `dpo`: beyond OpenRLHF 0.10.2, which
    reads images in `ppo` only; `posttrain rm` refuses them)."""

    image_key: str = opt("images", "JSON key of the images (paths, data: URIs, base64, bytes; "
                                   "vision-language "
                         "models)", extension=True, inert=TEXT_ONLY)
    max_images_per_prompt: int = opt(0, "max images per row (0: text only)", ge=0, extension=True)


@dataclass
class SFTDataConfig(ImageDataFields, DatasetDataConfig):
    """Dataset loading and tokenisation (SFT)."""

    input_key: str = opt("input", "JSON key of the prompt")
    output_key: str | None = opt(None, "JSON key of the target response")
    multiturn: bool = opt(
        False, "train on every assistant turn of chat data (needs --data.apply_chat_template)"
    )


@dataclass
class PreferenceDataConfig(ImageDataFields, DatasetDataConfig):
    """Dataset loading and tokenisation (preference pairs)."""

    prompt_key: str | None = opt(
        None, "JSON key of the shared prompt (none: prompt is part of the responses)"
    )
    chosen_key: str = opt("chosen", "JSON key of the preferred response")
    rejected_key: str = opt("rejected", "JSON key of the dispreferred response")


@dataclass
class UnpairedDataConfig(DatasetDataConfig):
    """Dataset loading and tokenisation (unpaired rows: a prompt, a completion, a true/false label; KTO)."""

    input_key: str | None = opt(None, "JSON key of the prompt (default: 'input', else TRL's 'prompt')")
    output_key: str | None = opt(
        None, "JSON key of the completion (default: TRL's 'completion'; without it and with "
        "--data.apply_chat_template the prompt key holds the conversation ending in the reply)")
    label_key: str = opt("label", "JSON key of the label: true (desirable) or false (undesirable)")


@dataclass
class PRMDataConfig(DatasetDataConfig):
    """Dataset loading and tokenisation (step-labelled rows; posttrain prm): OpenRLHF's text with a
    placeholder after each step and its labels, or TRL's stepwise supervision (prompt, completions,
    labels)."""

    input_key: str | None = opt(None, "JSON key of the text with a placeholder after each step (default: "
                                "'input'; a row without it that has 'completions' is TRL's stepwise layout)")
    label_key: str | None = opt(None, "JSON key of the step labels: label tokens, or probabilities of the "
                                "good one (default: 'label'; TRL's layout: 'labels', true or false)")
    step_separator: str = opt("\n", "text between steps when TRL's layout renders its completions (TRL's "
                              "default); written to prm.json for RL", extension=True)


@dataclass
class PPODataConfig(ImageLimitFields, DataConfig):
    """Prompt dataset loading and tokenisation (PPO)."""

    prompt_dataset: str | None = opt(None, "prompt dataset path(s) or HF name(s); comma-separate to mix",
                                     required="a dataset path or HF name")
    prompt_probs: str | None = opt(None, "mixing probabilities, comma-separated")
    prompt_split: str = opt("train", "dataset split to sample prompts from")
    input_key: str = opt("input", "JSON key of the prompt")
    label_key: str | None = opt(None, "JSON key of the ground-truth label passed to the reward function")
    image_key: str = opt("images", "JSON key of the prompt's images (paths, URLs, data: URIs, base64, bytes; "
                         "vision-language models)", inert=TEXT_ONLY)
    max_images_per_prompt: int = opt(0, "max images per prompt (0: text only)", ge=0)
