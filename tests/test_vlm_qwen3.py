"""Qwen3-VL against transformers, on one `zoo convert`ed tiny random Qwen3VLForConditionalGeneration with the tiny
Qwen tokenizer and image processor beside it: the tower's image features and DeepStack features on images of
different sizes, image+text logits (interleaved multimodal RoPE, DeepStack added after the first layers), the
HF -> zoo -> HF round trip, the rows' ids and pixels, an SFT step's loss, and `zoo generate --image` (cached
decoding with the rope delta) against transformers' greedy `generate`."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import zoo
from tests.hf_models import mean_kl
from tests.vlm_models import assert_export_round_trip
from tests.vlm_qwen3_models import hf_qwen3_features, hf_qwen3_logits, image_row, make_qwen3
from tests.vlm_qwen_models import assert_rows_expand_as_processor, hf_image_reply, random_image
from zoo.cli import main
from zoo.data.qwen_layout import qwen_image_patches
from zoo.data.vision_layout import layout_rows
from zoo.model.vision import VisionInputs

# Three images of different sizes (rows x columns of 4-pixel patches), each resampling the 4 x 4 position table
# its own way: 6 x 8, 4 x 4 (the table's own grid) and 10 x 6.
IMAGES = [random_image(0, 6, 8), random_image(1, 4, 4), random_image(2, 10, 6)]
QUESTION, ANSWERS = "What is in this picture?", ["It is a red square.", "It is a blue circle."]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """transformers' tiny Qwen3-VL (``hf``), saved with the tiny Qwen tokenizer and image processor and `zoo
    convert`ed (``ckpt``, whose tokenizer/ folder the processor files travel to), its token ids, and two chat rows
    with images of different sizes (``data.jsonl``)."""
    from transformers import AutoTokenizer

    from tests.run_files import write_jsonl
    from tests.vlm_processors import write_images
    from tests.vlm_qwen_models import qwen_folder, qwen_token_ids

    root = tmp_path_factory.mktemp("qwen3_vl")
    tok = AutoTokenizer.from_pretrained(str(qwen_folder(root / "hf")))
    ids = qwen_token_ids(tok)
    hf = make_qwen3(root / "hf", **ids)
    assert main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    names = write_images(root, [(30, 45), (20, 20)])  # 8 x 6 patches (12 tokens), 4 x 4 (4)
    write_jsonl(root / "data.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                      {"role": "assistant", "content": answer}], "images": [name]}
        for answer, name in zip(ANSWERS, names, strict=True)])
    return SimpleNamespace(root=root, ckpt=root / "zoo", tok=tok, hf=hf, ids=ids)


def _inputs(v, rows, max_patches: int = 72) -> VisionInputs:
    """The batch's VisionInputs of rows of images ((pixel_values, grid) each)."""
    laid = [[qwen_image_patches(v, pixels, grid) for pixels, grid in row] for row in rows]
    return VisionInputs(**{k: jnp.asarray(a) for k, a in layout_rows(v, laid, max_patches).items()})


def test_features_deepstack_and_logits_equal_transformers(qwen3):
    """One program: the image features and both DeepStack levels' of two rows (the first with two images), each
    image attending within itself, as transformers' tower run on the three images at once; and the logits of two
    rows with those images and text around them, where the forward computes the multimodal positions and adds the
    levels after the first two layers."""
    from zoo.model.decoder import forward
    from zoo.model.vision import encode_with_deepstack

    hf, ids = qwen3.hf, qwen3.ids
    cfg, params = zoo.read_config(qwen3.ckpt), zoo.load_params(qwen3.ckpt)
    grids, text = [g for _, g in IMAGES], (7, ids["vocab_size"])  # text: past the special tokens
    tokens = np.stack([image_row(40, [(3, grids[0]), (20, grids[1])], 3, ids, text),
                       image_row(40, [(10, grids[2])], 4, ids, text)])

    def run(cfg, params, tokens, vision):
        return encode_with_deepstack(cfg, params, vision), forward(cfg, params, tokens, vision=vision)

    (feats, deep), logits = jax.jit(run, static_argnums=0)(cfg, params, jnp.asarray(tokens),
                                                           _inputs(cfg.vision, [IMAGES[:2], IMAGES[2:]]))
    ref, ref_deep = hf_qwen3_features(hf, IMAGES)
    assert feats.shape == (2, 18, 64) and deep.shape == (2, 2, 18, 64)
    for got, want in [(feats, ref), *zip(deep, ref_deep, strict=True)]:
        got = np.asarray(got)
        assert np.abs(got[0, :12] - want[0]).max() <= 1e-4 and np.abs(got[0, 12:16] - want[1]).max() <= 1e-4
        assert np.abs(got[1, :15] - want[2]).max() <= 1e-4 and min(w.std() for w in want) > 0.1
    ref_logits, got_logits = hf_qwen3_logits(hf, tokens, IMAGES), np.asarray(logits)
    assert np.abs(got_logits - ref_logits).max() <= 1e-4
    assert mean_kl(ref_logits, got_logits) <= 1e-6
    assert ref_logits.std() > 0.5


def test_round_trip_is_bit_identical(qwen3, tmp_path):
    """HF -> zoo -> HF gives back every tensor (tower, merger and DeepStack mergers included), bit for bit, and the
    config, which transformers loads."""
    assert_export_round_trip(qwen3.hf, qwen3.ckpt, tmp_path / "back")


def test_released_configs():
    """The registry's Qwen3-VL configs read as the published models: the tower's layout, its DeepStack layers and
    the language model's interleaved multimodal RoPE (their parameter counts: tests/test_vlm_registry.py)."""
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry.catalogue import get

    cfgs = {size: model_config_from_hf(get(f"qwen3-vl-{size}").hf_config) for size in ("2b", "4b", "8b", "32b")}
    v = cfgs["8b"].vision
    assert (v.num_layers, v.deepstack_layers, v.pos_table, v.patch_dim, v.hidden_act) == (
        27, (8, 16, 24), 2304, 1536, "gelu_pytorch_tanh")
    assert cfgs["2b"].vision.deepstack_layers == (5, 11, 17) and cfgs["2b"].tie_word_embeddings
    rope = cfgs["32b"].rope
    assert (rope.mrope_section, rope.mrope_interleaved, rope.theta) == ((24, 20, 20), True, 5_000_000.0)
    assert get("qwen3-vl-8b").hf_repo == "Qwen/Qwen3-VL-8B-Instruct"


def test_rows_expand_as_the_processor_does(qwen3):
    """A conversation with two images: the ids are the tokenized text with each <|image_pad|> replaced as
    Qwen3VLProcessor.replace_image_token replaces it, the pixels and grids the image processor's (the checkpoint's
    own processor files, copied by `zoo convert`), and the image tokens untrained."""
    from transformers import Qwen3VLProcessor

    assert_rows_expand_as_processor(qwen3.root, qwen3.ckpt / "tokenizer", qwen3.tok, Qwen3VLProcessor, QUESTION,
                                    ANSWERS[0])


def _hf_sft_loss(qwen3) -> float:
    """transformers' mean next-token cross-entropy over both rows: the zoo's ids and pixels (equal to the
    processor's: test_rows_expand_as_the_processor_does), labels -100 wherever the zoo trains nothing."""
    from chat.formats import normalize
    from chat.images import ImageExpander, tokenize_with_images

    tok, hf = qwen3.tok, qwen3.hf
    expander = ImageExpander.from_folder(qwen3.ckpt / "tokenizer", tok)
    total, count = 0.0, 0
    for line in (qwen3.root / "data.jsonl").read_text().splitlines():
        t = tokenize_with_images(normalize(json.loads(line), "messages"), tok, expander, qwen3.root)
        labels = np.where(t.mask, t.ids, -100)
        (image,) = t.images
        ids = torch.tensor(t.ids[None], dtype=torch.long)
        with torch.no_grad():
            out = hf(input_ids=ids, pixel_values=torch.tensor(image.pixel_values),
                     image_grid_thw=torch.tensor([image.grid_thw]),
                     mm_token_type_ids=(ids == hf.config.image_token_id).int(),
                     labels=torch.tensor(labels[None], dtype=torch.long))
        n = int((labels[1:] != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    return total / count


@pytest.mark.slow
def test_packed_sft_step_loss_is_transformers(qwen3, tmp_path):
    """Slow: a training run (11-12 s; 16 s with the tower trained too, as Qwen2.5-VL's test trains it, whose
    step-1 loss is the same: the tower and mergers are frozen here, for time). Both rows packed into one row (their
    images' 48 + 16 patches in data.max_patches): step 1's loss is transformers' over the two rows apart, each
    document's multimodal positions its own and DeepStack's levels at its own image tokens."""
    from pretrain.config import load_config
    from pretrain.loop import train
    from sft.config import SFTConfig
    from sft.task import SFTTask
    from tests.run_files import read_metrics

    cfg = load_config(None, [f"model.path={qwen3.ckpt}", f"data.path={qwen3.root / 'data.jsonl'}",
                             "data.seq_len=144", "data.packing=true", "data.max_patches=64", "batch_size=1",
                             "max_steps=1", "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
                             "checkpoint.every=100", f"output_dir={tmp_path}", "model.freeze=[vision,projector]"],
                      SFTConfig)
    train(cfg, progress=False, task=SFTTask(cfg))
    assert abs(read_metrics(tmp_path)[0]["loss"] - _hf_sft_loss(qwen3)) <= 1e-5


@pytest.mark.slow  # a transformers generate oracle (about 6 s); test_vlm_decode's CLI generate stays in the fast lane
def test_cli_generate_with_an_image_equals_transformers_generate(qwen3, capsys):
    """`zoo generate --prompt TEXT --image A`: the text is transformers' greedy reply to the same prompt ids (the
    user turn with its image part, expanded from the checkpoint's processor files) and pixels, the prefill taking
    the multimodal positions and DeepStack's levels and recording the rope delta every cached step moves by. A
    prompt whose images outgrow the model's context is one line, before the weights load (the shared check)."""
    from zoo.data.tokenizer import load_tokenizer

    ckpt, hf, image = qwen3.ckpt, qwen3.hf, str(qwen3.root / "img0.png")
    capsys.readouterr()
    too_many = [a for _ in range(22) for a in ("--image", image)]  # 22 x 12 image tokens: past the 256 positions
    assert main(["generate", str(ckpt), "--prompt", QUESTION, *too_many, "--max-new-tokens", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--image: the prompt with its image(s) is " in err and "more than the model's context of 256" in err
    reply = hf_image_reply(hf, ckpt, qwen3.root, QUESTION, image)
    want = load_tokenizer(ckpt).decode(reply, skip_special_tokens=True)
    assert want.strip() and len(set(reply)) > 1
    assert main(["generate", str(ckpt), "--prompt", QUESTION, "--image", image, "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"
