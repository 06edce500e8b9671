"""Gemma 3 with images in data, SFT and cached generation, against transformers: a conversation's token ids and
pixels equal Gemma3Processor's, SFT's step-1 loss equals Gemma3ForConditionalGeneration's (token_type_ids: each
image's tokens one bidirectional block) with two rows packed into one, `sft inspect` marks the images, and greedy
KV-cache decoding with images (the prefill's image blocks both ways, every step after it causal text) equals
``generate`` token for token, in Python and through `zoo generate --image`, and DPO's answer log-probabilities with
images equal transformers' (token_type_ids)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import zoo
from chat.formats import normalize
from chat.images import ImageExpander, tokenize_with_images
from eval.generate import GenerationConfig, generate
from tests.run_files import read_metrics, write_jsonl
from tests.vlm_loop_checks import dpo_image_pair_logps
from tests.vlm_models import make_gemma3
from tests.vlm_processors import GEMMA3_SEQ_LEN, gemma3_folder, gemma3_reference_processor, write_images
from zoo.cli import main as zoo_main

QUESTION = "What is in this picture?"
ANSWERS = ["It is a red square.", "It is a blue circle."]
# Gemma3ImageProcessor resizes every image to 28 x 28 (no pan-and-scan): one frame of 4 image tokens an image.
SIZES = [(40, 20), (28, 28), (12, 40)]


def _row(answer: str, image: str) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": answer}], "images": [image]}


@pytest.fixture(scope="module")
def g3(tmp_path_factory):
    """transformers' tiny Gemma 3 (``hf``) over tests/vlm_processors.py's Gemma 3 tokenizer and image processor,
    its source folder (``src``, with the processor files), its `zoo convert`ed checkpoint (``ckpt``), the
    tokenizer, three image files of SIZES (``paths``) and two SFT rows (``data.jsonl``, one image each)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("gemma3_data")
    src = gemma3_folder(root / "hf")
    tok = AutoTokenizer.from_pretrained(str(src))
    ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<image_soft_token>", "<start_of_image>", "<end_of_image>"))
    hf = make_gemma3(src, vocab_size=len(tok), tokens=ids, untied=True)
    assert zoo_main(["convert", str(src), "--out", str(root / "zoo")]) == 0
    names = write_images(root, SIZES, seed=3)
    write_jsonl(root / "data.jsonl", [_row(a, n) for a, n in zip(ANSWERS, names)])
    return SimpleNamespace(root=root, src=src, ckpt=root / "zoo", tok=tok, hf=hf, image_id=ids[0],
                           paths=[root / n for n in names])


def _images(paths):
    from PIL import Image

    return [Image.open(p).convert("RGB") for p in paths]


def _conversation(names: list[str]) -> dict:
    """A row of two user turns with images (one, then two after the text) and a system turn."""
    return {"messages": [{"role": "system", "content": "Describe the image, please."},
                         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
                         {"role": "assistant", "content": ANSWERS[0]},
                         {"role": "user", "content": [{"type": "text", "text": "And these?"}, {"type": "image"},
                                                      {"type": "image"}]},
                         {"role": "assistant", "content": ANSWERS[1]}], "images": names}


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_ids_and_pixels_equal_gemma3_processor(g3, tmp_path, pan_and_scan):
    """Three images in two turns: the zoo's ids are Gemma3Processor's on the same rendered conversation (each
    ``<start_of_image>`` expanded to its image's run), its pixels the processor's, and no image token (nor its
    markers) is trained. A folder whose image processor turns pan-and-scan on still gives one frame an image, as
    the processor does (it calls its image processor with pan-and-scan off)."""
    folder = gemma3_folder(tmp_path / "proc", pan_and_scan=pan_and_scan) if pan_and_scan else g3.ckpt / "tokenizer"
    row = _conversation([p.name for p in g3.paths])
    got = tokenize_with_images(normalize(row, "messages"), g3.tok, ImageExpander.from_folder(folder, g3.tok), g3.root)
    ref = gemma3_reference_processor(folder)
    text = g3.tok.apply_chat_template(row["messages"], tokenize=False)
    want = ref(text=[text], images=[_images(g3.paths)], return_tensors="np")
    assert got.ids.tolist() == want["input_ids"][0].tolist()
    np.testing.assert_array_equal(np.concatenate([p.pixel_values for p in got.images]), want["pixel_values"])
    is_image = want["token_type_ids"][0] == 1
    assert is_image.sum() == len(SIZES) * GEMMA3_SEQ_LEN and np.array_equal(is_image, got.ids == g3.image_id)
    markers = np.isin(got.ids, g3.tok.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>"]))
    assert not (got.mask & (is_image | markers)).any()
    trained = g3.tok.decode(got.ids[got.mask])
    assert trained == f"{ANSWERS[0]}<end_of_turn>{ANSWERS[1]}<end_of_turn>"


def _hf_inputs(g3, paths) -> dict:
    """transformers' processor inputs (torch) of a user turn of one image part per path and QUESTION."""
    messages = [{"role": "user", "content": [{"type": "image"}] * len(paths) + [{"type": "text", "text": QUESTION}]}]
    text = g3.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return gemma3_reference_processor(g3.src)(text=[text], images=[_images(paths)], return_tensors="pt")


def _hf_greedy(hf, inputs, eos: list[int], n: int = 8) -> list[int]:
    """transformers' greedy new tokens (``n`` at most, ending at an ``eos`` token); the processor's
    token_type_ids make the prefill's image blocks bidirectional."""
    with torch.no_grad():
        out = hf.generate(**inputs, do_sample=False, max_new_tokens=n, eos_token_id=eos, pad_token_id=eos[0])
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.slow
def test_greedy_with_images_equals_transformers_generate(g3):
    """Two prompts in one batch (one image, then two), right-padded to one length: the prefill attends within each
    image both ways, and the cached steps equal transformers' ``generate`` token for token. Without the blocks
    (transformers' generate without token_type_ids, causal over the images) the tokens differ, so the blocks
    are what the test checks. Slow: transformers' generate four times, the prefill and steps compiled."""
    model = zoo.load(g3.ckpt, dtype=np.float32)
    eos = [g3.tok.eos_token_id]
    rows = [_hf_inputs(g3, g3.paths[:1]), _hf_inputs(g3, g3.paths[1:])]
    want = [_hf_greedy(g3.hf, r, eos) for r in rows]
    frames = [[(pixels, None) for pixels in r["pixel_values"].numpy()] for r in rows]
    got = generate(model.cfg, model.param_dict(), [r["input_ids"][0].tolist() for r in rows],
                   GenerationConfig(max_new_tokens=8, eos_ids=tuple(eos)), frames=frames)
    assert got == want
    assert [len(w) for w in want] == [8, 8] and want[0] != want[1]
    causal = [_hf_greedy(g3.hf, {k: v for k, v in r.items() if k != "token_type_ids"}, eos) for r in rows]
    assert causal != want


@pytest.mark.slow
def test_cli_generate_with_images(g3, capsys):
    """`zoo generate --prompt TEXT --image A --image B` on Gemma 3: the images expanded from the checkpoint's
    processor files; the text is transformers' greedy reply to the same prompt and images. Slow: a batch of one
    compiles its own prefill and steps."""
    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(g3.ckpt)
    eos = [tok.eos_token_id]
    want = tok.decode(_hf_greedy(g3.hf, _hf_inputs(g3, g3.paths[:2]), eos), skip_special_tokens=True)
    capsys.readouterr()
    assert zoo_main(["generate", str(g3.ckpt), "--prompt", QUESTION, "--image", str(g3.paths[0]), "--image",
                     str(g3.paths[1]), "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == want + "\n"


def _sft_cfg(g3, out, *overrides):
    from pretrain.config import load_config
    from sft.config import SFTConfig

    return load_config(None, [f"model.path={g3.ckpt}", f"data.path={g3.root / 'data.jsonl'}", "data.seq_len=64",
                              "data.packing=false", "batch_size=2", "optimizer.learning_rate=0.01",
                              "schedule.name=constant", "log_every=1", "checkpoint.every=100", "max_steps=1",
                              f"output_dir={out}", *overrides], SFTConfig)


def _hf_loss(g3) -> float:
    """transformers' mean next-token cross-entropy over both rows of data.jsonl: the zoo's own ids and pixels
    (equal to the processor's: test_ids_and_pixels_equal_gemma3_processor), token_type_ids 1 on the image tokens
    (Gemma 3's bidirectional blocks), labels -100 wherever the zoo trains nothing."""
    expander = ImageExpander.from_folder(g3.ckpt / "tokenizer", g3.tok)
    total, count = 0.0, 0
    for line in (g3.root / "data.jsonl").read_text().splitlines():
        t = tokenize_with_images(normalize(json.loads(line), "messages"), g3.tok, expander, g3.root)
        labels = np.where(t.mask, t.ids, -100)
        ids = torch.tensor(t.ids[None], dtype=torch.long)
        with torch.no_grad():
            out = g3.hf(input_ids=ids, pixel_values=torch.tensor(t.images[0].pixel_values),
                        token_type_ids=(ids == g3.image_id).long(), labels=torch.tensor(labels[None], dtype=torch.long))
        n = int((labels[1:] != -100).sum())
        total, count = total + float(out.loss) * n, count + n
    return total / count


@pytest.mark.slow
def test_sft_packed_step_1_loss_is_transformers(g3, tmp_path):
    """Slow: a one-step run, compiling its step. Both rows packed into one (data.max_patches: both images): step
    1's loss is transformers' over the two rows apart, each image's tokens one bidirectional block that stays
    within its own document."""
    from pretrain.loop import train
    from sft.task import SFTTask

    cfg = _sft_cfg(g3, tmp_path, "data.packing=true", "batch_size=1", "data.max_patches=32", "data.seq_len=96")
    train(cfg, progress=False, task=SFTTask(cfg))
    assert abs(read_metrics(tmp_path)[0]["loss"] - _hf_loss(g3)) <= 1e-5


def test_inspect_shows_gemma3_images_as_markers(g3, capsys):
    """`sft inspect` on Gemma 3 rows: each image's run (its markers and the processor's newlines around it) one
    untrained marker, the answer trained."""
    from sft.cli import main as sft_main

    assert sft_main(["inspect", f"model.path={g3.ckpt}", f"data.path={g3.root / 'data.jsonl'}", "data.seq_len=64",
                     "max_steps=1", "-n", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    # "\n\n" (two tokens here), <start_of_image>, 4 <image_soft_token>, <end_of_image>, "\n\n"
    assert f"<start_of_turn>user\n⟨image 1: 10 tokens⟩{QUESTION}" in out
    assert f"[[{ANSWERS[0]}<end_of_turn>]]" in out



def test_dpo_answer_logps_with_images_equal_transformers(g3, tmp_path):
    """`dpo train`'s batch of two pairs with images (TRL's vision preference rows: one image, then two; Gemma 3's
    sliding layers keep each answer with its own copy of the prompt and its images): each sequence is
    Gemma3Processor's ids, and every answer token's log-probability (each image's tokens one bidirectional block)
    is transformers' forward with the processor's pixels and token_type_ids (1e-5)."""

    from prefs.pairs import CHOSEN, REJECTED

    names = [p.name for p in g3.paths]
    prompts = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
               [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"},
                                             {"type": "image"}]}]]
    pairs = [(ANSWERS[0], ANSWERS[1]), (ANSWERS[1], "A blue square.")]
    images = [names[:1], names[1:]]
    rows = [{"prompt": p, "chosen": c, "rejected": r, "images": i}
            for p, (c, r), i in zip(prompts, pairs, images, strict=True)]
    docs, batch, logp = dpo_image_pair_logps(g3.ckpt, g3.tok, tmp_path, rows, g3.paths, 128)
    proc = gemma3_reference_processor(g3.src)
    for r, (prompt, answers, names_r) in enumerate(zip(prompts, pairs, images, strict=True)):
        head = g3.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        pics = _images([g3.root / n for n in names_r])
        n_prompt = len(proc(text=[head], images=[pics])["input_ids"][0])
        seg, w = batch["segment_ids"][r], batch["weights"][r]
        for answer, s in zip(answers, (CHOSEN, REJECTED), strict=True):
            text = g3.tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
            enc = proc(text=[text.removesuffix("\n")], images=[pics], return_tensors="pt")  # the answer to its end
            ids = enc["input_ids"][0]
            assert docs[r]["tokens"][docs[r]["tokens_segment_ids"] == s].tolist() == ids.tolist()
            with torch.no_grad():
                logits = g3.hf(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"],
                               token_type_ids=enc["token_type_ids"]).logits[0].double()
            want = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0].numpy()[n_prompt - 1:]
            got = logp[r][(seg == s) & (w > 0)]
            assert len(got) == len(want) > 3
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
