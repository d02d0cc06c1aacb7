"""SFT on image-text rows (vision-language models): the data format (`<image>` tags or image parts plus an
image column), the samples (image tokens in the prompt, never trained), one-line errors for bad image input,
and a run that learns a colour only the image shows."""
import re

import numpy as np
import pytest
import torch
from PIL import Image

from posttrain.data import SFTDataset
from posttrain.data.collate import pad_collate
from posttrain.data.errors import DataError
from posttrain.data.synthetic_vision import colour_rows, write_colour_dataset
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.models.vision import is_vision_folder, load_processor
from posttrain.trainers.sft import SFTObjective
from posttrain.utils.metrics import read_metrics


@pytest.fixture(scope="module")
def processor(tiny_vision_dir):
    return load_processor(tiny_vision_dir, load_tokenizer(tiny_vision_dir))


def _dataset(processor, rows, max_images=1, chat=True):
    return SFTDataset(rows, processor.tokenizer, 64, input_key="prompt", output_key="response",
                      apply_chat_template=chat, processor=processor, max_images=max_images)


def test_samples_carry_their_image_tokens_and_tensors_untrained(processor, tmp_path):
    rows = colour_rows(3, seed=0, folder=tmp_path)
    rows = [{**r, "__source__": str(tmp_path / "d.jsonl"), "__row__": i + 1} for i, r in enumerate(rows)]
    data = _dataset(processor, rows)
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for i, sample in enumerate(data.samples):
        ids, mask = sample["input_ids"], sample["loss_mask"]
        positions = [j for j, t in enumerate(ids) if t == image_id]
        assert len(positions) == 4 and all(mask[j] == 0 for j in positions)
        assert sample["image_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]
        response = processor.tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert response.startswith(rows[i]["response"])
    batch = pad_collate([data[i] for i in range(3)], processor.tokenizer.pad_token_id)
    assert batch["image_inputs"]["pixel_values"].shape[0] == 3 * 16  # the rows' patches, in row order
    assert torch.equal(batch["image_inputs"]["pixel_values"][16:32],
                       torch.as_tensor(data[1]["image_inputs"]["pixel_values"]))


def test_messages_with_image_parts_equal_image_tags(processor, tmp_path):
    row = colour_rows(1, seed=1, folder=tmp_path)[0]
    parts = {**row, "prompt": [{"role": "user", "content": [{"type": "image"},
                                                            {"type": "text",
                                                             "text": "What colour is the shape?"}]}]}
    a, b = _dataset(processor, [row]).samples[0], _dataset(processor, [parts]).samples[0]
    assert a["input_ids"] == b["input_ids"] and a["loss_mask"] == b["loss_mask"]


@pytest.mark.parametrize("change,message", [
    (lambda r, d: {**r, "images": ["missing.png"]}, r"d.jsonl, row 1, key 'images'\[0\]: .*missing.png"),
    (lambda r, d: {**r, "prompt": "What colour is the shape?"}, "0 image placeholder.*1 image"),
    (lambda r, d: {**r, "images": r["images"] * 2, "prompt": "<image><image>Colour?"},
     r"2 .*--data.max_images_per_prompt"),
    (lambda r, d: (d / r["images"][0]).write_bytes(b"not a png") and r, "d.jsonl, row 1.*image"),
    (lambda r, d: Image.new("RGB", (100000, 3)).save(d / r["images"][0]) or r,
     r"d.jsonl, row 1, key 'images'\[0\]: image .*\(100000x3 px\): the model's processor refuses it "
     r"\(absolute"),
])
def test_bad_image_input_is_one_clear_error(processor, tmp_path, change, message):
    row = {**colour_rows(1, seed=2, folder=tmp_path)[0], "__source__": str(tmp_path / "d.jsonl"),
           "__row__": 1}
    with pytest.raises(DataError, match=message) as err:
        _dataset(processor, [change(row, tmp_path)])
    assert "\n" not in str(err.value)


def test_a_transparent_image_trains_as_the_same_image_on_white(processor, tiny_vision_dir, tmp_path):
    """A transparent PNG gives the pixel values the processor gives it (transparency over white), those of
    the same image saved composited on white, and so the same loss; dropping the alpha band (the stored black
    of the transparent pixels) would give other pixels."""
    rgba = Image.new("RGBA", (56, 56), (0, 0, 0, 0))  # transparent pixels store black
    rgba.paste((0, 0, 0, 255), (14, 14, 42, 42))  # an opaque black square
    rgba.save(tmp_path / "rgba.png")
    white = Image.new("RGB", (56, 56), (255, 255, 255))
    white.paste((0, 0, 0), (14, 14, 42, 42))
    white.save(tmp_path / "white.png")
    rows = [{"prompt": "<image>What colour is the shape?", "response": "black",
             "images": [str(tmp_path / name)]} for name in ("rgba.png", "white.png")]
    samples = _dataset(processor, rows).samples
    pixels = [s["image_inputs"]["pixel_values"] for s in samples]
    own = processor.image_processor(images=[Image.open(tmp_path / "rgba.png")], return_tensors="np")
    black = processor.image_processor(images=[rgba.convert("RGB")], return_tensors="np")["pixel_values"]
    assert np.array_equal(pixels[0], pixels[1]) and np.array_equal(pixels[0], own["pixel_values"])
    assert pixels[0].mean() > 0 > black.mean()  # a mostly white image, not a black one
    model = load_causal_lm(tiny_vision_dir, "fp32")
    objective = SFTObjective(processor.tokenizer.pad_token_id, packing=False)
    with torch.no_grad():
        pad = processor.tokenizer.pad_token_id
        losses = [objective.loss(model, pad_collate([s], pad), 1.0)[0] for s in samples]
    assert torch.equal(losses[0], losses[1])


def test_images_need_the_chat_template(processor, tmp_path):
    with pytest.raises(DataError, match="needs --data.apply_chat_template"):
        _dataset(processor, colour_rows(1, seed=3, folder=tmp_path), chat=False)


@pytest.mark.slow
def test_sft_learns_the_colour_that_only_the_image_shows(tiny_vision_dir, tmp_path):
    from posttrain.cli import train_sft

    data = write_colour_dataset(tmp_path / "data", 64, seed=0)
    out = tmp_path / "out"
    train_sft.main(["--model.model_name_or_path", tiny_vision_dir, "--data.dataset", data,
                    "--data.input_key", "prompt", "--data.output_key", "response",
                    "--data.apply_chat_template", "--data.max_images_per_prompt", "1", "--data.max_len", "64",
                    "--train.batch_size", "16", "--train.micro_batch_size", "8", "--train.max_epochs", "4",
                    "--adam.lr", "3e-3", "--ckpt.output_dir", str(out), "--logger.logging_steps", "1",
                    "--train.seed", "0"])
    losses = [row["train/loss"] for row in read_metrics(out / "metrics.jsonl") if "train/loss" in row]
    assert losses[-1] < 0.5 * losses[0]
    assert is_vision_folder(out) and load_processor(out).image_processor is not None  # a loadable VLM folder
    assert type(load_causal_lm(out, "fp32")).__name__ == "Qwen2_5_VLForConditionalGeneration"


def test_image_flags_with_a_text_model_and_packing_with_a_vlm_are_one_line_errors(tiny_model_dir,
                                                                                  tiny_vision_dir, tmp_path,
                                                                                  capsys):
    from posttrain.cli import train_sft

    data = write_colour_dataset(tmp_path / "data", 4, seed=0)
    base = ["--data.dataset", data, "--data.input_key", "prompt", "--data.output_key", "response",
            "--data.apply_chat_template", "--ckpt.output_dir", str(tmp_path / "o")]
    for model, extra, message in (
            (tiny_model_dir, ["--data.max_images_per_prompt", "1"], "is not a vision-language model"),
            (tiny_vision_dir, ["--data.max_images_per_prompt", "1", "--ds.packing_samples"],
             "--ds.packing_samples: .* is a vision-language model")):
        with pytest.raises(SystemExit) as exc:
            train_sft.main(["--model.model_name_or_path", model, *base, *extra])
        assert exc.value.code == 2
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1 and re.search(message, err[0]), err
