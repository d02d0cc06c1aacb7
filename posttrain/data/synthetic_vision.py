"""A local, seeded image task for vision-language demos and tests: "What colour is the shape?".

Each row has one PNG (written into a folder) showing a square or a disc in one of `COLOURS` on a grey
background, at a random position and size; the answer is the colour's name, which only the image tells.
A row: ``prompt`` "<image>What colour is the shape?" (the `<image>` tag marks where the image goes),
``response`` and ``answer`` the colour name, ``images`` [the PNG's path] (in a dataset file written by
`write_colour_dataset`: its file name, relative to the file's folder).
``blank=True`` writes every image as the plain background (the control: the answer cannot be seen).
``sloppy`` models a careless demonstrator: with that probability its ``response`` names a colour drawn at
random (the right one a quarter of the time), while ``answer`` (the label a verifiable reward checks)
stays right; SFT learns the format and some of the colours, RL with the reward can learn the rest.
"""
from __future__ import annotations

import json
import os
import random

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
BACKGROUND = (128, 128, 128)
SIDE = 56  # pixels: 4 image tokens for the tiny Qwen2.5-VL (14-pixel patches merged 2x2)
PROMPT = "<image>What colour is the shape?"


def colour_rows(n: int, seed: int, folder, blank: bool = False, prefix: str = "img",
                sloppy: float = 0.0) -> list[dict]:
    """`n` rows whose images are written into `folder` as `{prefix}{i}.png`; deterministic in `seed`."""
    from PIL import Image, ImageDraw

    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        name = rng.choice(sorted(COLOURS))
        size = rng.randint(SIDE // 3, SIDE // 2)
        x, y = rng.randint(0, SIDE - size), rng.randint(0, SIDE - size)
        image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
        if not blank:
            draw = ImageDraw.Draw(image)
            shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
            shape((x, y, x + size, y + size), fill=COLOURS[name])
        path = os.path.join(folder, f"{prefix}{i}.png")
        image.save(path)
        said = rng.choice(sorted(COLOURS)) if rng.random() < sloppy else name
        rows.append({"prompt": PROMPT, "response": said, "answer": name, "images": [path]})
    return rows


def write_colour_dataset(folder, n: int, seed: int, blank: bool = False, name: str = "train",
                         sloppy: float = 0.0) -> str:
    """`colour_rows` saved as `folder/{name}.jsonl` beside its images; returns the file's path."""
    rows = colour_rows(n, seed, folder, blank=blank, prefix=f"{name}-", sloppy=sloppy)
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({**row, "images": [os.path.basename(p) for p in row["images"]]}) + "\n")
    return path
