"""`sft train` with images on a tiny SmolVLM (tests/vlm_models.py) and its processor (tests/vlm_processors.py): step 1's
loss equals transformers' on the same ids and pixels, ``model.freeze`` keeps the tower and connector as they were,
an eval set with images and a data mixture of image and text rows score transformers' loss, and rows whose images
cannot be trained are one line naming the row, exit 2, before step 1."""

from __future__ import annotations

import itertools
import json
import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import zoo
from pretrain.config import load_config
from pretrain.loop import train
from sft.cli import main as sft_main
from sft.config import SFTConfig
from sft.task import SFTTask
from tests.run_files import one_line_error, read_metrics, write_jsonl
from tests.vlm_models import make_vlm
from tests.vlm_processors import smolvlm_folder, write_images
from zoo.cli import main as zoo_main

QUESTION = "What is in this picture?"
ANSWERS = ["It is a red square.", "It is a blue circle."]


def _row(answer: str, image: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": answer}], "images": [image]}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random SmolVLM converted at ``zoo`` with the tiny SmolVLM tokenizer and image processor in its
    ``tokenizer/`` folder, transformers' model (``hf``), two image rows (``data.jsonl``) and the tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_sft")
    proc = smolvlm_folder(root / "proc", splitting=False)
    tok = AutoTokenizer.from_pretrained(str(proc))
    hf = make_vlm(root / "hf", vocab_size=len(tok), image_token_id=tok.convert_tokens_to_ids("<image>"))
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    # The image processor's files beside the checkpoint's tokenizer, where `zoo convert` will put them.
    for f in proc.iterdir():
        shutil.copy(f, root / "zoo" / "tokenizer" / f.name)
    names = write_images(root, [(28, 28), (20, 28)])
    write_jsonl(root / "data.jsonl", [_row(a, n) for a, n in zip(ANSWERS, names)])
    return SimpleNamespace(root=root, tok=tok, hf=hf)


def _cfg(vlm, out, *overrides):
    return load_config(None, [f"model.path={vlm.root / 'zoo'}", f"data.path={vlm.root / 'data.jsonl'}",
                              "data.seq_len=64", "data.packing=false", "batch_size=2", "optimizer.learning_rate=0.01",
                              "schedule.name=constant", "log_every=1", "checkpoint.every=100",
                              f"output_dir={out}", *overrides], SFTConfig)


def _hf_loss(vlm) -> float:
    """transformers' mean next-token cross-entropy over both rows: the zoo's own ids and pixels
    (chat/images.py, equal to the processor's: tests/test_vlm_data.py), labels -100 wherever the zoo trains
    nothing (image tokens included)."""
    import torch

    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images

    expander = ImageExpander.from_folder(vlm.root / "zoo" / "tokenizer", vlm.tok)
    total, count = 0.0, 0
    for line in (vlm.root / "data.jsonl").read_text().splitlines():
        t = tokenize_with_images(normalize(json.loads(line), "messages"), vlm.tok, expander, vlm.root)
        labels = np.where(t.mask, t.ids, -100)
        (image,) = t.images
        with torch.no_grad():
            out = vlm.hf(input_ids=torch.tensor(t.ids[None], dtype=torch.long),
                         pixel_values=torch.tensor(image.pixel_values[None]),
                         pixel_attention_mask=torch.tensor(image.pixel_attention_mask[None].astype(bool)),
                         labels=torch.tensor(labels[None], dtype=torch.long))
        n = int((labels[1:] != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    return total / count


def _parts(params) -> dict[str, list[np.ndarray]]:
    return {k: [np.asarray(x) for x in jax.tree.leaves(params[k])] for k in ("vision", "projector", "layers")}


def _changed(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_step_1_loss_is_transformers_and_full_fine_tuning_moves_the_tower(vlm, tmp_path):
    """Slow: two training runs, each compiling its step. Full fine-tuning: step 1's loss is transformers' (1e-5),
    and the step changes the tower and the connector; with model.freeze they stay bit-identical while the
    language model moves."""
    before = _parts(zoo.load_params(vlm.root / "zoo"))
    cfg = _cfg(vlm, tmp_path / "full", "max_steps=1")
    after = _parts(zoo.load_params(train(cfg, progress=False, task=SFTTask(cfg))))
    assert abs(read_metrics(tmp_path / "full")[0]["loss"] - _hf_loss(vlm)) <= 1e-5
    assert all(_changed(before[k], after[k]) for k in before)
    cfg = _cfg(vlm, tmp_path / "frozen", "max_steps=1", "model.freeze=[vision,projector]")
    frozen = _parts(zoo.load_params(train(cfg, progress=False, task=SFTTask(cfg))))
    assert not _changed(before["vision"], frozen["vision"]) and not _changed(before["projector"], frozen["projector"])
    assert _changed(before["layers"], frozen["layers"])


@pytest.mark.slow
def test_packed_rows_keep_each_image_with_its_text(vlm, tmp_path):
    """Slow: a training run of its own. Both rows packed into one (data.max_patches: both images' patches): step
    1's loss is still transformers' over the two rows apart."""
    cfg = _cfg(vlm, tmp_path / "packed", "max_steps=1", "data.packing=true", "batch_size=1", "data.max_patches=32",
               "data.seq_len=96")
    task = SFTTask(cfg)
    train(cfg, progress=False, task=task)
    assert abs(read_metrics(tmp_path / "packed")[0]["loss"] - _hf_loss(vlm)) <= 1e-5


@pytest.mark.slow
def test_lora_with_frozen_tower_trains_the_adapters_alone(vlm, tmp_path):
    """Slow: a 3-step LoRA run (its own compilation). The tower and connector are bit-identical after, the
    adapters (language model only) moved from their zero start."""
    from zoo.checkpoints.adapter import load_adapters
    from zoo.checkpoints.format import read_meta

    cfg = _cfg(vlm, tmp_path / "lora", "max_steps=3", "lora.rank=4", "lora.alpha=8",
               "model.freeze=[vision,projector]")
    final = train(cfg, progress=False, task=SFTTask(cfg))
    meta = read_meta(final)
    assert all(not k.startswith(("vision", "projector")) for k in meta["lora"]["params"])
    b = [np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(load_adapters(final, meta))
         if getattr(path[-1], "key", None) == "b"]
    assert b and all(np.abs(x).max() > 0 for x in b)  # every B starts at zero
    before, after = _parts(zoo.load_params(vlm.root / "zoo")), _parts(zoo.load_params(final))  # the merged adapters' base
    assert not _changed(before["vision"], after["vision"]) and not _changed(before["projector"], after["projector"])


def _one_line_error(capsys, args) -> str:
    return one_line_error(capsys, sft_main, ["train", *args])


def test_bad_image_rows_are_one_line_naming_the_row(vlm, tmp_path, capsys):
    """Exit 2, one line, before step 1: naming the file and line, an image past data.seq_len, more patches than
    data.max_patches, and images on a model with no vision tower; naming the folder, a checkpoint without its
    image processor. (An eval set and a data mixture with images train: see the eval set test below.)"""
    data = str(vlm.root / "data.jsonl")
    common = [f"model.path={vlm.root / 'zoo'}", f"data.path={data}", "data.packing=false", "batch_size=1",
              "max_steps=1", f"output_dir={tmp_path / 'o'}"]
    err = _one_line_error(capsys, [*common, "data.seq_len=8"])
    assert err.startswith(f"{data}, line 1: image 1 ends at token ") and "past data.seq_len = 8" in err
    err = _one_line_error(capsys, [*common, "data.seq_len=64", "data.max_patches=8"])
    assert err.startswith(f"{data}, line 1: its 1 image(s) make 1 frame(s) of 16 patches in all, more than "
                          "data.max_patches = 8")
    bare = tmp_path / "bare"  # the checkpoint without its image processor's files
    shutil.copytree(vlm.root / "zoo", bare)
    for name in ("preprocessor_config.json", "processor_config.json"):
        (bare / "tokenizer" / name).unlink()
    err = _one_line_error(capsys, [*common[1:], f"model.path={bare}", "data.seq_len=64"])
    assert err.startswith(f"{bare / 'tokenizer'}: no image processor could be loaded") and \
        err.endswith("copy the model's preprocessor_config.json (or processor_config.json) into it")
    # Several processes (each reading its own rows) must agree on the patch budget: it is then set, not derived.
    import chat.image_documents

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chat.image_documents, "_processes", lambda: 2)
        err = _one_line_error(capsys, [*common, "data.seq_len=64"])
    assert err == f"{data}, line 1: a run of several processes with images needs data.max_patches (this row needs " \
        "16); set it to the largest row's patches, the same everywhere"
    text_only = tmp_path / "text_only"
    _text_model(text_only, vlm)
    capsys.readouterr()  # the conversion's own output
    err = _one_line_error(capsys, [*common[1:], f"model.path={text_only}", "data.seq_len=64"])
    assert err.startswith(f"{data}, line 1: the row has images, and the model {text_only} has no vision tower")


def _text_model(folder, vlm) -> None:
    """A tiny random text-only Llama of the tokenizer's vocabulary, converted at ``folder`` with the tokenizer."""
    from tests.hf_models import make_hf

    make_hf(vlm.root / "hf_text", "llama", vocab_size=len(vlm.tok))
    vlm.tok.save_pretrained(str(vlm.root / "hf_text"))
    assert zoo_main(["convert", str(vlm.root / "hf_text"), "--out", str(folder)]) == 0


def test_frozen_parts_get_no_moments_and_no_updates():
    """model.freeze: the optimizer holds one number a frozen weight, not its moments, and updates it by zero while
    the rest trains as the plain optimizer trains it (the clip's norm counts the trained weights alone)."""
    import jax.numpy as jnp

    from pretrain.optim import build_optimizer

    params = {"vision": {"w": jnp.full((4, 3), 2.0)}, "projector": {"proj": jnp.ones((3, 2))},
              "layers": {"q": jnp.ones((2, 2))}}
    grads = jax.tree.map(jnp.ones_like, params)
    base = ["model.path=m", "data.path=d", "max_steps=1", "optimizer.grad_clip=1.0"]
    plain = build_optimizer(load_config(None, base), 0.1)
    frozen = build_optimizer(load_config(None, [*base, "model.freeze=[vision,projector]"]), 0.1)
    state = frozen.init(params)
    shapes = {jax.tree_util.keystr(path): x.shape for path, x in jax.tree_util.tree_leaves_with_path(state)}
    # adamw after the clip: its moments, one number each of the frozen weights'
    assert shapes == {"[1][0].count": (), **{f"[1][0].{m}['{p}']['{w}']": shape for m in ("mu", "nu")
                                             for p, w, shape in [("layers", "q", (2, 2)), ("projector", "proj", (1,)),
                                                                 ("vision", "w", (1,))]}}
    updates, _ = frozen.update(grads, state, params)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves({k: updates[k] for k in ("vision", "projector")}))
    want, _ = plain.update({"layers": grads["layers"]}, plain.init({"layers": params["layers"]}),
                           {"layers": params["layers"]})
    np.testing.assert_allclose(updates["layers"]["q"], want["layers"]["q"], rtol=1e-6)


def test_inspect_shows_the_rows_images_as_markers(vlm, capsys):
    """`sft inspect` on rows with images: each image one untrained marker, the answer trained."""
    assert sft_main(["inspect", f"model.path={vlm.root / 'zoo'}", f"data.path={vlm.root / 'data.jsonl'}",
                     "data.seq_len=64", "max_steps=1", "-n", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    # <fake_token_around_image><global-img>, 4 <image> (image_seq_len), <fake_token_around_image>
    assert f"User:⟨image 1: 7 tokens⟩{QUESTION}" in out and ("[[ " + ANSWERS[0]) in out


def test_a_document_packed_twice_into_a_row_keeps_its_images_twice():
    """Packing may put one document twice into a row (a small dataset over several epochs): each copy's image tokens
    read its own copy of the images, so the row lists the document once a segment, not once a tag."""
    from chat.image_documents import row_documents

    tags = np.array([3, 3, 3, 3, 0, 5, 5, 0])
    segments = np.array([1, 1, 2, 2, 3, 4, 4, 0])  # document 3 in segments 1 and 2, a text row, document 5
    assert row_documents(tags, segments) == [3, 3, 5]
    assert row_documents(tags, None) == [3, 5]  # an unpacked row: one document, however long


def _doc_losses(vlm, path) -> list[tuple[float, int]]:
    """transformers' (summed next-token loss, targets) of each row of ``path``: the zoo's own ids and pixels
    (chat/images.py, equal to the processor's: tests/test_vlm_data.py), labels -100 wherever the zoo trains
    nothing; a row without images reads no pixels."""
    import torch

    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images
    from chat.loss_masks import tokenize_indexed

    expander = ImageExpander.from_folder(vlm.root / "zoo" / "tokenizer", vlm.tok)
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        pixels = {}
        if "images" in row:
            t = tokenize_with_images(normalize(row, "messages"), vlm.tok, expander, path.parent)
            ids, mask = t.ids, t.mask
            (image,) = t.images
            pixels = {"pixel_values": torch.tensor(image.pixel_values[None]),
                      "pixel_attention_mask": torch.tensor(image.pixel_attention_mask[None].astype(bool))}
        else:
            ((ids, mask),) = tokenize_indexed([(i, row)], "messages", vlm.tok, None, str(path), False)[0].values()
        labels = np.where(mask, ids, -100)
        with torch.no_grad():
            loss = vlm.hf(input_ids=torch.tensor(ids[None], dtype=torch.long),
                          labels=torch.tensor(labels[None], dtype=torch.long), **pixels).loss
        n = int((labels[1:] != -100).sum())
        out.append((float(loss) * n, n))
    return out


def _mean(docs) -> float:
    return sum(s for s, _ in docs) / sum(n for _, n in docs)


@pytest.mark.slow
def test_eval_set_and_mixture_with_images_are_transformers_loss(vlm, tmp_path):
    """One 2-step run (learning rate 0: the weights stay transformers'), data.path a mixture of the two image rows
    and two text rows, data.eval_path two more image rows with images of their own (same file names, another
    folder: their rows' tags must not be the training rows'). Checks: the eval loss is transformers' over the eval
    rows with their images (1e-5); each step's loss is transformers' over the batch's two rows (one a lane, each
    row with its own images or none), and the two steps drew both image and text rows.
    Slow (slow lane): about 6.8 s on a quiet 2-core machine (a run with images and its eval step compiled)."""
    root = tmp_path
    write_jsonl(root / "text.jsonl", [{"messages": [{"role": "user", "content": QUESTION},
                                                    {"role": "assistant", "content": a}]} for a in ANSWERS])
    (root / "ev").mkdir()
    names = write_images(root / "ev", [(28, 20), (28, 28)], seed=1)
    write_jsonl(root / "ev" / "eval.jsonl", [_row(a, n) for a, n in zip(ANSWERS[::-1], names)])
    mixture = (f"data.path=[{{path: {vlm.root / 'data.jsonl'}, weight: 1}}, "
               f"{{path: {root / 'text.jsonl'}, weight: 1}}]")
    cfg = _cfg(vlm, root / "out", mixture, f"data.eval_path={root / 'ev' / 'eval.jsonl'}", "max_steps=2",
               "eval_every=2", "optimizer.learning_rate=0")
    train(cfg, progress=False, task=SFTTask(cfg))
    records = read_metrics(root / "out")
    assert abs(records[-1]["eval_loss"] - _mean(_doc_losses(vlm, root / "ev" / "eval.jsonl"))) <= 1e-5
    images, text = _doc_losses(vlm, vlm.root / "data.jsonl"), _doc_losses(vlm, root / "text.jsonl")
    rows = [("image", x) for x in images] + [("text", x) for x in text]
    drawn = set()
    for r in records[:2]:  # each lane holds one image row and one text row: which of them a step drew is grain's
        pairs = [(a, b) for a, b in itertools.combinations_with_replacement(rows, 2)
                 if abs(r["loss"] - _mean([a[1], b[1]])) <= 1e-5]
        assert pairs, r["loss"]
        drawn |= {kind for pair in pairs for kind, _ in pair}
    assert drawn == {"image", "text"}
