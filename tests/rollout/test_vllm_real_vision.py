"""A prompt with an image through the real vLLM (`generate(..., images=)`) on the tiny Qwen2.5-VL (`posttrain
init-tiny --vision`): where vLLM can load it (torchvision installed: a GPU setup), it samples with the
log-probs the trainer's forward over the expanded ids gives; where it cannot (vLLM's CPU setup here, which has
no torchvision), building the engine fails with posttrain's one-line message naming the fix."""
import importlib.util

import pytest
import torch

from posttrain.config.backends import vllm_unavailable

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_unavailable() is not None, reason=f"real vLLM: {vllm_unavailable()}")]


@pytest.fixture(scope="module")
def device():
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_without_torchvision_the_engine_says_what_to_do(tiny_vision_dir):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(RuntimeError, match=r"^vLLM cannot load the vision-language model .*"
                                           r"\(Qwen2_5_VLForConditionalGeneration\) without torchvision, .*"
                                           r"--rollout.engine hf$") as err:
        VLLMRolloutEngine(str(tiny_vision_dir), dtype="float32", enforce_eager=True, max_model_len=512,
                          limit_mm_per_prompt={"image": 1}, kv_cache_memory_bytes=64 * 2**20)
    assert "\n" not in str(err.value)


def vision_prompts(vlm_dir):
    """(a prompt with one image: expanded ids, its image tensors, the image; a text-only prompt's ids)."""
    import numpy as np
    from PIL import Image

    from posttrain.data.vision_samples import encode_with_images
    from posttrain.models.vision import load_processor

    processor = load_processor(vlm_dir)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8))
    chat = processor.tokenizer.apply_chat_template
    content = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    with_image = chat([{"role": "user", "content": content}],
                      add_generation_prompt=True, tokenize=False)
    ids, tensors = encode_with_images(processor, with_image, [image])
    text = chat([{"role": "user", "content": [{"type": "text", "text": "No image here."}]}],
                add_generation_prompt=True, tokenize=False)
    return ids, tensors, image, processor.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="vLLM's Qwen2.5-VL needs torchvision")
def test_a_prompt_with_an_image_samples_with_the_trainers_logprobs(tiny_vision_dir, device):
    """vLLM gets the raw image and the collapsed ids (`VLLMRolloutEngine.vllm_prompts`), the outputs keep the
    expanded ids, and the HF forward over the expanded ids + the response with the processor's tensors gives
    vLLM's log-probs (GPU: bf16 on both sides, 1e-2; CPU: fp32, 1e-4). A sample is compared up to its first
    image-structure token, if it sampled one (vLLM does not ban them: the trainer's forward would have no
    image for it)."""
    from transformers import AutoConfig

    from posttrain.data.collate import merge_image_inputs
    from posttrain.models import forward_logits, load_causal_lm
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.types import PromptImages
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    vlm_dir = str(tiny_vision_dir)
    dtype, tol = ("bfloat16", 1e-2) if device.type == "cuda" else ("float32", 1e-4)
    config = AutoConfig.from_pretrained(vlm_dir)
    ids, tensors, image, text_ids = vision_prompts(vlm_dir)
    assert ids.count(config.image_token_id) > 1  # expanded: one token per merged patch block
    engine = VLLMRolloutEngine(vlm_dir, dtype=dtype, gpu_memory_utilization=0.25, enforce_eager=True,
                               max_model_len=512, limit_mm_per_prompt={"image": 1},
                               kv_cache_memory_bytes=64 * 2**20)
    assert engine.image_token_id == config.image_token_id
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=12, seed=3)
    prompts, images = [ids, text_ids], [PromptImages(tensors, [image]), None]
    outs = engine.generate(prompts, params, images=images)
    model = load_causal_lm(vlm_dir, dtype="bf16" if dtype == "bfloat16" else "fp32").to(device).eval()
    structure = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                 config.vision_end_token_id}
    compared = 0
    for group, prompt, entry in zip(outs, prompts, images):
        for o in group:
            assert o.prompt_token_ids == prompt and len(o.logprobs) == len(o.output_token_ids) >= 1
            k = next((i for i, t in enumerate(o.output_token_ids) if t in structure), len(o.output_token_ids))
            if k == 0:
                continue
            seq = torch.tensor([prompt + o.output_token_ids[:k]], device=device)
            batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq),
                     "image_inputs": merge_image_inputs([PromptImages.tensors_of(entry)], device)}
            with torch.no_grad():
                logits = forward_logits(model, batch)[0, len(prompt) - 1:-1] / 0.8
            target = torch.tensor(o.output_token_ids[:k], device=device)
            trainer = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0].tolist()
            assert o.logprobs[:k] == pytest.approx(trainer, abs=tol)
            compared += k
    assert compared >= 12
    again = engine.generate(prompts, params, images=images)  # seeded: the same samples
    assert [o.output_token_ids for g in outs for o in g] == [o.output_token_ids for g in again for o in g]
