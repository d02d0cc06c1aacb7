"""Every image read is bounded (issue 46): `posttrain sft` on a vision-language model whose row points at a
device, a FIFO, an image too large to decode, a shape the processor refuses, an endless download or a
trickling one ends in one line on stderr and exit status 2 (before the model loads), never a hang, a
traceback or gigabytes of memory. The real CLI runs as a subprocess where a regression would hang or fill
the memory (a device, a FIFO, the downloads); the image too large and the refused shape through the console
command's entry in this process (`in_process`)."""
import json
import os
import subprocess
import sys

import pytest
from image_sources import FOREVER, declared_png, image_server, trickle
from PIL import Image

from tests.cli.test_cli_input_errors import in_process

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def image_row_flags(model, tmp_path, ref, *flags) -> list:
    """`posttrain sft`'s flags for one row (written into `tmp_path`) whose image is `ref`."""
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "<image>What colour is the shape?", "response": "red",
                                "images": [ref]}) + "\n")
    return ["--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--data.apply_chat_template", "--data.max_images_per_prompt",
            "1", "--data.max_len", "64", "--train.batch_size", "1", "--train.micro_batch_size", "1",
            "--ckpt.output_dir", tmp_path / "out", *flags]


def sft_on_image(model, tmp_path, ref, *flags):
    """`posttrain sft` on one row whose image is `ref`; the completed process."""
    argv = ["-m", "posttrain.cli.train_sft", *image_row_flags(model, tmp_path, ref, *flags)]
    return subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=ENV,
                          timeout=120, check=False)


def sft_on_image_here(capfd, model, tmp_path, ref, *flags):
    """`sft_on_image` in this process (`in_process`)."""
    return in_process(capfd, "sft", *image_row_flags(model, tmp_path, ref, *flags))


def one_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in ("rows.jsonl, row 1, key 'images'", *needles):
        assert needle in errors[0], errors[0]


@pytest.mark.e2e
def test_a_device_is_not_read(tiny_vision_dir, tmp_path):
    one_line(sft_on_image(tiny_vision_dir, tmp_path, "/dev/zero"), "'/dev/zero'", "is a character device",
             "regular files only")


@pytest.mark.e2e
def test_a_fifo_is_not_opened_for_reading(tiny_vision_dir, tmp_path):
    fifo = tmp_path / "f.png"
    os.mkfifo(fifo)  # nobody writes to it: reading it would block forever
    one_line(sft_on_image(tiny_vision_dir, tmp_path, str(fifo)), "f.png", "is a FIFO (named pipe)")


def test_too_many_pixels_is_too_large_not_corrupt(tiny_vision_dir, tmp_path, capfd):
    (tmp_path / "huge.png").write_bytes(declared_png(20000, 20000))
    one_line(sft_on_image_here(capfd, tiny_vision_dir, tmp_path, "huge.png"), "'huge.png'",
             "too large: 400,000,000 pixels, more than --data.max_image_pixels 89,478,485")


def test_a_shape_the_processor_refuses(tiny_vision_dir, tmp_path, capfd):
    Image.new("RGB", (100000, 3)).save(tmp_path / "strip.png")
    one_line(sft_on_image_here(capfd, tiny_vision_dir, tmp_path, "strip.png"),
             "[0]: image 'strip.png' (100000x3 px): the model's processor refuses it (absolute aspect ratio "
             "must be smaller than 200")


@pytest.mark.e2e
def test_an_endless_download_stops_at_the_byte_limit(tiny_vision_dir, tmp_path):
    with image_server({"/zeros.png": FOREVER}) as url:
        proc = sft_on_image(tiny_vision_dir, tmp_path, f"{url}/zeros.png", "--data.max_image_bytes",
                            "1000000")
    one_line(proc, "zeros.png", "the download is larger than --data.max_image_bytes 1,000,000")


@pytest.mark.e2e
def test_a_trickling_download_stops_at_the_total_deadline(tiny_vision_dir, tmp_path):
    """One byte every 2 s: no single read waits long enough to time out, the whole download does."""
    with image_server({"/slow.png": trickle(2)}) as url:
        proc = sft_on_image(tiny_vision_dir, tmp_path, f"{url}/slow.png", "--data.image_url_timeout", "3")
    one_line(proc, "slow.png", "not downloaded within --data.image_url_timeout 3 s")
