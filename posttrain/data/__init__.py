"""Data layer: loading and mixing datasets, templates, SFT tokenisation, collators, token-budget
batching, and the synthetic arithmetic task. Imports nothing from other posttrain layers."""

from .batching import oversized_indices, token_budget_batches
from .collate import pack_collate, pad_collate
from .errors import DataError, where
from .loading import load_rows
from .mixing import mix_rows, mixing_weights
from .preference_dataset import PreferenceDataset, pair_sides
from .prompts import Prompt, PromptDataset
from .readers import Row, read_file
from .sft_dataset import SFTDataset
from .sources import load_source
from .synthetic import (
    extract_answer,
    is_correct,
    make_arithmetic_rows,
    make_preference_rows,
    rounded,
    write_jsonl,
)
from .templates import check_input_template, format_prompt, render_chat, set_chat_template, to_messages
from .validation import ensure_location, require_messages, require_text, require_text_or_messages

__all__ = [
    "DataError",
    "PreferenceDataset",
    "Prompt",
    "PromptDataset",
    "Row",
    "SFTDataset",
    "check_input_template",
    "ensure_location",
    "extract_answer",
    "format_prompt",
    "is_correct",
    "load_rows",
    "load_source",
    "make_arithmetic_rows",
    "make_preference_rows",
    "mix_rows",
    "oversized_indices",
    "pack_collate",
    "pair_sides",
    "pad_collate",
    "mixing_weights",
    "read_file",
    "render_chat",
    "rounded",
    "require_messages",
    "require_text",
    "require_text_or_messages",
    "set_chat_template",
    "to_messages",
    "token_budget_batches",
    "where",
    "write_jsonl",
]
