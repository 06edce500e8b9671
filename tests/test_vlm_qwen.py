"""Qwen2.5-VL against transformers: the host-side patch places and multimodal positions, the windowed tower's image
features on images of different sizes in one batch, image+text logits, and the HF -> zoo -> HF round trip, from a
`zoo convert`ed tiny random Qwen2_5_VLForConditionalGeneration."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import hf_logits, mean_kl, random_tokens
from tests.vlm_models import assert_export_round_trip
from tests.vlm_qwen_models import (
    IMAGE_TOKEN,
    assert_rows_expand_as_processor,
    hf_image_features,
    hf_image_reply,
    hf_qwen_logits,
    make_qwen,
    qwen_row,
    random_image,
)
from zoo.cli import main
from zoo.data.qwen_layout import block_places, qwen_image_patches
from zoo.data.vision_layout import layout_rows
from zoo.model.mrope import mrope_positions
from zoo.model.vision import VisionInputs, encode_images

# Three images of different sizes (rows x columns of 4-pixel patches): 6 x 8 and 10 x 6 span several 4 x 4-patch
# windows, the last ones cut short at the bottom and right; 4 x 4 is one window.
IMAGES = [random_image(0, 6, 8), random_image(1, 4, 4), random_image(2, 10, 6)]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(transformers' tiny Qwen2.5-VL, its `zoo convert`ed checkpoint folder)."""
    root = tmp_path_factory.mktemp("qwen2_5_vl")
    model = make_qwen(root / "hf")
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    return model, root / "zoo"


def _inputs(v, rows, max_patches: int = 72) -> VisionInputs:
    """The batch's VisionInputs of rows of images ((pixel_values, grid) each)."""
    laid = [[qwen_image_patches(v, pixels, grid) for pixels, grid in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, laid, max_patches).items()})


def test_patch_places_equal_transformers():
    """Each patch's (row, column), in the processor's block-major order, is the tower's own position id."""
    from transformers.vision_utils import get_vision_position_ids

    grids = [(1, 6, 8), (1, 4, 4), (1, 10, 6)]
    ref = get_vision_position_ids(torch.tensor(grids), 2).numpy()
    got = np.concatenate([np.stack(block_places(h, w, 2), -1) for _, h, w in grids])
    np.testing.assert_array_equal(got, ref)


def test_mrope_positions_equal_get_rope_index(qwen):
    """The language model's [3, b, t] positions, computed on the device from 1-D positions and the images, against
    transformers' get_rope_index of each document: a row with two images, and a row packing two documents (the
    positions restart, and the second document's image shifts only its own text)."""
    hf, ckpt = qwen
    v = zoo.read_config(ckpt).vision
    (_, g0), (_, g1), (_, g2) = IMAGES
    docs = [[(qwen_row(40, [(3, g0), (20, g1)], seed=3), [g0, g1])],
            [(qwen_row(16, [(3, g1)], seed=4), [g1]), (qwen_row(24, [(3, g2)], seed=5), [g2])]]
    refs = []
    for row in docs:
        parts = []
        for ids, grids in row:
            ids = torch.tensor(ids[None], dtype=torch.long)
            parts.append(hf.model.get_rope_index(ids, (ids == IMAGE_TOKEN).int(), torch.tensor(grids))[0].numpy())
        refs.append(np.concatenate(parts, axis=2))
    tokens = np.stack([np.concatenate([ids for ids, _ in row]) for row in docs])
    positions = np.stack([np.arange(40), np.concatenate([np.arange(16), np.arange(24)])]).astype(np.int32)
    vision = _inputs(v, [IMAGES[:2], IMAGES[1:]], max_patches=80)
    got = jax.jit(mrope_positions, static_argnums=0)(v, jnp.asarray(tokens), jnp.asarray(positions), vision)
    np.testing.assert_array_equal(np.asarray(got), np.concatenate(refs, axis=1))


def test_image_features_equal_transformers(qwen):
    """Two rows, the first with two images: each image attends within itself (its windows), as transformers' tower
    run on the three images at once."""
    hf, ckpt = qwen
    cfg, params = zoo.read_config(ckpt), zoo.load_params(ckpt)
    ref = hf_image_features(hf, IMAGES)
    got = np.asarray(jax.jit(encode_images, static_argnums=0)(cfg, params, _inputs(cfg.vision, [IMAGES[:2], IMAGES[2:]])))
    assert got.shape == (2, 18, 64)
    assert np.abs(got[0, :12] - ref[0]).max() <= 1e-4 and np.abs(got[0, 12:16] - ref[1]).max() <= 1e-4
    assert np.abs(got[1, :15] - ref[2]).max() <= 1e-4
    assert min(r.std() for r in ref) > 0.1


def test_image_text_logits_equal_transformers(qwen):
    """Two rows with images and text between them (the multimodal positions the forward's own)."""
    hf, ckpt = qwen
    grids = [g for _, g in IMAGES]
    rows = [qwen_row(40, [(3, grids[0]), (20, grids[1])], seed=3), qwen_row(40, [(10, grids[2])], seed=4)]
    ref = hf_qwen_logits(hf, np.stack(rows), IMAGES)
    model = zoo.load(ckpt)
    got = np.asarray(model(jnp.asarray(np.stack(rows)), vision=_inputs(model.cfg.vision, [IMAGES[:2], IMAGES[2:]])))
    assert np.abs(got - ref).max() <= 1e-4
    assert mean_kl(ref, got) <= 1e-6
    assert ref.std() > 0.5


def test_text_rows_without_images_equal_transformers(qwen):
    """Text alone (no vision arrays, 1-D positions driving all three RoPE axes) as transformers reads it."""
    hf, ckpt = qwen
    tokens = random_tokens(92, seq=16)  # never a vision token
    ref = hf_logits(hf, tokens)
    got = np.asarray(zoo.load(ckpt)(jnp.asarray(tokens)))
    assert np.abs(got - ref).max() <= 1e-4 and mean_kl(ref, got) <= 1e-6


def test_round_trip_is_bit_identical(qwen, tmp_path):
    """HF -> zoo -> HF gives back every tensor (tower and merger included), bit for bit, and the config, which
    transformers loads."""
    hf, ckpt = qwen
    assert_export_round_trip(hf, ckpt, tmp_path / "back")


def test_released_configs():
    """The registry's Qwen2.5-VL configs read as the published models: their total parameter counts as the Hub
    lists them (3.75B, 8.29B, 73.4B: tower and merger included), and the tower's layout."""
    from zoo.model.from_hf import model_config_from_hf
    from zoo.model.params import count_params
    from zoo.registry.catalogue import get

    cfgs = {size: model_config_from_hf(get(f"qwen2.5-vl-{size}").hf_config) for size in ("3b", "7b", "72b")}
    assert [round(count_params(cfgs[s]) / 1e9, 2) for s in ("3b", "7b")] == [3.75, 8.29]
    assert round(count_params(cfgs["72b"]) / 1e9, 1) == 73.4
    v = cfgs["7b"].vision
    assert (v.num_layers, v.fullatt_layers, v.window_patches, v.patch_dim) == (32, (7, 15, 23, 31), 8, 1176)
    assert cfgs["7b"].rope.mrope_section == (16, 24, 24) and cfgs["3b"].tie_word_embeddings
    assert get("qwen2.5-vl-7b").hf_repo == "Qwen/Qwen2.5-VL-7B-Instruct"


QUESTION, ANSWERS = "What is in this picture?", ["It is a red square.", "It is a blue circle."]


@pytest.fixture(scope="module")
def qwen_sft(tmp_path_factory):
    """A tiny Qwen2.5-VL converted at ``zoo`` with the tiny Qwen tokenizer and image processor in its ``tokenizer/``
    folder, transformers' model (``hf``), two rows with images of different sizes (``data.jsonl``), the tokenizer."""
    import shutil
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from tests.run_files import write_jsonl
    from tests.vlm_processors import write_images
    from tests.vlm_qwen_models import qwen_folder, qwen_token_ids

    root = tmp_path_factory.mktemp("qwen_sft")
    proc = qwen_folder(root / "proc")
    tok = AutoTokenizer.from_pretrained(str(proc))
    hf = make_qwen(root / "hf", **qwen_token_ids(tok))
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    for f in proc.iterdir():  # where `zoo convert` puts a source's processor files
        shutil.copy(f, root / "zoo" / "tokenizer" / f.name)
    names = write_images(root, [(30, 45), (20, 20)])  # 8 x 6 patches (12 tokens), 4 x 4 (4)
    write_jsonl(root / "data.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                      {"role": "assistant", "content": answer}], "images": [name]}
        for answer, name in zip(ANSWERS, names, strict=True)])
    return SimpleNamespace(root=root, tok=tok, hf=hf)


def test_rows_expand_as_the_processor_does(qwen_sft):
    """A conversation with two images: the ids are the tokenized text with each <|image_pad|> replaced as
    Qwen2_5_VLProcessor.replace_image_token replaces it, the pixels and grids the image processor's, and the image
    tokens untrained."""
    from transformers import Qwen2_5_VLProcessor

    assert_rows_expand_as_processor(qwen_sft.root, qwen_sft.root / "zoo" / "tokenizer", qwen_sft.tok,
                                    Qwen2_5_VLProcessor, QUESTION, ANSWERS[0])


def _hf_sft_loss(qwen_sft) -> float:
    """transformers' mean next-token cross-entropy over both rows: the zoo's ids and pixels (equal to the
    processor's: test_rows_expand_as_the_processor_does), labels -100 wherever the zoo trains nothing."""
    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images

    tok, hf = qwen_sft.tok, qwen_sft.hf
    expander = ImageExpander.from_folder(qwen_sft.root / "zoo" / "tokenizer", tok)
    total, count = 0.0, 0
    for line in (qwen_sft.root / "data.jsonl").read_text().splitlines():
        t = tokenize_with_images(normalize(json.loads(line), "messages"), tok, expander, qwen_sft.root)
        labels = np.where(t.mask, t.ids, -100)
        (image,) = t.images
        ids = torch.tensor(t.ids[None], dtype=torch.long)
        with torch.no_grad():
            out = hf(input_ids=ids, pixel_values=torch.tensor(image.pixel_values),
                     image_grid_thw=torch.tensor([image.grid_thw]), mm_token_type_ids=(ids == hf.config.image_token_id).int(),
                     labels=torch.tensor(labels[None], dtype=torch.long))
        n = int((labels[1:] != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    return total / count


@pytest.mark.slow
def test_packed_sft_step_loss_is_transformers(qwen_sft, tmp_path):
    """Slow: a training run. Both rows (72 and 64 tokens) packed into one row (their images' 48 + 16 patches in
    data.max_patches): step 1's loss is transformers' over the two rows apart, each document's multimodal
    positions its own."""
    from pretrain.config import load_config
    from pretrain.loop import train
    from sft.config import SFTConfig
    from sft.task import SFTTask
    from tests.run_files import read_metrics

    cfg = load_config(None, [f"model.path={qwen_sft.root / 'zoo'}", f"data.path={qwen_sft.root / 'data.jsonl'}",
                             "data.seq_len=144", "data.packing=true", "data.max_patches=64", "batch_size=1",
                             "max_steps=1", "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
                             "checkpoint.every=100", f"output_dir={tmp_path}"], SFTConfig)
    train(cfg, progress=False, task=SFTTask(cfg))
    assert abs(read_metrics(tmp_path)[0]["loss"] - _hf_sft_loss(qwen_sft)) <= 1e-5


@pytest.mark.slow
def test_greedy_with_images_equals_transformers_generate(qwen):
    """Slow: transformers' generate twice and a prefill and steps compiled. Two prompts in one batch, each with an image of another size, right-padded to one length: the prefill takes
    each row's multimodal positions and records its rope delta, and the cached steps (text, shifted by it) equal
    transformers' ``generate`` token for token."""
    from eval.generate import GenerationConfig, generate

    hf, ckpt = qwen
    (p0, g0), _, (p2, g2) = IMAGES
    prompts = [qwen_row(30, [(4, g0)], seed=7), qwen_row(22, [(2, g2)], seed=8)]
    want = []
    for ids, (pixels, grid) in zip(prompts, [(p0, g0), (p2, g2)], strict=True):
        ids = torch.tensor(ids[None], dtype=torch.long)
        with torch.no_grad():
            out = hf.generate(input_ids=ids, pixel_values=torch.tensor(pixels), image_grid_thw=torch.tensor([grid]),
                              mm_token_type_ids=(ids == IMAGE_TOKEN).int(), do_sample=False, max_new_tokens=8,
                              eos_token_id=[0], pad_token_id=0)
        want.append(out[0, ids.shape[1]:].tolist())
    model = zoo.load(ckpt, dtype=np.float32)
    v = model.cfg.vision
    frames = [[qwen_image_patches(v, p0, g0)], [qwen_image_patches(v, p2, g2)]]
    got = generate(model.cfg, model.param_dict(), [p.tolist() for p in prompts],
                   GenerationConfig(max_new_tokens=8, eos_ids=(0,)), frames=frames)
    assert got == want
    assert [len(w) for w in want] == [8, 8] and want[0] != want[1]


@pytest.mark.slow
def test_cli_generate_with_an_image(qwen_sft, capsys):
    """Slow: transformers' generate and the command's own compiles. `zoo generate --prompt TEXT --image A` on Qwen2.5-VL: the text is transformers' greedy reply to the same
    prompt ids (the user turn with its image part, expanded from the checkpoint's processor files) and pixels."""
    from zoo.data.tokenizer import load_tokenizer

    ckpt, image = qwen_sft.root / "zoo", str(qwen_sft.root / "img0.png")
    want = load_tokenizer(ckpt).decode(hf_image_reply(qwen_sft.hf, ckpt, qwen_sft.root, QUESTION, image),
                                       skip_special_tokens=True)
    assert want.strip()
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", QUESTION, "--image", image, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"
