"""Qwen2.5-VL and Qwen3-VL in the loops that read images beside SFT: DPO's pairs, GRPO's prompts and `zoo eval`'s
tasks, on tiny random transformers models (tests/vlm_qwen_models.py, tests/vlm_qwen3_models.py) `zoo convert`ed with
the tiny Qwen tokenizer and image processor: every log-probability equals transformers' forward with the image
processor's pixels and grids, where transformers computes the multimodal RoPE positions itself; so the zoo's
positions are right wherever the loops lay the images' rows out (a shared prompt before two answers or G
completions, the sampler's cached prefill and the decoding steps after it)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.run_files import write_jsonl
from tests.vlm_grpo_programs import G, grpo_draws, hf_completion_logps
from tests.vlm_loop_checks import eval_multiple_choice
from tests.vlm_processors import write_images
from tests.vlm_qwen_models import qwen_folder, qwen_token_ids
from zoo.cli import main as zoo_main

PAD = "<|image_pad|>"
QUESTION = "What is in this picture?"
# Images of 8 x 6 patches (12 tokens) and 4 x 4 (4 tokens): each moves the positions after it its own way.
SIZES = [(30, 45), (20, 20)]
PROMPTS = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
           [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"}]}]]
# The first pair's chosen answer outgrows the prompt's text up to its image's end: its rejected answer, which
# follows it in the row, then finds no document start by its positions (index - position) before that image.
ANSWERS = [("It is a red square. It is a blue circle. It is a red square. It is a blue circle.", "a blue circle"),
           ("A blue circle.", "It is red, a square.")]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """family -> (lazily, once) transformers' tiny model of that family (``hf``), saved with the tiny Qwen tokenizer
    and image processor and `zoo convert`ed (``ckpt``), its tokenizer, image processor and folder (two images
    beside it)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from tests.vlm_qwen3_models import make_qwen3
    from tests.vlm_qwen_models import make_qwen

    built: dict[str, SimpleNamespace] = {}

    def get(family: str) -> SimpleNamespace:
        if family not in built:
            root = tmp_path_factory.mktemp(family)
            tok = AutoTokenizer.from_pretrained(str(qwen_folder(root / "hf")))
            make = make_qwen if family == "qwen2_5_vl" else make_qwen3
            hf = make(root / "hf", **qwen_token_ids(tok))
            assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
            built[family] = SimpleNamespace(root=root, ckpt=root / "zoo", hf=hf, tok=tok,
                                            processor=AutoImageProcessor.from_pretrained(str(root / "hf")),
                                            names=write_images(root, SIZES, seed=5))
        return built[family]

    return get


def _pixels(m, names: list[str]) -> dict:
    """transformers' image processor's pixel values and grids of the images ``names``."""
    from PIL import Image

    out = m.processor(images=[Image.open(m.root / n).convert("RGB") for n in names], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _expanded(m, text: str, grids) -> list[int]:
    """The ids of ``text`` with its i-th <|image_pad|> repeated once a merged token of image i (grid t x h x w:
    t h w / 4 tokens), as Qwen's processors expand it (replace_image_token)."""
    pieces = text.split(PAD)
    assert len(pieces) == len(grids) + 1
    out = pieces[0] + "".join(PAD * (int(np.prod(g)) // 4) + p for g, p in zip(grids.tolist(), pieces[1:]))
    return m.tok(out)["input_ids"]


def _hf_logps(m, ids: list[int], n_prompt: int, pixels: dict) -> np.ndarray:
    """transformers' log-probabilities of ids[n_prompt:] after ids[:n_prompt], its own multimodal positions."""
    return hf_completion_logps(m.hf, ids[:n_prompt], ids[n_prompt:], **pixels,
                               mm_token_type_ids=lambda t: (t == m.hf.config.image_token_id).int())


# ---------------------------------------------------------------------------------------------------------- DPO


@pytest.mark.parametrize("family", [pytest.param("qwen2_5_vl", marks=pytest.mark.slow), "qwen3_vl"])
def test_dpo_answer_logps_with_images_equal_transformers(qwen, family, tmp_path):
    """Two pairs (an image before the question, and after it: 12 and 4 image tokens) as `dpo train` lays them out,
    with the prompt shared (one copy a row: the answers' positions continue it from elsewhere in the row) and not
    (two copies, the images laid out twice), both in one program: each sequence is the processor's ids, and every
    answer token's log-probability is transformers' within 1e-5 (its positions moved by the prompt's image).
    Qwen2.5-VL in the slow lane: a model and a compilation of its own (about 20 s on a loaded 2-core machine)."""
    import jax

    import zoo
    from dpo.config import DPOConfig
    from dpo.task import DPOTask
    from prefs.pairs import CHOSEN, PROMPT, REJECTED
    from pretrain.config import load_config
    from zoo.data.batching import batch_vision, stacked
    from zoo.model.logps import batch_logps

    m = qwen(family)
    path = m.root / "pairs.jsonl"
    write_jsonl(path, [{"prompt": p, "chosen": c, "rejected": r, "images": [n]}
                       for p, (c, r), n in zip(PROMPTS, ANSWERS, m.names)])
    mcfg, params = zoo.read_config(m.ckpt), zoo.load_params(m.ckpt)
    batches, docs = [], []
    for share in (True, False):
        cfg = load_config(None, [f"model.path={m.ckpt}", f"data.path={path}", "data.seq_len=192", "batch_size=2", "max_steps=1",
                                 f"dpo.share_prompt={str(share).lower()}", "lora.rank=4", f"output_dir={tmp_path}"],
                          DPOConfig)
        task = DPOTask(cfg)
        task.vision, task.shared_prompt = mcfg.vision, share  # what prepare() sets from the model
        d = task.documents(task.load(str(path), cfg), m.tok, str(path), False).docs
        batches.append(stacked([d[0], d[1]], cfg.data.seq_len + 1, 2, task.finish_rows))
        docs.append(d)
    logps = jax.device_get(jax.jit(lambda p, bs: [batch_logps(mcfg, p, b, max_segments=3,
                                                              vision=batch_vision(mcfg, b))[0] for b in bs])(
        params, batches))
    for r, (prompt, answers, name) in enumerate(zip(PROMPTS, ANSWERS, m.names)):
        pixels = _pixels(m, [name])
        head = m.tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        n_prompt = len(_expanded(m, head, pixels["image_grid_thw"]))
        for side, answer in zip((CHOSEN, REJECTED), answers):
            whole = m.tok.apply_chat_template(prompt + [{"role": "assistant", "content": answer}], tokenize=False)
            ids = _expanded(m, whole.removesuffix("\n"), pixels["image_grid_thw"])  # the answer to its end
            want = _hf_logps(m, ids, n_prompt, pixels)
            for share, d, batch, logp in zip((True, False), docs, batches, logps):
                tokens, segs = d[r]["tokens"], d[r]["tokens_segment_ids"]
                row = np.concatenate([tokens[segs == PROMPT], tokens[segs == side]]) if share else tokens[segs == side]
                assert row.tolist() == ids, (share, side)
                got = logp[r][(batch["segment_ids"][r] == side) & (batch["weights"][r] > 0)]
                assert len(got) == len(want)
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, err_msg=f"{share} {side}")


# --------------------------------------------------------------------------------------------------------- GRPO


@pytest.mark.slow
def test_grpo_completion_logps_with_images_equal_transformers(qwen):
    """Slow: one program of the sampler (tower, prefill, decoding loop) and two update passes (about 30 s on a loaded
    2-core machine). Qwen3-VL (interleaved multimodal RoPE and DeepStack; Qwen2.5-VL's rows take the same code path, the forward
    choosing the tower and the sections: its positions are checked by the DPO test above). Two prompts with images
    (12 and 4 image tokens, before and after the question), G = 2 completions each drawn by `grpo train`'s sampler:
    the prompt ids are the processor's, and each completion's per-token log-probabilities as the sampler drew them
    (the cached prefill's positions, then every decoding step's moved by the prefill's rope delta) and as the
    update computes them (a group's prompt once in its row, its completions continuing its positions; and one row
    a completion) are transformers' forward with the image processor's pixels (1e-4)."""
    m = qwen("qwen3_vl")
    rows = [{"prompt": p, "images": [n]} for p, n in zip(PROMPTS, m.names)]
    write_jsonl(m.root / "prompts.jsonl", rows)
    got = grpo_draws(m.ckpt, rows, m.root / "prompts.jsonl", seq_len=96)  # prompts far shorter than their room
    image_id = m.hf.config.image_token_id
    assert any(len(set(c)) > 1 for c in got.completions) and not any(image_id in c for c in got.completions)
    for r, (ids, comp) in enumerate(zip(got.ids, got.completions)):
        row = rows[got.order[r]]
        pixels = _pixels(m, row["images"])
        head = m.tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert ids == _expanded(m, head, pixels["image_grid_thw"])
        want = _hf_logps(m, ids + comp, len(ids), pixels)
        np.testing.assert_allclose(got.sampler[r], want, rtol=0, atol=1e-4)
        for grouped, lp in got.update.items():
            np.testing.assert_allclose(lp[r][:len(comp)], want, rtol=0, atol=1e-4, err_msg=f"grouped={grouped}")
    assert len(got.ids) == 2 * G


# --------------------------------------------------------------------------------------------------------- eval


@pytest.mark.slow  # transformers' forwards as the oracle (about 5 s): the full suite's
def test_eval_multiple_choice_with_images_equals_transformers(qwen):
    """`zoo eval` on a multiple-choice task with images on Qwen3-VL: a text with two images and no placeholder (each
    image before it in its own <|vision_start|>...<|vision_end|>, 12 + 4 tokens: bare, their runs would touch and
    read as one image), a text with two placeholders (4 + 12 tokens, the question between them), one with none (its
    image, the ``image`` column's, before the text) and one without images, in one batch of the KV-cache path (the prefill's multimodal positions, the choices moved by the rope
    delta): every choice's log-likelihood is transformers' forward with the pixels (1e-4)."""

    m = qwen("qwen3_vl")
    a, b = m.names
    image = f"<|vision_start|>{PAD}<|vision_end|>"
    rows = [{"question": QUESTION, "choices": ["red", "blue"], "answer": 1, "images": [a, b]},
            {"question": image + QUESTION + image, "choices": ["red", "blue"], "answer": 0, "images": [b, a]},
            {"question": QUESTION, "choices": ["red", "blue"], "answer": 0, "image": b},
            {"question": QUESTION, "choices": ["red", "blue"], "answer": 0}]
    log = eval_multiple_choice(m.root, m.ckpt, rows, 4)
    for row, sample in zip(rows, log):
        names = row.get("images", [row["image"]] if "image" in row else [])
        # No placeholder: each image as Qwen's chat template writes an image part (transformers' processor refuses
        # a text without placeholders), so the two images' runs stay apart for get_rope_index.
        text = row["question"] if PAD in row["question"] else image * len(names) + row["question"]
        pixels = _pixels(m, names) if names else {}
        grids = pixels.get("image_grid_thw", torch.zeros((0, 3), dtype=torch.long))
        context = _expanded(m, text, grids)
        want = []
        for choice in row["choices"]:
            ids = _expanded(m, text + " " + choice, grids)
            assert ids[:len(context)] == context
            want.append(_hf_logps(m, ids, len(context), pixels).sum())
        np.testing.assert_allclose(sample["loglikelihoods"], want, rtol=0, atol=1e-4)
