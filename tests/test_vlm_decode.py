"""Generation with images on a vision-language model: the processor files through `zoo convert` / `zoo export`,
greedy KV-cache decoding with images against transformers' ``generate``, and `zoo generate --image`."""

import json

import numpy as np
import pytest
import torch

import zoo
from eval.generate import GenerationConfig, generate
from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main

QUESTION = "What is in this picture?"
# The processor scales an image's longer side to 56 px and splits it into 28 px tiles: 56 x 42 into 2 x 2 tiles and
# the whole (5 frames of 4 image tokens), 60 x 12 into 1 x 2 and the whole (3 frames).
SIZES = [(56, 42), (60, 12)]


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    """(transformers' tiny SmolVLM over tests/vlm_processors.py's tokenizer and image processor (tiles on), its
    source folder with the processor files, its `zoo convert`ed checkpoint, two image files of SIZES)."""
    root = tmp_path_factory.mktemp("smolvlm_decode")
    src = smolvlm_folder(root / "hf", splitting=True)
    tok = reference_processor(src).tokenizer
    hf = make_vlm(src, vocab_size=len(tok), image_token_id=tok.convert_tokens_to_ids("<image>"))
    assert main(["convert", str(src), "--out", str(root / "zoo")]) == 0
    return hf, src, root / "zoo", [root / n for n in write_images(root, SIZES, seed=7)]


def _messages(n_images: int) -> list[dict]:
    """A user turn of n image parts and then QUESTION (TRL's placement)."""
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": QUESTION}]}]


def _hf_inputs(src, paths) -> dict:
    """transformers' processor inputs (torch) of one prompt: _messages under the chat template, with ``paths``."""
    from PIL import Image

    proc = reference_processor(src)
    text = proc.tokenizer.apply_chat_template(_messages(len(paths)), tokenize=False, add_generation_prompt=True)
    images = [Image.open(p).convert("RGB") for p in paths]
    return proc(text=[text], images=[images], return_tensors="pt")


def _hf_greedy(hf, inputs, eos: list[int]) -> list[int]:
    """transformers' greedy new tokens (8 at most, ending at an ``eos`` token)."""
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_processor_files_travel_with_the_checkpoint(smolvlm, tmp_path):
    """`zoo convert` keeps the processor files beside the tokenizer, so the checkpoint alone expands an image as
    transformers' processor does; `zoo export` writes them back, and transformers' processor reads them."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from chat.images import ImageExpander
    from zoo.data.tokenizer import load_tokenizer

    _, src, ckpt, paths = smolvlm
    image = Image.open(paths[0]).convert("RGB")
    ref = reference_processor(src)(text=["User:<image>" + QUESTION], images=[[image]], return_tensors="np")
    tok = load_tokenizer(ckpt)
    processed = ImageExpander.from_folder(ckpt / "tokenizer", tok).process(image)
    assert tok("User:" + processed.text + QUESTION)["input_ids"] == ref["input_ids"][0].tolist()
    np.testing.assert_array_equal(processed.pixel_values, ref["pixel_values"][0])
    assert main(["export", str(ckpt), "--out", str(tmp_path / "back")]) == 0
    for name in ("preprocessor_config.json", "processor_config.json"):
        assert json.loads((tmp_path / "back" / name).read_text()) == json.loads((src / name).read_text())
    assert AutoImageProcessor.from_pretrained(str(tmp_path / "back")).to_dict() == \
        AutoImageProcessor.from_pretrained(str(src)).to_dict()
    back = reference_processor(tmp_path / "back")(text=["User:<image>" + QUESTION], images=[[image]],
                                                  return_tensors="np")
    assert back["input_ids"].tolist() == ref["input_ids"].tolist()
    np.testing.assert_array_equal(back["pixel_values"], ref["pixel_values"])


def test_greedy_with_images_equals_transformers_generate(smolvlm):
    """Two prompts in one batch, each with an image of another size (5 frames and 3), right-padded to one length:
    the prefill puts each row's image features at its image tokens, and the cached steps equal transformers'
    ``generate`` token for token."""
    hf, src, ckpt, paths = smolvlm
    model = zoo.load(ckpt, dtype=np.float32)
    eos = [reference_processor(src).tokenizer.eos_token_id]  # <end_of_utterance>, as `zoo generate` stops
    rows = [_hf_inputs(src, [p]) for p in paths]
    assert [len(r["pixel_values"][0]) for r in rows] == [5, 3]
    want = [_hf_greedy(hf, r, eos) for r in rows]
    frames = [list(zip(r["pixel_values"][0].numpy(), r["pixel_attention_mask"][0].numpy().astype(bool), strict=True))
              for r in rows]
    got = generate(model.cfg, model.param_dict(), [r["input_ids"][0].tolist() for r in rows],
                   GenerationConfig(max_new_tokens=8, eos_ids=tuple(eos)), frames=frames)
    assert got == want
    assert [len(w) for w in want] == [8, 8] and want[0] != want[1]


def test_cli_generate_with_images(smolvlm, capsys):
    """`zoo generate --prompt TEXT --image A --image B`: both images in the user turn, expanded from the
    checkpoint's processor files; the text is transformers' greedy reply to the same prompt and images."""
    from zoo.data.tokenizer import load_tokenizer

    hf, src, ckpt, paths = smolvlm
    tok = load_tokenizer(ckpt)
    eos = [tok.eos_token_id]  # what `zoo generate` stops at: the tokenizer's (the source config.json names none)
    want = tok.decode(_hf_greedy(hf, _hf_inputs(src, paths), eos), skip_special_tokens=True)
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompt", QUESTION, "--image", str(paths[0]), "--image", str(paths[1]),
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_cli_generate_image_errors(smolvlm, tiny_family, tmp_path, capsys):
    """A missing image file, --image on a text model, --image with a prompts file: one line, exit 2, before the
    weights load."""
    ckpt, paths = smolvlm[2], smolvlm[3]
    text_model = tiny_family("llama")[1] / "zoo"
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": QUESTION}) + "\n")
    for args, says in [([str(ckpt), "--prompt", QUESTION, "--image", str(tmp_path / "missing.png")],
                        "missing.png: no such file"),
                       ([str(text_model), "--prompt", QUESTION, "--image", str(paths[0])], "has no vision tower"),
                       ([str(ckpt), "--prompts-file", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                         "--image", str(paths[0])], "--image goes with --prompt")]:
        capsys.readouterr()
        assert main(["generate", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and says in err
