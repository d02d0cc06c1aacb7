"""Vision-language models: `init-tiny --vision` builds a Qwen2.5-VL that loads as one (model and processor,
without torchvision), the processor's expansion of image placeholders is the model's, images reach the
logits, and `freeze_visual_encoder` freezes exactly the vision tower."""
import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.data.collate import merge_image_inputs
from posttrain.data.vision_samples import encode_with_images, image_placeholder
from posttrain.models import forward_logits, load_causal_lm, model_inputs
from posttrain.models.vision import (
    freeze_visual_encoder,
    image_token_types,
    is_vision_folder,
    is_vision_model,
    load_processor,
)

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]


def _image(seed: int, side: int = 56) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vlm(tiny_vision_dir):
    processor = load_processor(tiny_vision_dir)
    text = processor.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return load_causal_lm(tiny_vision_dir, "fp32"), processor, text


def test_the_tiny_vlm_loads_as_a_vision_language_model(tiny_vision_dir, tiny_model_dir, vlm):
    model, processor, _ = vlm
    assert is_vision_folder(tiny_vision_dir) and not is_vision_folder(tiny_model_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and is_vision_model(model)
    assert not is_vision_model(load_causal_lm(tiny_model_dir, "fp32"))
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and processor.image_processor is not None
    assert image_placeholder(processor) == "<|image_pad|>"


def test_placeholders_expand_to_one_token_per_merged_patch_block(vlm):
    model, processor, text = vlm
    ids, images = encode_with_images(processor, text, [_image(0, 56)])
    grid = images["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # 56 px / 14 px patches
    image_id = model.config.image_token_id
    assert ids.count(image_id) == int(grid.prod()) // processor.image_processor.merge_size ** 2 == 4
    assert images["pixel_values"].shape[0] == int(grid.prod())  # one row per patch
    ids2, images2 = encode_with_images(processor, text, [_image(2, 112)])
    assert ids2.count(image_id) == 16 and images2["image_grid_thw"].tolist() == [[1, 8, 8]]


def test_our_inputs_give_the_logits_of_the_processors_own_and_the_image_matters(vlm):
    model, processor, text = vlm
    ids, images = encode_with_images(processor, text, [_image(0)])
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
             "image_inputs": merge_image_inputs([images])}
    with torch.no_grad():
        ours = forward_logits(model, batch)
        own = model(**processor(text=[text], images=[_image(0)], return_tensors="pt",
                                add_special_tokens=False)).logits
        other = forward_logits(model, {**batch, "image_inputs": merge_image_inputs([encode_with_images(
            processor, text, [_image(5)])[1]])})
    torch.testing.assert_close(ours, own.float(), rtol=0, atol=1e-6)
    image_end = max(i for i, t in enumerate(ids) if t == model.config.image_token_id)
    assert torch.equal(ours[:, :image_end - 3], other[:, :image_end - 3])  # before the image: text alone
    assert (ours[:, image_end:] - other[:, image_end:]).abs().max() > 1e-3  # after it: the image is seen


def test_padded_rows_with_images_equal_each_row_alone(vlm):
    model, processor, text = vlm
    short, long_text = text, text.replace("What colour?", "What colour is the shape in this picture?")
    rows = [encode_with_images(processor, t, [_image(i)]) for i, t in enumerate((short, long_text))]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for b, (row, _) in enumerate(rows):
        ids[b, :len(row)] = torch.tensor(row)
        mask[b, :len(row)] = 1
    with torch.no_grad():
        both = forward_logits(model, {"input_ids": ids, "attention_mask": mask,
                                      "image_inputs": merge_image_inputs([im for _, im in rows])})
        for b, (row, images) in enumerate(rows):
            alone = forward_logits(model, {"input_ids": torch.tensor([row]),
                                           "image_inputs": merge_image_inputs([images])})
            torch.testing.assert_close(both[b, :len(row)], alone[0], rtol=1e-5, atol=1e-5)


def test_token_types_mark_the_image_tokens(vlm):
    model, _, _ = vlm
    cfg = model.config
    ids = torch.tensor([[5, cfg.image_token_id, cfg.image_token_id, 7, cfg.video_token_id]])
    assert image_token_types(cfg, ids).tolist() == [[0, 1, 1, 0, 2]]


def test_packed_and_shared_prefix_layouts_are_refused(vlm):
    model, _, _ = vlm
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="padded batches only"):
        model_inputs(model, {"input_ids": ids, "position_ids": torch.tensor([[0, 1, 0, 1]])})
    with pytest.raises(ValueError, match="padded batches only"):
        model_inputs(model, {"input_ids": ids, "attention_mask": torch.ones(1, 1, 4, 4, dtype=torch.bool),
                             "position_ids": torch.tensor([[0, 1, 2, 3]])})


def test_freezing_the_visual_encoder_leaves_the_language_model_trainable(tiny_vision_dir):
    model = load_causal_lm(tiny_vision_dir, "fp32")
    n = freeze_visual_encoder(model)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert (n == len(frozen) > 0
            and all(".visual." in name or name.startswith("model.visual") for name in frozen))
    assert trainable and all("language_model" in name or name.startswith("lm_head") for name in trainable)


def test_log_probs_in_row_chunks_with_images_equal_the_whole_logits(tiny_vision_dir, vlm):
    """The first-call check of the chunked path runs a batch with images whole (its tensors are not split by
    row) and compares row 0; the chunked log-probs equal the whole-logits ones."""
    from posttrain.algorithms.losses import gathered_logprobs
    from posttrain.models import forward_logprobs

    model = load_causal_lm(tiny_vision_dir, "fp32")  # a fresh model: the check runs on its first call
    _, processor, text = vlm
    rows = [encode_with_images(processor, text, [_image(i)]) for i in range(2)]
    ids = torch.tensor([r[0] for r in rows])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_inputs": merge_image_inputs(
        [r[1] for r in rows])}
    keep = torch.arange(ids.shape[1] - 4, ids.shape[1] - 1)
    index = torch.arange(2 * len(keep))
    labels = ids[:, keep + 1].reshape(-1)
    with torch.no_grad():
        chunked = forward_logprobs(model, batch, keep, index, labels, 1.0, chunk_bytes=1)
        whole = forward_logits(model, batch, keep=keep)
        want = gathered_logprobs(whole.reshape(-1, whole.shape[-1]), index, labels, 1.0)
    torch.testing.assert_close(chunked, want, rtol=1e-5, atol=1e-5)


def test_a_hub_id_is_detected_from_its_config(monkeypatch, tiny_vision_dir):
    from transformers import AutoConfig

    vlm_config = AutoConfig.from_pretrained(tiny_vision_dir)
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda name, **kw: vlm_config if name == "org/vlm" else
                        (_ for _ in ()).throw(OSError(f"{name} is not reachable")))
    assert is_vision_folder("org/vlm") and not is_vision_folder("org/unreachable")


def test_the_processor_carries_the_tokenizers_special_tokens(vlm):
    _, processor, _ = vlm  # as OpenRLHF's processor does: agent code reads them from `hf_tokenizer`
    assert processor.eos_token_id == processor.tokenizer.eos_token_id is not None
    assert processor.pad_token_id == processor.tokenizer.pad_token_id is not None


def test_a_placeholder_count_the_images_do_not_match_is_a_template_error_not_an_image_error(tiny_vision_dir):
    from posttrain.data.errors import DataError

    processor = load_processor(tiny_vision_dir)
    image = Image.new("RGB", (32, 32))
    with pytest.raises(DataError) as err:
        encode_with_images(processor, "a <|image_pad|> and b <|image_pad|>", [image], "d.jsonl, row 1")
    msg = str(err.value)
    assert msg.startswith("d.jsonl, row 1: the rendered text's image placeholders do not match its "
                          "1 image(s)")
    assert "Fix the chat template so that it puts one <|image_pad|> per image" in msg
    assert "refuses" not in msg and "Replace the image" not in msg
    with pytest.raises(DataError, match=r"row 1, image \(30000x3 px\): the model's processor refuses it "
                                        r"\(absolute aspect ratio"):
        encode_with_images(processor, "a <|image_pad|>", [Image.new("RGB", (30000, 3))], "row 1")
