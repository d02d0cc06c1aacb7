"""A tiny byte-level BPE tokenizer trained here (no download), with ChatML-style chat markers."""

import copy

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "users",
        "ask",
        "what",
        "is",
        "the",
        "sum",
        "of",
        "numbers",
    ]
    lines = []
    for i in range(300):
        a, b = (i * 7) % 100, (i * 13) % 100
        lines.append(f"What is {a} + {b}? The answer is {a + b}.")
        lines.append(" ".join(words[(i + k) % len(words)] for k in range(8)))
        lines.append(f"User: hello {i}\nAssistant: system user assistant")
    return lines


@pytest.fixture(scope="session")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


@pytest.fixture
def tokenizer_eot(tokenizer):
    """Same vocabulary, but EOS is <|endoftext|> (distinct from the chat end-of-turn marker)."""
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = "<|endoftext|>"
    return tok


@pytest.fixture
def tokenizer_bos(tokenizer):
    """Same vocabulary, but encoding adds a BOS (<|endoftext|>) the way Llama-style tokenizers do."""
    from tokenizers import processors

    tok = copy.deepcopy(tokenizer)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        special_tokens=[("<|endoftext|>", tok.convert_tokens_to_ids("<|endoftext|>"))])
    assert tok("hi")["input_ids"][0] == tok.convert_tokens_to_ids("<|endoftext|>")
    return tok
