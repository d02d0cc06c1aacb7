"""Train the tiny byte-level BPE tokenizer (no download) and wrap it as a HF fast tokenizer.

Byte-level: every UTF-8 byte is a base token, so any text encodes and `decode(encode(s)) == s`.
Digits are split one per token (arithmetic-friendly). Special tokens, in id order:
`<|endoftext|>` (0, pad), `<|im_start|>` (1), `<|im_end|>` (2, eos; ends every chat turn).
"""
from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from posttrain.models.tiny_corpus import tiny_corpus

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

# ChatML: each message is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt
# opens an assistant turn. Plain Jinja (no `{% generation %}` blocks). Tools in the Qwen2.5 / Hermes style
# (only when the request has them; otherwise the rendering is plain ChatML): the tool specs as JSON lines
# in `<tools></tools>` in a system turn (after the first system message's content), an assistant tool call
# as `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (after the content, when any), and
# consecutive tool messages as one user turn of `<tool_response>\n...\n</tool_response>` blocks.
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions. Their signatures are within "
                  "<tools></tools>:\n<tools>")
TOOLS_CLOSING = ("\n</tools>\n\nFor each call, return a JSON object with the function name and arguments "
                 "within <tool_call></tool_call>:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOLS_CLOSING + "<|im_end|>\n") + " }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

def train_tiny_tokenizer(vocab_size: int = 2048, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """BPE with `vocab_size` entries at most (256 bytes + 3 specials + merges) trained on
    `tiny_corpus()`; deterministic. pad = `<|endoftext|>`, eos = `<|im_end|>`, no bos."""
    if not 300 <= vocab_size <= 65536:
        raise ValueError(f"vocab_size={vocab_size}: must be in [300, 65536] (256 bytes + specials + merges)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        extra_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


def portable_tokenizer_class(folder) -> None:
    """Name the class `PreTrainedTokenizerFast` and list `<|im_start|>` under
    `additional_special_tokens`: spellings that transformers 4.x and 5.x both read."""
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if extra:
        cfg["additional_special_tokens"] = list(extra)
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
