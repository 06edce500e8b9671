"""`dpo train` on preference pairs with images (TRL's vision preference rows), on a tiny SmolVLM
(tests/vlm_models.py) and its processor (tests/vlm_processors.py): each answer's per-token log-probabilities equal
transformers' forward with the processor's ids and pixel values, step 1's metrics equal TRL's DPO formulas on
transformers' log-probabilities (a live reference checkpoint and a precomputed one), and bad rows are one line
naming file and line, exit 2, before step 1."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import jax
import numpy as np
import pytest

import zoo
from dpo.cli import main as dpo_main
from dpo.task import DPOTask
from prefs.pairs import CHOSEN, PROMPT, REJECTED
from pretrain.config import load_config
from tests.run_files import one_line_error, read_metrics, write_jsonl
from tests.trl_oracles import assert_same_metrics, reward_operands, trl_metrics
from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main as zoo_main

BETA = 0.1
# Two pairs: TRL's placement (a string user turn gets the image before its text) and an image part of its own
# after the text; the second image is smaller than the tile (the processor pads it).
PROMPTS = [[{"role": "user", "content": "What is in this picture?"}],
           [{"role": "user", "content": [{"type": "text", "text": "Describe the image, please."}, {"type": "image"}]}]]
ANSWERS = [("It is a red square.", "It is a blue circle."), ("A blue circle.", "It is red, a square.")]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random SmolVLM (the policy) converted at ``policy``, the processor's files in its ``tokenizer/``, two
    pairs with images (``pairs.jsonl``), transformers' model (``hf``) and the processor."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_dpo")
    proc = smolvlm_folder(root / "proc", splitting=False)
    tok = AutoTokenizer.from_pretrained(str(proc))
    image_id = tok.convert_tokens_to_ids("<image>")
    hf = make_vlm(root / "hf_policy", vocab_size=len(tok), image_token_id=image_id)
    assert zoo_main(["convert", str(root / "hf_policy"), "--out", str(root / "policy")]) == 0
    for f in proc.iterdir():  # the image processor's files beside the checkpoint's tokenizer
        shutil.copy(f, root / "policy" / "tokenizer" / f.name)
    names = write_images(root, [(28, 28), (20, 28)])
    write_jsonl(root / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r, "images": [n]}
                                       for p, (c, r), n in zip(PROMPTS, ANSWERS, names)])
    return SimpleNamespace(root=root, tok=tok, hf=hf, names=names, proc=reference_processor(proc),
                           image_id=image_id)


@pytest.fixture(scope="module")
def reference(vlm):
    """Another tiny random SmolVLM (seed 1), converted at ``vlm.root / "reference"``: transformers' model."""
    hf = make_vlm(vlm.root / "hf_reference", seed=1, vocab_size=len(vlm.tok), image_token_id=vlm.image_id)
    assert zoo_main(["convert", str(vlm.root / "hf_reference"), "--out", str(vlm.root / "reference")]) == 0
    return hf


def _cfg(vlm, out, *overrides):
    from dpo.config import DPOConfig

    return load_config(None, _args(vlm, out, *overrides), DPOConfig)


def _args(vlm, out, *overrides) -> list[str]:
    return [f"model.path={vlm.root / 'policy'}", f"data.path={vlm.root / 'pairs.jsonl'}", "data.seq_len=80",
            "batch_size=2", "max_steps=1", "schedule.name=constant", "log_every=1", "checkpoint.every=100",
            f"dpo.beta={BETA}",
            f"output_dir={out}", *overrides]


def _hf_answer_logps(vlm, model) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per pair: (transformers' per-token log-probabilities of the chosen answer, of the rejected one, the ids of
    prompt + chosen), each sequence as the processor makes it from the chat template's render of the prompt (with
    the generation prompt) and the answer's turn, with the processor's pixel values."""
    import torch
    from PIL import Image

    from chat.formats import multimodal_messages

    out = []
    for prompt, answers, name in zip(PROMPTS, ANSWERS, vlm.names):
        image = Image.open(vlm.root / name).convert("RGB")
        messages = multimodal_messages(prompt, 1)
        head = vlm.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n_prompt = len(vlm.proc(text=[head], images=[[image]])["input_ids"][0])
        sides = []
        for answer in answers:
            turn = multimodal_messages([{"role": "assistant", "content": answer}], 0)
            text = vlm.tok.apply_chat_template(messages + turn, tokenize=False).removesuffix("\n")  # to its end
            enc = vlm.proc(text=[text], images=[[image]], return_tensors="pt")
            with torch.no_grad():
                logits = model(input_ids=enc["input_ids"], pixel_values=enc["pixel_values"],
                                       pixel_attention_mask=enc["pixel_attention_mask"]).logits[0].double()
            ids = enc["input_ids"][0]
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0].numpy()
            sides.append((lp[n_prompt - 1:], ids.numpy()))
        out.append((sides[0][0], sides[1][0], sides[0][1]))
    return out


@pytest.mark.parametrize("share_prompt", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_answer_logps_with_images_equal_transformers(vlm, share_prompt, tmp_path):
    """A batch of both pairs as `dpo train` makes it (one prompt copy a row, or two): the chosen sequence is the
    processor's ids, no image token is trained, and every answer token's log-probability (the model reading the
    row's images) is transformers' within 1e-5. Two prompt copies a row (the slow lane: a compilation of its own)
    lay the images out twice."""
    from zoo.data.batching import batch_vision, stacked
    from zoo.model.logps import batch_logps

    cfg = _cfg(vlm, tmp_path, f"dpo.share_prompt={str(share_prompt).lower()}", "lora.rank=4")
    task = DPOTask(cfg)
    mcfg, params = zoo.read_config(vlm.root / "policy"), zoo.load_params(vlm.root / "policy")
    task.vision, task.shared_prompt = mcfg.vision, share_prompt  # what prepare() sets from the model
    path = str(vlm.root / "pairs.jsonl")
    docs = task.documents(task.load(path, cfg), vlm.tok, path, False).docs
    batch = stacked([docs[0], docs[1]], cfg.data.seq_len + 1, 2, task.finish_rows)
    patches = 16 * (1 if share_prompt else 2)  # one image's frame a prompt copy
    assert batch["vision_patches"].shape == (2, patches * 7 * 7 * 3)
    assert task.batch_layout(1, 2, cfg.data.seq_len).vision.patch_image.shape == (1, 2, patches)  # the data's budget
    logp = np.asarray(jax.jit(lambda p, b: batch_logps(mcfg, p, b, max_segments=3,
                                                       vision=batch_vision(mcfg, b))[0])(params, batch))
    for r, (want_c, want_r, ids_c) in enumerate(_hf_answer_logps(vlm, vlm.hf)):
        d, seg, w = docs[r], batch["segment_ids"][r], batch["weights"][r]
        prompt = d["tokens"][d["tokens_segment_ids"] == PROMPT]
        np.testing.assert_array_equal(np.concatenate([prompt, d["tokens"][d["tokens_segment_ids"] == CHOSEN]]), ids_c)
        assert (d["tokens"] == vlm.image_id).sum() == 4 * (1 if share_prompt else 2)
        assert not d["loss_mask"][d["tokens"] == vlm.image_id].any()
        for want, s in ((want_c, CHOSEN), (want_r, REJECTED)):
            got = logp[r][(seg == s) & (w > 0)]
            assert len(got) == len(want)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _parts(params) -> dict[str, list[np.ndarray]]:
    return {k: [np.asarray(x) for x in jax.tree.leaves(params[k])] for k in ("vision", "projector", "layers")}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["path", "precomputed"])
def test_step_one_metrics_equal_trl_on_transformers_logps(vlm, reference, mode, tmp_path):
    """Slow: a `dpo train` run through the CLI (its own compilations), full fine-tuning with model.freeze: step 1's
    loss, rewards and log-probabilities are TRL's DPO formulas on transformers' per-token log-probabilities of the
    policy and the reference, both reading the images; a live reference checkpoint with one prompt copy a row,
    and a precomputed one (scored with the images) with two; the tower and connector stay bit-identical."""
    ref = vlm.root / "reference"
    extra = ([f"dpo.reference={ref}"] if mode == "path" else
             ["dpo.reference=precomputed", f"dpo.reference_model={ref}", "dpo.share_prompt=false"])
    out = tmp_path / "run"
    assert dpo_main(["train", *_args(vlm, out, "model.freeze=[vision,projector]",
                                      "optimizer.learning_rate=0.01", *extra)]) == 0
    got = read_metrics(out)[0]
    pol, refs = _hf_answer_logps(vlm, vlm.hf), _hf_answer_logps(vlm, reference)
    want = trl_metrics("sigmoid", [p[0] for p in pol], [p[1] for p in pol], [q[0] for q in refs],
                       [q[1] for q in refs], BETA, 0.0, 0.0, 0.0)
    assert_same_metrics(got, want, ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                                    "logps/rejected", "rewards/accuracies"), reward_operands(want, BETA))
    before, after = _parts(zoo.load_params(vlm.root / "policy")), _parts(zoo.load_params(out / "final"))
    for k in ("vision", "projector"):
        assert all(np.array_equal(x, y) for x, y in zip(before[k], after[k])), k
    assert any(not np.array_equal(x, y) for x, y in zip(before["layers"], after["layers"]))


def _one_line_error(capsys, args) -> str:
    return one_line_error(capsys, dpo_main, ["train", *args])


def test_bad_image_pairs_are_one_line_naming_the_row(vlm, tmp_path, capsys):
    """Exit 2, one line, before step 1 (no metrics written): naming file and line, a missing image file, more
    images than image parts, a pair too long for data.seq_len without cutting its images, and images on a model
    with no vision tower."""
    rows = [{"prompt": PROMPTS[0], "chosen": "Yes.", "rejected": "No.", "images": [vlm.names[0]]},
            {"prompt": PROMPTS[1], "chosen": "Yes.", "rejected": "No.", "images": [vlm.names[0]]}]
    for name in vlm.names:  # image paths are relative to the data file
        shutil.copy(vlm.root / name, tmp_path / name)
    missing = tmp_path / "missing.jsonl"
    write_jsonl(missing, [rows[0], {**rows[1], "images": ["nowhere.png"]}])
    out = tmp_path / "o"
    common = ["lora.rank=4"]  # the base as the reference
    err = _one_line_error(capsys, [*_args(vlm, out, *common), f"data.path={missing}"])
    assert err.startswith(f"{missing}, line 2: ") and "nowhere.png" in err
    extra = tmp_path / "extra.jsonl"  # the second row's prompt has one image part, the row two images
    write_jsonl(extra, [rows[0], {**rows[1], "images": vlm.names}])
    err = _one_line_error(capsys, [*_args(vlm, out, *common), f"data.path={extra}"])
    assert err == (f"{extra}, line 2: Number of images provided (2) does not match number of image placeholders "
                   "(1); fix the row or set data.skip_bad_rows: true")
    err = _one_line_error(capsys, [*_args(vlm, out, *common), "data.seq_len=8"])
    assert err.startswith(f"{vlm.root / 'pairs.jsonl'}, line 1: the pair does not fit data.seq_len = 8 without "
                          "cutting its prompt's images")
    text_only = tmp_path / "text_only"
    _text_model(text_only, vlm)
    capsys.readouterr()  # the conversion's own output
    err = _one_line_error(capsys, [*_args(vlm, out, *common), f"model.path={text_only}"])
    assert err.startswith(f"{vlm.root / 'pairs.jsonl'}, line 1: the row has images, and the model {text_only} "
                          "has no vision tower")
    assert not (out / "metrics.jsonl").exists()


def _text_model(folder, vlm) -> None:
    """A tiny random text-only Llama of the tokenizer's vocabulary, converted at ``folder`` with the tokenizer."""
    from tests.hf_models import make_hf

    make_hf(vlm.root / "hf_text", "llama", vocab_size=len(vlm.tok))
    vlm.tok.save_pretrained(str(vlm.root / "hf_text"))
    assert zoo_main(["convert", str(vlm.root / "hf_text"), "--out", str(folder)]) == 0


@pytest.mark.slow
def test_eval_set_with_images_is_trl_loss_on_transformers_logps(vlm, reference, tmp_path):
    """Slow: a run of its own (learning rate 0: the policy stays transformers'). data.eval_path, the two pairs
    again from another folder (their images copied there), is scored with its images: the eval loss is TRL's DPO
    loss on transformers' log-probabilities of the policy and the reference (1e-5)."""
    (tmp_path / "ev").mkdir()
    for name in vlm.names:
        shutil.copy(vlm.root / name, tmp_path / "ev" / name)
    shutil.copy(vlm.root / "pairs.jsonl", tmp_path / "ev" / "pairs.jsonl")
    out = tmp_path / "run"
    assert dpo_main(["train", *_args(vlm, out, f"dpo.reference={vlm.root / 'reference'}", "optimizer.learning_rate=0",
                                      f"data.eval_path={tmp_path / 'ev' / 'pairs.jsonl'}", "eval_every=1")]) == 0
    pol, refs = _hf_answer_logps(vlm, vlm.hf), _hf_answer_logps(vlm, reference)
    want = trl_metrics("sigmoid", [p[0] for p in pol], [p[1] for p in pol], [q[0] for q in refs],
                       [q[1] for q in refs], BETA, 0.0, 0.0, 0.0)
    assert abs(read_metrics(out)[-1]["eval_loss"] - want["loss"]) <= 1e-5


def test_text_pairs_mix_with_image_pairs(vlm, tmp_path):
    """A data mixture's text-only pairs on a vision-language model: their documents have the image pairs' features
    (tagged with no image), and a batch of an image pair and a text pair gives the image row its own patches (those
    of a batch of image pairs alone, whose log-probabilities are transformers': the test above) and the text row
    none."""
    from zoo.data.batching import stacked

    cfg = _cfg(vlm, tmp_path)
    task = DPOTask(cfg)
    task.vision, task.shared_prompt = zoo.read_config(vlm.root / "policy").vision, True  # what prepare() sets
    path, text = str(vlm.root / "pairs.jsonl"), tmp_path / "text.jsonl"
    write_jsonl(text, [{"prompt": p, "chosen": c, "rejected": r} for p, (c, r) in zip(PROMPTS[:1], ANSWERS)])
    docs = task.documents(task.load(path, cfg), vlm.tok, path, False).docs
    plain = task.documents(task.load(str(text), cfg), vlm.tok, str(text), False).docs
    assert plain[0].keys() == docs[0].keys() and not plain[0]["image_doc"].any()
    alone = stacked([docs[0], docs[1]], cfg.data.seq_len + 1, 2, task.finish_rows)
    mixed = stacked([docs[0], plain[0]], cfg.data.seq_len + 1, 2, task.finish_rows)
    for k in alone.keys() & mixed.keys():
        if k.startswith("vision_"):
            np.testing.assert_array_equal(mixed[k][0], alone[k][0], err_msg=k)
    assert mixed["vision_patch_valid"][0].any() and not mixed["vision_patch_valid"][1].any()
