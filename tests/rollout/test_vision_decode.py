"""The HF engine's generation for a vision-language model (`rollout/vision_decode.py`): seeded samples do
not depend on the batch they share, text-only rows decode too, and the image-structure tokens are never
sampled, even where the model would put all its mass on them (the log-probs stay those of the full
distribution, as the trainer recomputes them)."""
import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.data.vision_samples import encode_with_images
from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.rollout.types import PromptImages
from posttrain.rollout.vision_decode import structure_token_ids

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


@pytest.fixture(scope="module")
def vlm(tiny_vision_dir):
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.vision import load_processor

    tok = load_tokenizer(tiny_vision_dir)
    processor = load_processor(tiny_vision_dir, tok)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (56, 56, 3), dtype=np.uint8))
    ids, tensors = encode_with_images(processor, text, [image])
    return load_causal_lm(tiny_vision_dir, "fp32"), tok, ids, tensors


def test_a_prompts_samples_do_not_depend_on_its_batch(vlm):
    model, tok, ids, tensors = vlm
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    params = SamplingParams(max_new_tokens=5, n=2, seed=7)
    alone = engine.generate([ids], params, seeds=[11], images=[tensors])[0]
    text_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)
    both = engine.generate([text_ids, ids], params, seeds=[5, 11], images=[None, PromptImages(tensors)])
    assert [o.output_token_ids for o in both[1]] == [o.output_token_ids for o in alone]
    np.testing.assert_allclose([o.logprobs for o in both[1]], [o.logprobs for o in alone], atol=1e-5)
    assert all(len(o.output_token_ids) >= 1 for o in both[0])  # the text-only row decodes beside it


def test_the_image_structure_tokens_are_never_sampled(vlm):
    model, tok, ids, tensors = vlm
    cfg = model.config
    never = structure_token_ids(model)
    assert set(never) == {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                          cfg.vision_end_token_id}
    bias = torch.zeros(cfg.text_config.vocab_size if hasattr(cfg, "text_config") else cfg.vocab_size)
    bias[cfg.image_token_id] = 30.0  # the model now wants an image token next, almost surely
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    try:
        engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
        outs = engine.generate([ids], SamplingParams(max_new_tokens=6, n=4, seed=1), images=[tensors])[0]
    finally:
        handle.remove()
    for out in outs:
        assert not set(out.output_token_ids) & set(never)
        assert max(out.logprobs) < -10  # the full distribution's log-probs: the banned token holds the mass


def test_images_for_a_text_model_are_refused(tiny_model_dir):
    from posttrain.models import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    engine = HFRolloutEngine(load_causal_lm(tiny_model_dir, "fp32"), tok, pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="not a vision-language model"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2),
                        images=[{"pixel_values": np.zeros((4, 8))}])
