"""Data layer: loading and mixing datasets, templates, SFT tokenisation, collators, token-budget
batching, and the synthetic arithmetic task. Imports nothing from other posttrain layers.

The names below are imported on first use (`__getattr__`): importing one light module of this package
does not import the heavy ones (torch, transformers), so a user's mistake is reported before they load."""
from __future__ import annotations

from posttrain.utils.lazy_names import lazy_names

_WHERE = {  # name -> the module of this package that defines it
    "oversized_indices": "token_budget", "token_budget_batches": "token_budget", "pack_collate": "collate",
    "pad_collate": "collate", "DataError": "errors", "where": "errors", "load_rows": "rows",
    "mix_rows": "mixing", "mixing_weights": "mixing", "PreferenceDataset": "preference_dataset",
    "pair_sides": "preference_dataset", "Prompt": "prompts", "PromptDataset": "prompts", "Row": "readers",
    "read_file": "readers", "SFTDataset": "sft_dataset", "load_source": "sources",
    "extract_answer": "synthetic", "is_correct": "synthetic", "make_arithmetic_rows": "synthetic",
    "make_preference_rows": "synthetic", "rounded": "synthetic", "write_jsonl": "synthetic",
    "check_input_template": "templates", "format_prompt": "templates", "render_chat": "templates",
    "set_chat_template": "templates", "to_messages": "templates", "ensure_location": "validation",
    "require_messages": "validation", "require_text": "validation", "require_text_or_messages": "validation",
}
__all__ = sorted(_WHERE)


__getattr__ = lazy_names(__name__, _WHERE)
