"""Reward models (`reward train`) and KTO (`dpo train`, ``dpo.loss_type: kto``) on rows with images (TRL's vision
rows: a conversational prompt with image parts, an ``images`` column), on a tiny SmolVLM (tests/vlm_models.py)
and its processor (tests/vlm_processors.py): step 1's rewards and loss equal TRL's formulas on transformers'
forward of the same models, reading the processor's ids and pixel values."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import pytest

import zoo
from dpo.cli import main as dpo_main
from rm.cli import main as rm_main
from tests.run_files import one_line_error, read_metrics, write_jsonl
from tests.trl_oracles import assert_same_metrics, logsigmoid
from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main as zoo_main

BETA, WD, WU = 0.1, 1.3, 0.7
PROMPTS = [[{"role": "user", "content": "What is in this picture?"}],
           [{"role": "user", "content": [{"type": "text", "text": "Describe the image, please."}, {"type": "image"}]}]]
ANSWERS = [("It is a red square.", "It is a blue circle."), ("A blue circle.", "It is red, a square.")]
LABELS = (True, False)  # KTO: row 0 answers with its chosen answer, row 1 with its rejected one


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random SmolVLM converted at ``policy`` (the processor's files in its ``tokenizer/``), another (seed 1)
    at ``reference``, two pairs with images (``pairs.jsonl``) and two KTO rows (``kto.jsonl``); transformers' models
    (``hf``, ``hf_ref``) and the processor."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("vlm_rm_kto")
    proc = smolvlm_folder(root / "proc", splitting=False)
    tok = AutoTokenizer.from_pretrained(str(proc))
    image_id = tok.convert_tokens_to_ids("<image>")
    models = []
    for name, seed in (("policy", 0), ("reference", 1)):
        models.append(make_vlm(root / f"hf_{name}", seed=seed, vocab_size=len(tok), image_token_id=image_id))
        assert zoo_main(["convert", str(root / f"hf_{name}"), "--out", str(root / name)]) == 0
    for f in proc.iterdir():  # the image processor's files beside the checkpoints' tokenizers
        for name in ("policy", "reference"):
            shutil.copy(f, root / name / "tokenizer" / f.name)
    names = write_images(root, [(28, 28), (20, 28)])
    write_jsonl(root / "pairs.jsonl", [{"prompt": p, "chosen": c, "rejected": r, "images": [n]}
                                       for p, (c, r), n in zip(PROMPTS, ANSWERS, names)])
    write_jsonl(root / "kto.jsonl", [{"prompt": p, "completion": a[0 if lab else 1], "label": lab, "images": [n]}
                                     for p, a, lab, n in zip(PROMPTS, ANSWERS, LABELS, names)])
    return SimpleNamespace(root=root, tok=tok, hf=models[0], hf_ref=models[1], names=names,
                           proc=reference_processor(proc))


def _args(vlm, out, data, *overrides) -> list[str]:
    return ["train", f"model.path={vlm.root / 'policy'}", f"data.path={vlm.root / data}", "data.seq_len=80",
            "batch_size=2", "max_steps=1", "schedule.name=constant", "log_every=1", "checkpoint.every=100",
            f"output_dir={out}", *overrides]


def _encoded(vlm, r: int, answer: str):
    """(the processor's ids of row ``r``'s prompt with the generation prompt, of prompt + ``answer`` to its
    end-of-turn, pixel values, pixel attention mask)."""
    from PIL import Image

    from chat.formats import multimodal_messages

    image = Image.open(vlm.root / vlm.names[r]).convert("RGB")
    messages = multimodal_messages(PROMPTS[r], 1)
    head = vlm.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    turn = multimodal_messages([{"role": "assistant", "content": answer}], 0)
    text = vlm.tok.apply_chat_template(messages + turn, tokenize=False).removesuffix("\n")
    prompt = vlm.proc(text=[head], images=[[image]], return_tensors="pt")
    enc = vlm.proc(text=[text], images=[[image]], return_tensors="pt")
    return prompt["input_ids"][0], enc["input_ids"][0], enc["pixel_values"], enc["pixel_attention_mask"]


@pytest.mark.slow
def test_reward_model_with_images_step_one_equals_trl_on_transformers(vlm, tmp_path):
    """`reward train` from a SmolVLM on pairs with images (learning rate 0, so the drawn score head is the final
    checkpoint's): each pair's chosen and rejected rewards are the head on transformers' final hidden state at the
    sequence's last non-padding token, the model reading the processor's pixels, and step 1's loss and metrics are
    TRL's RewardTrainer formulas on them.
    Slow (slow lane): about 7.3 s on a quiet 2-core machine (a `reward train` run with images compiled, and
    transformers' forwards)."""
    import torch

    out = tmp_path / "rm"
    assert rm_main(_args(vlm, out, "pairs.jsonl", "optimizer.learning_rate=0")) == 0
    got = read_metrics(out)[0]
    head = np.asarray(zoo.load_params(out / "final")["score"], np.float64)[:, 0]
    pad = vlm.tok.pad_token_id if vlm.tok.pad_token_id is not None else vlm.tok.eos_token_id
    scores = []
    for r, answers in enumerate(ANSWERS):
        for answer in answers:
            _, ids, pixels, mask = _encoded(vlm, r, answer)
            with torch.no_grad():
                hidden = vlm.hf.model(input_ids=ids[None], pixel_values=pixels,
                                      pixel_attention_mask=mask).last_hidden_state[0].double().numpy()
            scores.append(hidden[int(np.flatnonzero(ids.numpy() != pad)[-1])] @ head)
    rc, rr = np.array(scores[0::2]), np.array(scores[1::2])
    both = np.concatenate([rc, rr])
    want = {"loss": float(-logsigmoid(rc - rr).mean()), "min_reward": both.min(), "max_reward": both.max(),
            "mean_reward": both.mean(), "accuracy": float((rc > rr).mean()), "margin": (rc - rr).mean()}
    assert_same_metrics(got, want, tuple(want), {k: np.abs(both).max() for k in ("mean_reward", "margin")})


def _kto_logps(vlm, model) -> tuple[np.ndarray, np.ndarray]:
    """(each KTO row's summed log-probability of its completion, of its mismatched completion: the other row's
    completion ids after this row's prompt ids, as TRL builds the KL pairs) from transformers' forward."""
    import torch

    enc = [_encoded(vlm, r, ANSWERS[r][0 if lab else 1]) for r, lab in enumerate(LABELS)]
    completions = [ids[len(prompt):] for prompt, ids, _, _ in enc]
    sums = []
    for r, (prompt, _, pixels, mask) in enumerate(enc):
        for answer in (completions[r], completions[r - 1]):  # the previous row's, cyclically
            ids = torch.cat([prompt, answer])
            with torch.no_grad():
                logits = model(input_ids=ids[None], pixel_values=pixels, pixel_attention_mask=mask).logits[0].double()
            lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0].numpy()
            sums.append(lp[len(prompt) - 1:].sum())
    return np.array(sums[0::2]), np.array(sums[1::2])


@pytest.mark.slow
def test_kto_with_images_step_one_equals_trl_on_transformers(vlm, tmp_path):
    """`dpo train` with dpo.loss_type kto on unpaired rows with images, full fine-tuning against a reference
    checkpoint: step 1's loss, KL (positive: the seed-1 model trains against the seed-0 one) and rewards are TRL's
    KTO formulas (KTOTrainer._compute_loss) on transformers' log-probabilities of each completion and mismatched
    completion after the row's prompt and image.
    Slow (slow lane): about 9.3 s on a quiet 2-core machine (a KTO run with images and its reference compiled, and
    transformers' forwards)."""
    out = tmp_path / "kto"
    assert dpo_main(_args(vlm, out, "kto.jsonl", "dpo.loss_type=kto", f"dpo.beta={BETA}",
                          f"dpo.desirable_weight={WD}", f"dpo.undesirable_weight={WU}",
                          f"model.path={vlm.root / 'reference'}", f"dpo.reference={vlm.root / 'policy'}",
                          "optimizer.learning_rate=0.01")) == 0
    got = read_metrics(out)[0]
    (y, z), (ry, rz) = _kto_logps(vlm, vlm.hf_ref), _kto_logps(vlm, vlm.hf)
    assert (z - rz).mean() > 0  # the KL term is not clamped to 0
    lab = np.array(LABELS)
    kl = max((z - rz).mean(), 0.0)
    ratio = y - ry
    losses = np.where(lab, WD * (1 - 1 / (1 + np.exp(-BETA * (ratio - kl)))),
                      WU * (1 - 1 / (1 + np.exp(-BETA * (kl - ratio)))))
    want = {"loss": losses.mean(), "kl": kl, "rewards/chosen": BETA * ratio[lab].mean(),
            "rewards/rejected": BETA * ratio[~lab].mean(), "logps/chosen": y[lab].mean(),
            "logps/rejected": y[~lab].mean()}
    want["rewards/margins"] = want["rewards/chosen"] - want["rewards/rejected"]
    scale = BETA * np.abs(np.concatenate([y, ry, z, rz])).max()
    assert_same_metrics(got, want, tuple(want), {k: scale for k in ("kl", "rewards/chosen", "rewards/rejected",
                                                                     "rewards/margins")})


def test_bad_kto_image_row_is_one_line(vlm, tmp_path, capsys):
    """A KTO row with images whose image file is missing: exit 2, one line naming file and line, before step 1."""
    bad = tmp_path / "bad.jsonl"
    for name in vlm.names:
        shutil.copy(vlm.root / name, tmp_path / name)
    write_jsonl(bad, [{"prompt": PROMPTS[0], "completion": "Yes.", "label": True, "images": [vlm.names[0]]},
                      {"prompt": PROMPTS[1], "completion": "No.", "label": False, "images": ["nowhere.png"]}])
    out = tmp_path / "o"
    err = one_line_error(capsys, dpo_main, _args(vlm, out, "kto.jsonl", "dpo.loss_type=kto", "lora.rank=4",
                                                 f"data.path={bad}"))
    assert err.startswith(f"{bad}, line 2: ") and "nowhere.png" in err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_gkd_with_images_step_one_equals_trl_on_transformers(vlm, tmp_path):
    """`sft train` with distill.teacher (offline GKD) on prompt/completion rows with images, the seed-1 SmolVLM
    distilled from the seed-0 one: step 1's loss is TRL's generalized JSD (tests/test_distill.py's transcription
    of GKDTrainer.generalized_jsd_loss) on both transformers models' logits at the completion's tokens, each model
    reading the processor's pixels.
    Slow (slow lane): about 7.0 s on a quiet 2-core machine (a GKD run with images and its teacher compiled, and
    transformers' forwards)."""
    import torch

    from sft.cli import main as sft_main
    from tests.trl_oracles import trl_generalized_jsd

    data = tmp_path / "sft.jsonl"
    for name in vlm.names:
        shutil.copy(vlm.root / name, tmp_path / name)
    write_jsonl(data, [{"prompt": p, "completion": [{"role": "assistant", "content": a[0]}], "images": [n]}
                       for p, a, n in zip(PROMPTS, ANSWERS, vlm.names)])
    out = tmp_path / "gkd"
    assert sft_main(["train", f"model.path={vlm.root / 'reference'}", f"data.path={data}", "data.seq_len=80",
                     "batch_size=2", "max_steps=1", "log_every=1", "checkpoint.every=100", f"output_dir={out}",
                     f"distill.teacher={vlm.root / 'policy'}", "distill.beta=0.3", "distill.lmbda=0"]) == 0
    logits: dict[str, list[np.ndarray]] = {"student": [], "teacher": []}
    for r in range(len(PROMPTS)):
        prompt, ids, pixels, mask = _encoded(vlm, r, ANSWERS[r][0])
        for side, model in (("student", vlm.hf_ref), ("teacher", vlm.hf)):
            with torch.no_grad():
                x = model(input_ids=ids[None], pixel_values=pixels, pixel_attention_mask=mask).logits[0]
            logits[side].append(x.double().numpy()[len(prompt) - 1:-1])  # the positions predicting the completion
    s, t = (np.concatenate(logits[k])[None] for k in ("student", "teacher"))
    want = trl_generalized_jsd(s, t, np.zeros(s.shape[:2]), 0.3, 1.0)
    np.testing.assert_allclose(read_metrics(out)[0]["loss"], want, rtol=1e-5)
