"""The vLLM rollout engine on a real GPU: token ids in and out, the processed (temperature-scaled)
log-probs equal the trainer's recomputation, seeds make samples reproducible, a weight sync
changes what the engine samples to exactly the new weights' distribution, and a prompt with an image
(the tiny Qwen2.5-VL) samples with the log-probs the trainer's forward over the expanded ids gives."""
import pytest
import torch

PROMPTS = [[5, 6, 7, 8, 9], [14, 15], [20, 21, 22, 23]]


@pytest.fixture(scope="module")
def engine(gpu_model_dir):
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    return VLLMRolloutEngine(str(gpu_model_dir), dtype="float32",
                             gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=64)


def recomputed(model, prompt, tokens, temperature):
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=ids.device)[:, None])[:, 0].tolist()


def test_logprobs_equal_the_trainers_recomputation(engine, gpu_model_dir, cuda):
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams

    model = load_causal_lm(str(gpu_model_dir), dtype="fp32").to(cuda).eval()
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=12, seed=3)
    outs = engine.generate(PROMPTS, params)
    for group, prompt in zip(outs, PROMPTS):
        for o in group:
            assert o.prompt_token_ids == prompt and len(o.logprobs) == len(o.output_token_ids) >= 1
            assert o.logprobs == pytest.approx(recomputed(model, prompt, o.output_token_ids, 0.8), abs=2e-3)
    again = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for g in outs for o in g] == [o.output_token_ids for g in again for o in g]


def test_a_weight_sync_samples_from_the_new_weights(engine, gpu_model_dir, cuda):
    from posttrain.models import load_causal_lm
    from posttrain.rollout import SamplingParams

    new = load_causal_lm(str(gpu_model_dir), dtype="fp32").to(cuda).eval()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(new)  # bucket-by-bucket through vLLM's load_weights, then the prefix cache reset
    engine.weights_updated(1)
    params = SamplingParams(temperature=1.0, n=1, max_new_tokens=12, seed=5)
    for group, prompt in zip(engine.generate(PROMPTS, params), PROMPTS):
        o = group[0]
        assert o.logprobs == pytest.approx(recomputed(new, prompt, o.output_token_ids, 1.0), abs=2e-3)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    """The tiny Qwen2.5-VL ("nano" language model, `init-tiny --vision`), seed 0."""
    from posttrain.models import build_tiny

    path = tmp_path_factory.mktemp("gpu_vlm") / "qwen2_5_vl-nano"
    build_tiny(str(path), size="nano", seed=0, verbose=False, vision=True)
    return str(path)


def vision_prompts(vlm_dir):
    """(a prompt with one image: expanded ids, its image tensors, the image; a text-only prompt's ids)."""
    import numpy as np
    from PIL import Image

    from posttrain.data.vision_samples import encode_with_images
    from posttrain.models.vision import load_processor

    processor = load_processor(vlm_dir)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8))
    chat = processor.tokenizer.apply_chat_template
    with_image = chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}],
                      add_generation_prompt=True, tokenize=False)
    ids, tensors = encode_with_images(processor, with_image, [image])
    text = chat([{"role": "user", "content": [{"type": "text", "text": "No image here."}]}],
                add_generation_prompt=True, tokenize=False)
    return ids, tensors, image, processor.tokenizer.encode(text, add_special_tokens=False)


def test_a_prompt_with_an_image_samples_with_the_trainers_logprobs(vlm_dir, cuda):
    """vLLM gets the raw image and the collapsed ids (`VLLMRolloutEngine.vllm_prompts`), the outputs keep the
    expanded ids, and the HF forward over the expanded ids + the response with the processor's tensors gives
    vLLM's log-probs (bf16 on both sides: 1e-2). A sample is compared up to its first image-structure token, if
    it sampled one (vLLM does not ban them: the trainer's forward would have no image for it)."""
    from transformers import AutoConfig

    from posttrain.data.collate import merge_image_inputs
    from posttrain.models import forward_logits, load_causal_lm
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.types import PromptImages
    from posttrain.rollout.vllm_engine import VLLMRolloutEngine

    config = AutoConfig.from_pretrained(vlm_dir)
    ids, tensors, image, text_ids = vision_prompts(vlm_dir)
    assert ids.count(config.image_token_id) > 1  # expanded: one token per merged patch block
    engine = VLLMRolloutEngine(vlm_dir, dtype="bfloat16", gpu_memory_utilization=0.25, enforce_eager=True,
                               max_model_len=512, limit_mm_per_prompt={"image": 1})
    assert engine.image_token_id == config.image_token_id
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=12, seed=3)
    prompts, images = [ids, text_ids], [PromptImages(tensors, [image]), None]
    outs = engine.generate(prompts, params, images=images)
    model = load_causal_lm(vlm_dir, dtype="bf16").to(cuda).eval()
    structure = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                 config.vision_end_token_id}
    compared = 0
    for group, prompt, entry in zip(outs, prompts, images):
        for o in group:
            assert o.prompt_token_ids == prompt and len(o.logprobs) == len(o.output_token_ids) >= 1
            k = next((i for i, t in enumerate(o.output_token_ids) if t in structure), len(o.output_token_ids))
            if k == 0:
                continue
            seq = torch.tensor([prompt + o.output_token_ids[:k]], device=cuda)
            batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq),
                     "image_inputs": merge_image_inputs([PromptImages.tensors_of(entry)], cuda)}
            with torch.no_grad():
                logits = forward_logits(model, batch)[0, len(prompt) - 1:-1] / 0.8
            target = torch.tensor(o.output_token_ids[:k], device=cuda)
            trainer = torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0].tolist()
            assert o.logprobs[:k] == pytest.approx(trainer, abs=1e-2)
            compared += k
    assert compared >= 12
    again = engine.generate(prompts, params, images=images)  # seeded: the same samples
    assert [o.output_token_ids for g in outs for o in g] == [o.output_token_ids for g in again for o in g]
