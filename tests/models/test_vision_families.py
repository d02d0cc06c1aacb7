"""The vision-language families transformers ships, each as a tiny random-init model (few layers, small hidden
sizes, small images; Qwen2.5-VL is `init-tiny --vision`, the others are built here), checked through
posttrain's own functions:
detected from the config and loaded as the family's `ForConditionalGeneration`; the processor loads without
torchvision and expands one image into the family's number of image tokens; `forward_logits` with our image
inputs equals the model run on the processor's own output, and the image reaches the logits; the HF engine's
sampled log-probs equal the trainer's recomputation over the right-padded prompt + response (the rotary
positions of the prefill and the decode steps, `vision_decode._next_positions`); `freeze_visual_encoder`
freezes exactly what lies outside the language model.

Families: Qwen3-VL (3-axis interleaved rotary positions, deepstack features), Qwen3.5 (a hybrid language
model: gated delta-net linear attention beside full attention, with Qwen3-VL's vision part and processor),
Gemma 4 (plain 1D rotary positions, bidirectional attention inside each image, image tokens wrapped in begin /
end of image tokens the processor adds, soft-capped logits, per-layer input embeddings)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from posttrain.data.collate import merge_image_inputs
from posttrain.data.vision_samples import encode_with_images, image_placeholder
from posttrain.models import forward_logits, load_causal_lm, load_tokenizer
from posttrain.models.tiny_tokenizer import (
    IM_END,
    IM_START,
    PAD_TOKEN,
    portable_tokenizer_class,
    train_tiny_tokenizer,
)
from posttrain.models.tiny_vision import IMAGE_PAD, VIDEO_PAD, VISION_CHAT_TEMPLATE, VISION_END, VISION_START
from posttrain.models.vision import (
    freeze_visual_encoder,
    image_token_types,
    is_vision_folder,
    is_vision_model,
    load_processor,
)
from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.rollout.vision_decode import structure_token_ids

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
LONGER = [{"role": "user",
           "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape here?"}]}]
SIDE = 32  # pixels per image side

# Gemma 4's named tokens (its tokenizer's `image_token`, `boi_token`, ... as the processor reads them)
GEMMA4_TOKENS = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>",
                 "video_token": "<|video|>"}


def _chat_template(placeholder: str) -> str:
    """The tiny VLM's ChatML with `{"type": "image"}` parts rendered as `placeholder`."""
    return VISION_CHAT_TEMPLATE.replace(VISION_START + IMAGE_PAD + VISION_END, placeholder)


def _image(seed: int, side: int = SIDE) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (side, side, 3), dtype=np.uint8))


def _save(out: Path, model, tokenizer, image_processor, named_tokens: dict | None = None) -> None:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    portable_tokenizer_class(out)
    if named_tokens:  # `image_token` & co. as tokenizer attributes (transformers 5: custom `*_token` keys)
        path = out / "tokenizer_config.json"
        cfg = json.loads(path.read_text())
        cfg.update(named_tokens)
        path.write_text(json.dumps(cfg, indent=2))


def _qwen_parts(base_tok_dir: Path):
    tok = load_tokenizer(str(base_tok_dir))
    tok.add_special_tokens({"additional_special_tokens": [IM_START, VISION_START, VISION_END, IMAGE_PAD,
                                                          VIDEO_PAD]})
    tok.chat_template = VISION_CHAT_TEMPLATE
    ids = dict(zip(("start", "end", "image", "video", "pad", "eos"), tok.convert_tokens_to_ids(
        [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD, PAD_TOKEN, IM_END])))
    # 8 px patches, 2x2 merged into one image token: 32x32 px -> a 4x4 patch grid -> 4 image tokens
    image_processor = transformers.Qwen2VLImageProcessor(min_pixels=16 * 16 * 4, max_pixels=16 * 16 * 16,
                                                         patch_size=8, merge_size=2, temporal_patch_size=2)
    return tok, ids, image_processor


def build_qwen3_vl(out: Path, base_tok_dir: Path) -> None:
    tok, ids, image_processor = _qwen_parts(base_tok_dir)
    config = transformers.Qwen3VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, intermediate_size=128, vocab_size=len(tok), max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [4, 2, 2], "mrope_interleaved": True},
                         pad_token_id=ids["pad"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(eos_token_id=[ids["eos"]],
                                                            pad_token_id=ids["pad"])
    _save(out, model, tok, image_processor)


def build_qwen3_5(out: Path, base_tok_dir: Path) -> None:
    tok, ids, image_processor = _qwen_parts(base_tok_dir)
    config = transformers.Qwen3_5Config(
        text_config=dict(hidden_size=64, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                         vocab_size=len(tok), max_position_embeddings=512,
                         # half of the 16 head dims rotate: 4 frequencies, on (time, height, width) 2, 1, 1
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True},
                         pad_token_id=ids["pad"]),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                           num_position_embeddings=64),
        image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(eos_token_id=[ids["eos"]],
                                                            pad_token_id=ids["pad"])
    _save(out, model, tok, image_processor)


def build_gemma4(out: Path, base_tok_dir: Path) -> None:
    tok = load_tokenizer(str(base_tok_dir))
    tok.add_special_tokens({"additional_special_tokens": [IM_START, *GEMMA4_TOKENS.values()]})
    tok.chat_template = _chat_template(GEMMA4_TOKENS["image_token"])
    named = dict(zip(GEMMA4_TOKENS, tok.convert_tokens_to_ids(list(GEMMA4_TOKENS.values()))))
    pad, eos = tok.convert_tokens_to_ids([PAD_TOKEN, IM_END])
    config = transformers.Gemma4Config(
        text_config=dict(hidden_size=64, num_hidden_layers=2,
                         layer_types=["sliding_attention", "full_attention"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, global_head_dim=16, intermediate_size=128,
                         vocab_size=len(tok), vocab_size_per_layer_input=len(tok),
                         hidden_size_per_layer_input=8, max_position_embeddings=512, sliding_window=32,
                         use_bidirectional_attention="vision", final_logit_softcapping=30.0, pad_token_id=pad,
                         eos_token_id=eos, bos_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=3,
                           position_embedding_size=64),
        audio_config=None,
        image_token_id=named["image_token"], boi_token_id=named["boi_token"], eoi_token_id=named["eoi_token"],
        video_token_id=named["video_token"], audio_token_id=named["audio_token"],
        boa_token_id=named["boa_token"], eoa_token_index=named["eoa_token"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    model.generation_config = transformers.GenerationConfig(eos_token_id=[eos], pad_token_id=pad)
    # 4 px patches pooled 3x3 into one soft token, at most 70 soft tokens (the smallest budget Gemma 4 takes):
    # any image is resized to 96x96 px -> 24x24 patches -> 64 image tokens
    image_processor = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                                           pooling_kernel_size=3)
    _save(out, model, tok, image_processor, named_tokens=GEMMA4_TOKENS)


# family -> (builder, class name, image tokens per SIDE x SIDE image)
FAMILIES = {
    "qwen2_5_vl": (None, "Qwen2_5_VLForConditionalGeneration", 4),  # `tiny_vision_dir` (init-tiny --vision)
    "qwen3_vl": (build_qwen3_vl, "Qwen3VLForConditionalGeneration", 4),
    "qwen3_5": (build_qwen3_5, "Qwen3_5ForConditionalGeneration", 4),
    "gemma4": (build_gemma4, "Gemma4ForConditionalGeneration", 64),
}


@pytest.fixture(scope="module")
def base_tokenizer_dir(tmp_path_factory):
    """The project's tiny tokenizer, trained once for all families."""
    path = tmp_path_factory.mktemp("vlm-families") / "tokenizer"
    train_tiny_tokenizer(2048, model_max_length=512).save_pretrained(path)
    portable_tokenizer_class(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, base_tokenizer_dir, one_torch_thread):
    name = request.param
    build, cls_name, n_image = FAMILIES[name]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    if build is None:
        path = request.getfixturevalue("tiny_vision_dir")
    else:
        path = base_tokenizer_dir.parent / name
        build(path, base_tokenizer_dir)
    model = load_causal_lm(str(path), "fp32")
    processor = load_processor(str(path))
    text = processor.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return {"name": name, "path": str(path), "cls": cls_name, "n_image": n_image, "model": model,
            "processor": processor, "text": text}


def _batch(ids, images, width=None):
    width = width or len(ids)
    row = torch.full((1, width), 0, dtype=torch.long)
    row[0, :len(ids)] = torch.tensor(ids)
    mask = torch.zeros(1, width, dtype=torch.long)
    mask[0, :len(ids)] = 1
    return {"input_ids": row, "attention_mask": mask, "image_inputs": merge_image_inputs([images])}


def test_detected_from_the_config_and_loaded_as_the_familys_class(family):
    assert is_vision_folder(family["path"])
    assert type(family["model"]).__name__ == family["cls"] and is_vision_model(family["model"])


def test_the_processor_expands_one_image_into_the_familys_image_tokens(family):
    model, processor, text = family["model"], family["processor"], family["text"]
    cfg = model.config
    assert image_placeholder(processor) in text
    ids, images = encode_with_images(processor, text, [_image(0)])
    assert (ids.count(cfg.image_token_id) == family["n_image"]
            == _image_tokens_by_the_image_processor(processor))
    own = processor(text=[text], images=[_image(0)], return_tensors="pt", add_special_tokens=False)
    assert own["input_ids"][0].tolist() == ids
    assert set(images) == {k for k in own if k not in ("input_ids", "attention_mask", "mm_token_type_ids",
                                                       "token_type_ids")}
    if "mm_token_type_ids" in own:  # the processor's token types are ours
        assert torch.equal(own["mm_token_type_ids"], image_token_types(cfg, own["input_ids"]))
    if family["name"] == "gemma4":  # the processor wraps the image's tokens in begin / end of image
        first = ids.index(cfg.image_token_id)
        assert ids[first - 1] == cfg.boi_token_id and ids[first + family["n_image"]] == cfg.eoi_token_id


def _image_tokens_by_the_image_processor(processor) -> int:
    """The image tokens of one SIDE x SIDE image as the family's image processor counts them: Qwen, one per
    merged block of its patch grid; Gemma 4, its soft tokens (patches pooled k x k)."""
    out = processor.image_processor([_image(0)], return_tensors="np")
    if "image_grid_thw" in out:
        return int(out["image_grid_thw"][0].prod()) // processor.image_processor.merge_size ** 2
    return int(out["num_soft_tokens_per_image"][0])


def test_our_inputs_give_the_logits_of_the_processors_own_and_the_image_matters(family):
    model, processor, text = family["model"], family["processor"], family["text"]
    ids, images = encode_with_images(processor, text, [_image(0)])
    with torch.no_grad():
        ours = forward_logits(model, _batch(ids, images))
        own = model(**processor(text=[text], images=[_image(0)], return_tensors="pt",
                                add_special_tokens=False)).logits.float()
        other = forward_logits(model, _batch(ids, encode_with_images(processor, text, [_image(5)])[1]))
        # right padding changes nothing
        padded = forward_logits(model, _batch(ids, images, width=len(ids) + 3))
    torch.testing.assert_close(ours, own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(padded[:, :len(ids)], ours, rtol=1e-5, atol=1e-5)
    image_end = max(i for i, t in enumerate(ids) if t == model.config.image_token_id)
    assert (ours[:, image_end:] - other[:, image_end:]).abs().max() > 1e-3  # after the image: it is seen


def _trainer_logprobs_match(model, rows, pad_id: int) -> None:
    """`rows`: (prompt ids, image tensors or None, RolloutOutput). The engine's log-probs equal those the
    trainer recomputes: one forward over the right-padded prompt + response (temperature
    1, log-softmax, gather)."""
    width = max(len(ids) + len(out.output_token_ids) for ids, _, out in rows)
    seq = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (ids, _, out) in enumerate(rows):
        seq[r, :len(ids) + len(out.output_token_ids)] = torch.tensor(ids + out.output_token_ids)
        mask[r, :len(ids) + len(out.output_token_ids)] = 1
    batch = {"input_ids": seq, "attention_mask": mask}
    images = merge_image_inputs([im for _, im, _ in rows])
    with torch.no_grad():
        logp = torch.log_softmax(forward_logits(model,
                                                {**batch, "image_inputs": images} if images else batch), -1)
    for r, (ids, _, out) in enumerate(rows):
        p, n = len(ids), len(out.output_token_ids)
        assert n >= 1
        ours = logp[r, p - 1:p - 1 + n].gather(-1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
        np.testing.assert_allclose(ours.numpy(), out.logprobs, rtol=0, atol=1e-5, err_msg=f"row {r}")


def _two_prompts(family):
    processor = family["processor"]
    longer = processor.tokenizer.apply_chat_template(LONGER, add_generation_prompt=True, tokenize=False)
    return [encode_with_images(processor, family["text"], [_image(0)]),
            encode_with_images(processor, longer, [_image(3)])]


def _generate(engine, prompts):
    outs = engine.generate([ids for ids, _ in prompts], SamplingParams(max_new_tokens=4, n=2, seed=1),
                           images=[im for _, im in prompts])
    return [(ids, im, out) for (ids, im), group in zip(prompts, outs) for out in group]


def test_sampled_logprobs_equal_the_trainers_recomputation(family):
    model, tok = family["model"], family["processor"].tokenizer
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    # prompts of two lengths: the shorter is left-padded at prefill
    rows = _generate(engine, _two_prompts(family))
    never = set(structure_token_ids(model))
    assert {model.config.image_token_id, model.config.video_token_id} <= never
    if family["name"] == "gemma4":
        assert {model.config.boi_token_id, model.config.eoi_token_id} <= never
    assert all(len(out.output_token_ids) <= 4 and not set(out.output_token_ids) & never for _, _, out in rows)
    _trainer_logprobs_match(model, rows, tok.pad_token_id)


def test_text_only_rows_after_an_image_batch_decode_at_their_text_positions(family):
    """A batch without images, rows of two lengths, after a batch with images: no rotary offset of that
    earlier batch carries over, and the left-padded row is positioned from its first token."""
    model, tok = family["model"], family["processor"].tokenizer
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id)
    _generate(engine, _two_prompts(family))
    texts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)
             for c in ("Hi", "Hello there, what is the colour of the sky today?")]
    _trainer_logprobs_match(model, _generate(engine, [(ids, None) for ids in texts]), tok.pad_token_id)


def test_a_peft_wrapped_model_decodes_at_the_same_positions(family):
    """The HF engine with a LoRA adapter (`lora_sync="adapter"`): the rotary offsets are found under the peft
    wrapper too (the adapter starts at zero, so the log-probs are the plain model's)."""
    pytest.importorskip("peft")
    from posttrain.models import LoraSpec

    model, tok = load_causal_lm(family["path"], "fp32"), family["processor"].tokenizer
    engine = HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id, lora=LoraSpec(rank=4),
                             lora_sync="adapter")
    _trainer_logprobs_match(family["model"], _generate(engine, _two_prompts(family)), tok.pad_token_id)


def test_freezing_the_visual_encoder_freezes_exactly_what_lies_outside_the_language_model(family):
    model = load_causal_lm(family["path"], "fp32")
    n = freeze_visual_encoder(model)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    outside = {name for name, _ in model.named_parameters() if "language_model" not in name
               and "lm_head" not in name}
    assert frozen == outside and n == len(frozen) > 0
    assert all(p.requires_grad for name, p in model.named_parameters() if name not in outside)


SYSTEM = "{{- '<|im_start|>system\\nLook at the image.<|im_end|>\\n' }}"  # the processor's own first turn


def _legacy_layout(folder: Path, processor_template: str) -> None:
    """Rewrite `folder` as released VLMs ship their templates: the tokenizer's in tokenizer_config.json, the
    processor's in chat_template.json (no chat_template.jinja, which both would read)."""
    jinja = folder / "chat_template.jinja"
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = jinja.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": processor_template}))
    jinja.unlink()


@pytest.mark.parametrize("layout", ["as built", "processor template differs"])
def test_prompts_render_as_the_processors_chat_template_renders_them(family, tmp_path, layout):
    """OpenRLHF renders a VLM's prompts with its processor (`processor.apply_chat_template`). posttrain's
    prompt text equals that rendering: where the folder has one template, and where the processor's template
    (legacy chat_template.json) differs from the tokenizer's, as in released VLMs."""
    import shutil

    from posttrain.data import PromptDataset

    folder = tmp_path / family["name"]
    shutil.copytree(family["path"], folder)
    template = family["processor"].tokenizer.chat_template
    if layout != "as built":
        template = SYSTEM + template
        _legacy_layout(folder, template)
    tok = load_tokenizer(str(folder))
    processor = load_processor(str(folder), tok)
    assert processor.chat_template == template
    row = {"prompt": "<image>What colour?", "images": [_image(0)], "answer": "red"}
    prompt = PromptDataset([row], tok, input_key="prompt", label_key="answer", apply_chat_template=True,
                           processor=processor, max_images=1).prompts[0]
    reference = processor.apply_chat_template(MESSAGES, chat_template=template, add_generation_prompt=True)
    assert prompt.text == reference and ("Look at the image." in reference) == (layout != "as built")


def test_the_token_types_go_under_the_name_the_forward_reads(family):
    """posttrain passes the token types as `mm_token_type_ids` where the forward takes that name (every
    tested family with the installed transformers), as the processor itself does. For Gemma 4, OpenRLHF
    0.10.2 passes `token_type_ids` (its rule: Gemma reads that name); this forward does not read it: the
    image's bidirectional attention is lost and the logits change."""
    from posttrain.models.vision import vision_forward_inputs

    model, processor, text = family["model"], family["processor"], family["text"]
    own = processor(text=[text], images=[_image(0)], return_tensors="pt", add_special_tokens=False)
    ids = own["input_ids"]
    images = {k: v for k, v in own.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    ours = vision_forward_inputs(model, ids, images)
    assert "mm_token_type_ids" in ours and "token_type_ids" not in ours
    assert torch.equal(ours["mm_token_type_ids"], own["mm_token_type_ids"])
    if family["name"] != "gemma4":
        return
    renamed = {("token_type_ids" if k == "mm_token_type_ids" else k): v for k, v in ours.items()}
    with torch.no_grad():
        right = model(input_ids=ids, attention_mask=own["attention_mask"], **ours).logits
        wrong = model(input_ids=ids, attention_mask=own["attention_mask"], **renamed).logits
        untyped = model(input_ids=ids, attention_mask=own["attention_mask"],
                        **{k: v for k, v in ours.items() if k != "mm_token_type_ids"}).logits
    assert (right - wrong).abs().max() > 1e-3  # the name matters ...
    torch.testing.assert_close(wrong, untyped, rtol=0, atol=0)  # ... `token_type_ids` is not read at all
