"""Held-out accuracy of a vision-language checkpoint on the shapes task (make_shapes.py's eval.jsonl).

Each row's question and picture are put to the model as `zoo generate CKPT --prompt QUESTION --image PICTURE`
puts them (chat/images.py's ``prompt_ids``: the image part before the text, expanded as the processor does), the
answer is decoded greedily, and it is scored three ways: the exact answer (``a red circle``), the colour alone and
the shape alone (the first colour and the first shape word the answer names).

    python examples/vision/evaluate.py CKPT [--data runs/vision/shapes/eval.jsonl] [--limit N] [--show 4]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import numpy as np

COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")


def first_word(text: str, words: tuple[str, ...]) -> str | None:
    """The first of ``words`` that ``text`` names (as a whole word), or None."""
    found = [(m.start(), w) for w in words for m in [re.search(rf"\b{w}\b", text.lower())] if m]
    return min(found)[1] if found else None


def score(answer: str, target: str) -> dict[str, bool]:
    """Exact, colour and shape correctness of one ``answer`` against its ``target`` (``a red circle``)."""
    return {"exact": answer.strip().lower().rstrip(".") == target,
            "colour": first_word(answer, COLOURS) == first_word(target, COLOURS),
            "shape": first_word(answer, SHAPES) == first_word(target, SHAPES)}


def answers(ckpt: str, rows: list[dict[str, Any]], base: Path, batch_size: int, max_new_tokens: int) -> list[str]:
    """The model's greedy answer to each row's user turn (its question and picture)."""
    import zoo
    from chat.images import ImageExpander
    from eval.generate import GenerationConfig, generate
    from zoo.data.tokenizer import load_tokenizer, tokenizer_dir

    tok = load_tokenizer(ckpt)
    expander = ImageExpander.from_folder(tokenizer_dir(ckpt), tok)
    model = zoo.load(ckpt, dtype=np.float32)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, eos_ids=(int(tok.eos_token_id),))
    out: list[str] = []
    for start in range(0, len(rows), batch_size):
        prompts, frames = [], []
        for r in rows[start:start + batch_size]:
            question = next(p["text"] for p in r["messages"][0]["content"] if p["type"] == "text")
            ids, images = expander.prompt_ids(tok, question, None, r["images"], base, "images")
            prompts.append(ids)
            frames.append([f for image in images for f in image.patches(model.cfg.vision)])  # any family
        new = generate(model.cfg, model.param_dict(), prompts, gen, frames=frames)
        out += [tok.decode(t, skip_special_tokens=True).strip() for t in new]
    return out


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Print (and return) the held-out accuracies of CKPT; ``--out`` writes them, with every answer, as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ckpt", metavar="CKPT", help="a zoo checkpoint (a run's final/ folder, or zoo init's)")
    p.add_argument("--data", default="runs/vision/shapes/eval.jsonl", help="held-out rows (make_shapes.py)")
    p.add_argument("--limit", type=int, default=0, help="score only the first N rows (default: all)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts decoded together (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=12, help="answer length limit (default 12)")
    p.add_argument("--show", type=int, default=4, help="answers to print (default 4)")
    p.add_argument("--out", help="write the accuracies and answers to this JSON file")
    args = p.parse_args(argv)
    data = Path(args.data)
    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    rows = rows[:args.limit] if args.limit else rows
    got = answers(args.ckpt, rows, data.parent, args.batch_size, args.max_new_tokens)
    targets = [r["messages"][1]["content"] for r in rows]
    scores = [score(a, t) for a, t in zip(got, targets)]
    acc = {k: sum(s[k] for s in scores) / len(scores) for k in ("exact", "colour", "shape")}
    for a, t in list(zip(got, targets))[:args.show]:
        print(f"  want {t!r:20} got {a!r}")
    print(f"{args.ckpt}: {len(rows)} held-out pictures: exact {acc['exact']:.1%}, colour {acc['colour']:.1%}, "
          f"shape {acc['shape']:.1%}")
    if args.out:
        Path(args.out).write_text(json.dumps({"accuracy": acc, "answers": got, "targets": targets}, indent=1) + "\n")
    return acc


if __name__ == "__main__":
    main()
