"""Writes the vision example's data: small pictures of one coloured shape, and the question "which shape, which
colour?" with its answer (``a red circle``), in TRL's vision format (``messages`` with an image part, ``images``).

Each picture is 48 x 48 pixels (the example tower's image size): a circle, square or triangle in red, green, blue
or yellow, of a random size and place, on a light background with a little noise. The held-out pictures are
drawn with another seed, so none of them is a training picture.

    python examples/vision/make_shapes.py                      # runs/vision/shapes/{train,eval}.jsonl + images/
    python examples/vision/make_shapes.py --out DIR --train 16 --eval 8
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 48
COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 215), "yellow": (225, 195, 30)}
SHAPES = ("circle", "square", "triangle")
QUESTION = "Which shape is in the picture, and what colour is it?"


def draw(rng: random.Random, shape: str, colour: str) -> Image.Image:
    """One picture: ``shape`` in ``colour`` (each channel jittered), 14 to 30 pixels across, anywhere inside."""
    background = tuple(rng.randint(225, 250) for _ in range(3))
    img = Image.new("RGB", (SIZE, SIZE), background)
    for _ in range(60):  # a little noise, so the background is not one flat colour
        img.putpixel((rng.randrange(SIZE), rng.randrange(SIZE)), tuple(rng.randint(170, 255) for _ in range(3)))
    fill = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[colour])
    d = rng.randint(14, 30)
    x, y = rng.randint(2, SIZE - d - 2), rng.randint(2, SIZE - d - 2)
    pen = ImageDraw.Draw(img)
    if shape == "circle":
        pen.ellipse((x, y, x + d, y + d), fill=fill)
    elif shape == "square":
        pen.rectangle((x, y, x + d, y + d), fill=fill)
    else:
        pen.polygon([(x + d / 2, y), (x, y + d), (x + d, y + d)], fill=fill)
    return img


def row(image: str, shape: str, colour: str) -> dict:
    """One conversation: the picture and the question, then the answer."""
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": f"a {colour} {shape}"}],
            "images": [image]}


def write(out: Path, name: str, n: int, seed: int) -> None:
    """``n`` rows in ``out/name.jsonl``, their pictures in ``out/images/`` (paths relative to the file); the
    twelve colour-shape pairs take turns, so every pair is (nearly) equally common."""
    rng = random.Random(seed)
    pairs = [(s, c) for s in SHAPES for c in COLOURS]
    (out / "images").mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.jsonl", "w") as f:
        for i in range(n):
            shape, colour = pairs[i % len(pairs)]
            image = f"images/{name}_{i:04d}.png"
            draw(rng, shape, colour).save(out / image)
            f.write(json.dumps(row(image, shape, colour)) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Write the training and held-out sets (deterministic: seeds 0 and 1)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/vision/shapes", help="output folder (default runs/vision/shapes)")
    p.add_argument("--train", type=int, default=480, help="training rows (default 480)")
    p.add_argument("--eval", type=int, default=96, help="held-out rows (default 96)")
    args = p.parse_args(argv)
    out = Path(args.out)
    write(out, "train", args.train, seed=0)
    write(out, "eval", args.eval, seed=1)
    print(f"wrote {args.train} training and {args.eval} held-out rows in {out}")


if __name__ == "__main__":
    main()
