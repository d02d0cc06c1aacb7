"""VLLMRolloutEngine with images, without vLLM (the stand-in `vllm` module of test_rollout_vllm.py): the
prompts vLLM gets hold each run of image (and video) pad tokens collapsed to one token plus the raw images
(`multi_modal_data`), the outputs keep the caller's expanded ids, `limit_mm_per_prompt` reaches `vllm.LLM`
(from --data.max_images_per_prompt in the Ray engine worker), text-only prompts are unchanged, and what cannot
be sent is refused. Also: the HF engine and the single-turn sampler take the same `PromptImages` entries."""
import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.rollout import SamplingParams
from posttrain.rollout.types import PromptImages
from posttrain.rollout.vllm_engine import VLLMRolloutEngine, collapse_pad_runs, vision_pad_token_ids
from tests.rollout.test_rollout_vllm import FakeLLM, install_fake_vllm

IMG, VID, START, END = 900, 901, 902, 903  # the pad ids the fake tests use (image, video, vision start / end)


@pytest.fixture
def fake_vllm(monkeypatch):
    return install_fake_vllm(monkeypatch)


def pil(seed: int, size: int = 28) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def entry(*images) -> PromptImages:
    return PromptImages({"pixel_values": np.zeros((4, 8), np.float32)}, list(images))


def test_collapse_pad_runs():
    ids = [1, START, IMG, IMG, IMG, END, IMG, 5, START, VID, VID, END, START, IMG, END]
    assert collapse_pad_runs(ids, (IMG, VID)) == [1, START, IMG, END, IMG, 5, START, VID, END, START, IMG,
                                                  END]
    assert collapse_pad_runs([7, 7, 7, IMG], (IMG, None)) == [7, 7, 7, IMG]  # only pad ids collapse
    assert collapse_pad_runs([], (IMG,)) == []
    assert vision_pad_token_ids({"image_token_id": 3, "video_token_id": 4}) == (3, 4)
    assert vision_pad_token_ids({"image_token_index": 9}) == (9, None)  # LLaVA / Gemma 3 naming
    assert vision_pad_token_ids({}) == (None, None)


def test_collapsed_ids_and_raw_images_reach_vllm_and_the_outputs_keep_the_expanded_ids(fake_vllm):
    engine = VLLMRolloutEngine("/models/vlm", limit_mm_per_prompt={"image": 2}, image_token_id=IMG,
                               video_token_id=VID)
    assert engine.llm.init["limit_mm_per_prompt"] == {"image": 2}
    one = [1, START] + [IMG] * 4 + [END, 5, 6]
    two = [1, START] + [IMG] * 2 + [END, START] + [IMG] * 3 + [END, 7]
    text = [3, IMG, IMG, 4]  # a text-only prompt is sent as it is
    a, b, c = pil(0), pil(1), pil(2)
    params = SamplingParams(n=2, max_new_tokens=4, seed=1)
    out = engine.generate([one, two, text], params, images=[entry(a), entry(b, c), None])
    assert engine.llm.prompts == [
        {"prompt_token_ids": [1, START, IMG, END, 5, 6], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": [1, START, IMG, END, START, IMG, END, 7], "multi_modal_data": {"image": [b, c]}},
        {"prompt_token_ids": text}]
    assert engine.llm.prompts[1]["multi_modal_data"]["image"][1] is c  # the images themselves, in order
    assert [[o.prompt_token_ids for o in group] for group in out] == [[one] * 2, [two] * 2, [text] * 2]
    assert all(len(o.output_token_ids) == len(o.logprobs) == 2 for group in out for o in group)

    # the same engine without images: every prompt unchanged (also through generate_all's `images=None`)
    from posttrain.rollout.async_engine import generate_all

    generate_all(engine, [one, text], params)
    assert engine.llm.prompts[-2:] == [{"prompt_token_ids": one}, {"prompt_token_ids": text}]
    # a text model's engine: no limit_mm_per_prompt for vLLM, text prompts as before
    plain = VLLMRolloutEngine("/models/text", limit_mm_per_prompt={"image": 0})
    assert "limit_mm_per_prompt" not in plain.llm.init and plain.image_token_id is None
    plain.generate([[1, 2]], SamplingParams())
    assert plain.llm.prompts == [{"prompt_token_ids": [1, 2]}]


def test_video_pad_runs_collapse_too(fake_vllm):
    engine = VLLMRolloutEngine(FakeLLM(), limit_mm_per_prompt={"image": 1}, image_token_id=IMG,
                               video_token_id=VID)
    ids = [START, VID, VID, VID, END, START, IMG, IMG, END, 4]
    image = pil(3)
    out = engine.generate([ids], SamplingParams(), images=[entry(image)])
    assert engine.llm.prompts == [{"prompt_token_ids": [START, VID, END, START, IMG, END, 4],
                                   "multi_modal_data": {"image": [image]}}]
    assert out[0][0].prompt_token_ids == ids


def test_refusals(fake_vllm):
    ids = [1, START, IMG, IMG, END]
    params = SamplingParams()
    no_limit = VLLMRolloutEngine("/models/vlm", image_token_id=IMG)
    assert "limit_mm_per_prompt" not in no_limit.llm.init
    with pytest.raises(ValueError, match=r"images\[0\]: this vLLM engine was built without an image limit.*"
                                         r"limit_mm_per_prompt=\{'image': N\}.*--data.max_images_per_prompt"):
        no_limit.generate([ids], params, images=[entry(pil(0))])
    no_limit.generate([ids], params, images=[None])  # no image at all: nothing to refuse

    engine = VLLMRolloutEngine("/models/vlm", limit_mm_per_prompt={"image": 1}, image_token_id=IMG,
                               video_token_id=VID)
    with pytest.raises(ValueError, match=r"needs the prompt's raw images \(PIL\).*PromptImages\(tensors, "
                                         r"pil\)"):
        # tensors alone: the HF input
        engine.generate([ids], params, images=[{"pixel_values": np.zeros((4, 8))}])
    with pytest.raises(ValueError, match="raw images"):
        engine.generate([ids], params, images=[PromptImages({"pixel_values": np.zeros((4, 8))}, None)])
    with pytest.raises(ValueError, match=r"2 images, more than the engine's limit_mm_per_prompt image=1"):
        engine.generate([ids], params, images=[entry(pil(0), pil(1))])
    with pytest.raises(ValueError, match=r"holds 0 run\(s\) of image tokens \(900\) for 1 image"):
        engine.generate([[1, 2, 3]], params, images=[entry(pil(0))])
    with pytest.raises(ValueError, match="images has 1 entries for 2 prompts"):
        engine.generate([ids, ids], params, images=[entry(pil(0))])
    unknown = VLLMRolloutEngine(FakeLLM(), limit_mm_per_prompt={"image": 1})  # no config to read the ids from
    with pytest.raises(ValueError, match="image token id is unknown.*image_token_id="):
        unknown.generate([ids], params, images=[entry(pil(0))])
    with pytest.raises(ValueError, match="limits must be integers >= 0"):
        VLLMRolloutEngine(FakeLLM(), limit_mm_per_prompt={"image": -1})
    assert engine.llm.prompts == [] and unknown.llm.prompts == []  # nothing was sent


def test_a_real_processor_prompt_and_the_pad_ids_from_the_model_config(fake_vllm, tiny_vision_dir):
    """The tiny Qwen2.5-VL: the engine reads `image_token_id` / `video_token_id` from the folder's config; a
    prompt the processor expanded (`encode_with_images`) reaches vLLM with one `<|image_pad|>` per image."""
    from transformers import AutoConfig

    from posttrain.data.vision_samples import encode_with_images
    from posttrain.models.vision import load_processor

    config = AutoConfig.from_pretrained(tiny_vision_dir)
    engine = VLLMRolloutEngine(tiny_vision_dir, limit_mm_per_prompt={"image": 2})
    assert (engine.image_token_id, engine.video_token_id) == (config.image_token_id, config.video_token_id)
    processor = load_processor(tiny_vision_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = pil(4, 56)
    ids, tensors = encode_with_images(processor, text, [image])
    expanded = ids.count(config.image_token_id)
    assert expanded > 1
    out = engine.generate([ids], SamplingParams(n=1), images=[PromptImages(tensors, [image])])
    sent = engine.llm.prompts[0]
    assert sent["multi_modal_data"] == {"image": [image]}
    assert sent["prompt_token_ids"].count(config.image_token_id) == 1
    assert len(sent["prompt_token_ids"]) == len(ids) - expanded + 1
    start = sent["prompt_token_ids"].index(config.image_token_id)
    assert sent["prompt_token_ids"][start - 1:start + 2] == [config.vision_start_token_id,
                                                             config.image_token_id,
                                                             config.vision_end_token_id]
    assert out[0][0].prompt_token_ids == ids


def test_the_engine_worker_passes_max_images_per_prompt(fake_vllm, monkeypatch, tiny_vision_dir,
                                                        tiny_model_dir):
    """The Ray rollout-engine process builds vLLM with `limit_mm_per_prompt={"image": N}` from
    --data.max_images_per_prompt N (none for a text run) and reads the pad ids from the model's config."""
    from transformers import AutoConfig

    from posttrain.config import backends, parse_config
    from posttrain.trainers.rl.placement.workers import EngineWorker

    monkeypatch.setattr(backends, "vllm_unavailable", lambda: None)
    monkeypatch.setattr(backends, "vision_without_torchvision", lambda path: None)  # as on a GPU setup

    def worker(model, *extra):
        argv = ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", "x",
                "--vllm.num_engines", "1", "--data.max_len", "96", *extra]
        w = EngineWorker(1, {})
        w.setup(parse_config("ppo", argv, check=False))
        assert w.backend_name()[0] == "vllm"
        return w.engine

    vlm = worker(tiny_vision_dir, "--data.max_images_per_prompt", "2")
    assert vlm.llm.init["limit_mm_per_prompt"] == {"image": 2} and vlm.max_images == 2
    assert vlm.image_token_id == AutoConfig.from_pretrained(tiny_vision_dir).image_token_id
    text = worker(tiny_model_dir)
    assert "limit_mm_per_prompt" not in text.llm.init and text.image_token_id is None


def test_the_hf_engine_takes_prompt_images_as_its_tensors(tiny_vision_dir, one_torch_thread):
    """`images` entries as `PromptImages` (what the single-turn sampler passes every engine) sample exactly
    what the bare tensors do on the HF engine."""
    from posttrain.data.vision_samples import encode_with_images
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.models.vision import load_processor
    from posttrain.rollout import HFRolloutEngine

    tok = load_tokenizer(tiny_vision_dir)
    model = load_causal_lm(tiny_vision_dir, dtype="fp32").eval()
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    processor = load_processor(tiny_vision_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = pil(5, 56)
    ids, tensors = encode_with_images(processor, text, [image])
    params = SamplingParams(n=2, max_new_tokens=4, seed=7)
    bare = engine.generate([ids], params, images=[tensors])
    entries = engine.generate([ids], params, images=[PromptImages(tensors, [image])])
    assert [o.output_token_ids for o in bare[0]] == [o.output_token_ids for o in entries[0]]
    assert [o.logprobs for o in bare[0]] == [o.logprobs for o in entries[0]]


def test_the_single_turn_sampler_gives_engines_tensors_and_raw_images():
    """The sampler passes each prompt's `PromptImages(image_inputs, images)`; its rollouts
    keep the tensors."""
    from posttrain.data import Prompt
    from posttrain.rewards import RewardResult
    from posttrain.rollout.single_turn import SingleTurnSampler
    from posttrain.rollout.types import RolloutOutput

    seen = []

    class Engine:
        def generate(self, prompt_token_ids, params, max_new_tokens=None, seeds=None, images=None):
            seen.append(images)
            return [[RolloutOutput(list(p), [4], [-0.5], "stop")] for p in prompt_token_ids]

    class Zero:
        def score_tokens(self, sequences):
            return RewardResult(torch.zeros(len(sequences)))

    class Tok:
        def decode(self, ids, skip_special_tokens=False):
            return " ".join(map(str, ids))

    tensors, image = {"pixel_values": np.ones((4, 8), np.float32)}, pil(6)
    prompts = [Prompt("with", [1, IMG, IMG, 2], None, "", image_inputs=tensors, images=[image]),
               Prompt("text", [3], None, "")]
    scored = SingleTurnSampler(Engine(), Zero(), Tok()).run(prompts, SamplingParams(n=1))
    assert seen == [[PromptImages(tensors, [image]), None]]
    assert seen[0][0].tensors is tensors and seen[0][0].pil[0] is image
    assert scored.rollouts[0].image_inputs is tensors and scored.rollouts[1].image_inputs is None
