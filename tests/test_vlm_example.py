"""The vision example (examples/vision/): its data script, `zoo init --language-model` (a vision-language model
assembled from a text checkpoint: convert/vision_init.py), a tiny version of its training and its scoring script,
end to end on the session's tiny LM (tests/tiny_lm.py) in place of SmolLM2-135M.

The assembled model is checked against transformers: its exported folder loads as SmolVLMForConditionalGeneration
and gives the zoo's logits on a row with an image, and the tokenizer's template writes image parts where the text
model's template wrote the text."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo.cli import main as zoo_main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vision"
sys.path.insert(0, str(EXAMPLE))  # the example's scripts, imported as its README runs them

import evaluate  # noqa: E402
import make_shapes  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_lm):
    """The example's data (12 training rows, 4 held-out) and the tiny LM with the example's tower (``base``)."""
    root = tmp_path_factory.mktemp("vlm_example")
    shutil.copytree(tiny_lm / "zoo", root / "lm" / "zoo")
    shutil.copytree(tiny_lm / "tok", root / "lm" / "zoo" / "tokenizer", dirs_exist_ok=True)  # as `zoo convert` puts it
    make_shapes.main(["--out", str(root / "shapes"), "--train", "12", "--eval", "4"])
    assert zoo_main(["init", str(EXAMPLE / "smolvlm_tower.json"), "--language-model", str(root / "lm" / "zoo"),
                     "--out", str(root / "base"), "--seed", "3"]) == 0
    return SimpleNamespace(root=root, lm=root / "lm" / "zoo", base=root / "base")


def test_data_script_is_deterministic_and_in_trls_vision_format(built, tmp_path):
    """The rows: TRL's vision format, an answer naming the drawn colour and shape, the pictures 48 px RGB with
    that colour in them, written again identically."""
    from PIL import Image

    rows = [json.loads(line) for line in (built.root / "shapes" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["messages"][1]["content"] for r in rows} == {
        f"a {c} {s}" for s in make_shapes.SHAPES for c in make_shapes.COLOURS}
    for r in rows:
        assert r["messages"][0]["content"][0] == {"type": "image"} and len(r["images"]) == 1
        pixels = np.asarray(Image.open(built.root / "shapes" / r["images"][0]))
        assert pixels.shape == (48, 48, 3)
        colour = np.asarray(make_shapes.COLOURS[r["messages"][1]["content"].split()[1]])
        assert (np.abs(pixels.astype(int) - colour).max(-1) <= 20).sum() >= 100  # the shape, 14 px across at least
    make_shapes.main(["--out", str(tmp_path), "--train", "12", "--eval", "4"])
    for f in ("train.jsonl", "eval.jsonl", "images/train_0005.png", "images/eval_0003.png"):
        assert (tmp_path / f).read_bytes() == (built.root / "shapes" / f).read_bytes()


def test_init_keeps_the_language_model_and_adds_the_image_tokens(built):
    """The text checkpoint's weights unchanged (the embedding's new rows the mean of the old), the tokenizer's
    image tokens at those rows, and its template rendering image parts as <image> around the text model's turns."""
    from zoo.data.tokenizer import load_tokenizer

    text, vlm = zoo.load_params(built.lm), zoo.load_params(built.base)
    old = np.asarray(text["embed"])
    new = np.asarray(vlm["embed"])
    np.testing.assert_array_equal(new[:len(old)], old)
    np.testing.assert_allclose(new[len(old):], np.broadcast_to(old.mean(0), new[len(old):].shape), rtol=1e-6)
    for a, b in zip(jax_leaves(text["layers"]), jax_leaves(vlm["layers"])):
        np.testing.assert_array_equal(a, b)
    tok, lm_tok = load_tokenizer(built.base), load_tokenizer(built.lm)
    ids = tok.convert_tokens_to_ids(["<fake_token_around_image>", "<image>", "<global-img>"])
    assert sorted(ids) == list(range(len(old), len(new)))
    assert zoo.read_config(built.base).vision.image_token_id == ids[1]
    row = make_shapes.row("a.png", "circle", "red")["messages"]
    flat = [{"role": "user", "content": "<image>" + make_shapes.QUESTION}, row[1]]
    assert tok.apply_chat_template(row, tokenize=False) == lm_tok.apply_chat_template(flat, tokenize=False)


def jax_leaves(tree) -> list[np.ndarray]:
    """The arrays of a parameter tree, in a fixed order."""
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_assembled_model_exports_as_transformers_smolvlm(built, tmp_path):
    """The exported folder loads in transformers (SmolVLMForConditionalGeneration) and its logits on a held-out
    row with its picture (the zoo's ids and pixels) equal the zoo's (1e-4)."""
    import torch
    from transformers import AutoModelForImageTextToText

    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images
    from eval.engine.images import vision_inputs
    from zoo.data.tokenizer import load_tokenizer

    assert zoo_main(["export", str(built.base), "--out", str(tmp_path / "hf")]) == 0
    hf = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "SmolVLMForConditionalGeneration"
    tok = load_tokenizer(built.base)
    row = json.loads((built.root / "shapes" / "eval.jsonl").read_text().splitlines()[2])
    t = tokenize_with_images(normalize(row, "messages"), tok,
                             ImageExpander.from_folder(built.base / "tokenizer", tok), built.root / "shapes")
    (image,) = t.images
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(t.ids[None], dtype=torch.long),
                 pixel_values=torch.tensor(image.pixel_values[None]),
                 pixel_attention_mask=torch.tensor(image.pixel_attention_mask[None].astype(bool))).logits.numpy()
    model = zoo.load(built.base, dtype=np.float32)
    got = np.asarray(model(jnp.asarray(t.ids[None], jnp.int32), vision=vision_inputs(model.cfg, [image.frames()])))
    assert np.abs(got - ref).max() <= 1e-4


def test_init_refuses_a_config_without_a_tower_and_a_vision_model(built, tmp_path, capsys):
    """One line each, exit 2, nothing written: a CONFIG with no vision_config, a --language-model that has an image
    tower already."""
    (tmp_path / "text.json").write_text(json.dumps({"model_type": "smolvlm", "scale_factor": 2}))
    for config, lm, says in ((tmp_path / "text.json", built.lm, "has no vision_config"),
                             (EXAMPLE / "smolvlm_tower.json", built.base, "has an image tower already")):
        assert zoo_main(["init", str(config), "--language-model", str(lm), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0], err
        assert not (tmp_path / "out").exists()


def test_scoring_reads_the_first_colour_and_shape_named():
    """The example's scorer: exact answers, and the first colour / shape word of a longer one."""
    assert evaluate.score("a red circle", "a red circle") == {"exact": True, "colour": True, "shape": True}
    assert evaluate.score("A blue circle.", "a red circle") == {"exact": False, "colour": False, "shape": True}
    assert evaluate.score("It is a red square, not a blue circle", "a red circle") == {
        "exact": False, "colour": True, "shape": False}
    assert evaluate.score("I cannot see images", "a red circle") == {"exact": False, "colour": False, "shape": False}


@pytest.mark.slow
def test_example_trains_and_scores_end_to_end(built, tmp_path):
    """Slow: a training run (its compilation) and a batch of greedy answers. The example's config, smaller by
    overrides (2 steps of 4 rows), trains the assembled model on the example's data; the scoring script answers
    the held-out pictures and writes its accuracies."""
    from sft.cli import main as sft_main
    from tests.run_files import read_metrics

    out = tmp_path / "run"
    assert sft_main(["train", "--config", str(EXAMPLE / "shapes_sft.yaml"), f"model.path={built.base}",
                     f"data.path={built.root / 'shapes' / 'train.jsonl'}", "max_steps=2", "batch_size=4", "data.seq_len=128",
                     "schedule.warmup_steps=0", f"output_dir={out}"]) == 0
    metrics = read_metrics(out)
    assert metrics and all(np.isfinite(m["loss"]) for m in metrics)
    acc = evaluate.main([str(out / "final"), "--data", str(built.root / "shapes" / "eval.jsonl"), "--max-new-tokens",
                         "4", "--out", str(tmp_path / "acc.json")])
    written = json.loads((tmp_path / "acc.json").read_text())
    assert written["accuracy"] == acc and len(written["answers"]) == 4
    assert written["targets"] == ["a red circle", "a green circle", "a blue circle", "a yellow circle"]
    shutil.rmtree(out)
