"""`zoo eval` with images on a tiny SmolVLM (tests/vlm_models.py, tests/vlm_processors.py): multiple-choice
log-likelihoods equal transformers' forward with the pixels, generation tasks' answers equal transformers'
``generate``; and a row whose images cannot be used is one line naming the row (file and line), exit 2, before
step 1, through `sft train`, `zoo eval` and `zoo generate --image`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sft.cli import main as sft_main
from tests.run_files import write_jsonl
from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main

QUESTION = "What is in this picture?"
# Tiles on: 56 x 42 is 2 x 2 tiles and the whole (5 frames), 60 x 12 is 1 x 2 and the whole (3 frames).
SIZES = [(56, 42), (60, 12)]
CHOICES = ["red", "blue", "a circle"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """transformers' tiny SmolVLM (``hf``) over the tiny processor (``src``, tiles on), its `zoo convert`ed
    checkpoint with the processor files (``ckpt``), its reference processor, two image files beside the data."""
    root = tmp_path_factory.mktemp("vlm_eval")
    src = smolvlm_folder(root / "hf", splitting=True)
    proc = reference_processor(src)
    hf = make_vlm(src, vocab_size=len(proc.tokenizer), image_token_id=proc.tokenizer.convert_tokens_to_ids("<image>"))
    assert main(["convert", str(src), "--out", str(root / "zoo")]) == 0
    return SimpleNamespace(root=root, hf=hf, src=src, ckpt=root / "zoo", proc=proc,
                           images=write_images(root, SIZES, seed=3))


def _pil(vlm, names):
    from PIL import Image

    return [Image.open(vlm.root / n).convert("RGB") for n in names]


def _mc_reference(row: dict) -> tuple[str, list[str]]:
    """(the context as transformers' processor reads it, its images) of a multiple-choice row: a context without
    an ``<image>`` has its images before it (the task file's rule)."""
    names = row.get("images") or ([row["image"]] if "image" in row else [])
    text = row["question"]
    return (text if "<image>" in text else "<image>" * len(names) + text), names


def _hf_loglikelihood(vlm, context: str, names: list[str], choice: str) -> float:
    """transformers' summed log p(choice | context): the processor's ids of the context and of context + choice
    (the choice's tokens the tail, as lm-evaluation-harness splits them), one forward with the pixels."""
    images = [_pil(vlm, names)] if names else None
    ctx = vlm.proc(text=[context], images=images, return_tensors="pt")
    whole = vlm.proc(text=[context + " " + choice], images=images, return_tensors="pt")
    n = len(ctx["input_ids"][0])
    assert whole["input_ids"][0, :n].tolist() == ctx["input_ids"][0].tolist()
    with torch.no_grad():
        logits = vlm.hf(**{k: v for k, v in whole.items() if k != "attention_mask"}).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    ids = whole["input_ids"][0]
    return float(sum(logp[t - 1, ids[t]] for t in range(n, len(ids))))


def _hf_answer(vlm, messages, names: list[str]) -> str:
    """transformers' greedy answer (8 tokens at most) to TRL's conversation with its images."""
    from trl.data_utils import prepare_multimodal_messages

    tok = vlm.proc.tokenizer
    images = _pil(vlm, names)
    text = tok.apply_chat_template(prepare_multimodal_messages(messages, images), tokenize=False,
                                   add_generation_prompt=True)
    inputs = vlm.proc(text=[text], images=[images], return_tensors="pt")
    with torch.no_grad():
        out = vlm.hf.generate(**inputs, do_sample=False, max_new_tokens=8, eos_token_id=[tok.eos_token_id],
                              pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def _task(folder, name: str, rows: list[dict], **spec) -> str:
    """A task YAML file ``name``.yaml with its rows in ``name``.jsonl beside it; its path."""
    import yaml

    write_jsonl(folder / f"{name}.jsonl", rows)
    (folder / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "data": f"{name}.jsonl", **spec}))
    return str(folder / f"{name}.yaml")


def _mc_rows(vlm) -> list[dict]:
    """Multiple-choice rows of 5 frames (an ``<image>`` in the text), 8 (two images, none: before the text), none,
    and 3 (the ``image`` column)."""
    a, b = vlm.images
    turn = "User:<image>" + QUESTION + "<end_of_utterance>\nAssistant:"
    return [{"question": turn, "choices": CHOICES, "answer": 1, "images": [a]},
            {"question": "User:" + QUESTION, "choices": CHOICES, "answer": 0, "images": [b, a]},
            {"question": "User:" + QUESTION, "choices": CHOICES, "answer": 2},
            {"question": turn, "choices": CHOICES, "answer": 0, "image": b}]


def _mc_task(vlm) -> str:
    return _task(vlm.root, "mc", _mc_rows(vlm), kind="multiple_choice", context="{question}", choices="choices",
                 gold="answer")


@pytest.mark.slow
def test_eval_tasks_with_images_are_transformers(vlm):
    """`zoo eval` on four tasks with images: every choice's log-likelihood on the KV-cache path is transformers'
    forward with the pixels (1e-4), rows of 5, 8, no and 3 frames in one batch, and with two few-shot examples
    (each example's images before its text, then the question's: a question without images after examples with
    them too; examples from a fewshot_data file of their own, their images beside it); a generation task (TRL's content parts, and a string turn) and a prompt-template one answer as
    transformers' ``generate``. Slow (slow lane): about 17 s on a quiet 2-core machine, 29 s in CI's loaded run
    (the five tasks' programs on the engine and the KV-cache path; transformers' forwards and generations)."""
    a, b = vlm.images
    parts = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    chats = [[{"role": "user", "content": parts}], [{"role": "user", "content": QUESTION}]]
    names = [[a], [b]]
    want = [_hf_answer(vlm, c, n) for c, n in zip(chats, names)]
    gen_rows = [{"messages": c + [{"role": "assistant", "content": r}], "images": n}
                for c, n, r in zip(chats, names, [want[0], "not it"])]
    gen = _task(vlm.root, "gen", gen_rows, kind="generation", messages="messages", max_new_tokens=8)
    prompt = _task(vlm.root, "prompt", [{"q": QUESTION, "answer": w, "images": n} for w, n in zip(want, names)],
                   kind="generation", prompt="{q}", target="{answer}", chat_template=True, max_new_tokens=8)
    shot_rows = _mc_rows(vlm)[1:]  # 8 frames (two images before the text), none, 3 (an <image> in the text)
    shots = _task(vlm.root, "shots", shot_rows, kind="multiple_choice", context="{question}", choices="choices",
                  gold="answer", num_fewshot=2)
    # Examples from fewshot_data in a folder of its own (an image of the same name as the task's, other pixels); the
    # question has no image.
    (vlm.root / "fs").mkdir(exist_ok=True)
    (fs_image,) = write_images(vlm.root / "fs", [(28, 28)], seed=5)
    write_jsonl(vlm.root / "fs" / "shots.jsonl", [{**shot_rows[0], "images": [fs_image]}])
    plain = {"question": "User:" + QUESTION, "choices": CHOICES, "answer": 2}
    shot_file = _task(vlm.root, "shot_file", [plain], kind="multiple_choice", context="{question}",
                      choices="choices", gold="answer", num_fewshot=1, fewshot_data="fs/shots.jsonl")
    out = vlm.root / "results.json"
    tasks = f"{_mc_task(vlm)},{gen},{prompt},{shots},{shot_file}"
    assert main(["eval", str(vlm.ckpt), "--tasks", tasks, "--out", str(out),
                 "--log-samples", "--batch-size", "4"]) == 0
    report = json.loads(out.read_text())["tasks"]
    log = [json.loads(line) for line in out.with_name("results.samples.jsonl").read_text().splitlines()]

    mc_rows = _mc_rows(vlm)
    hf_lls = [[_hf_loglikelihood(vlm, *_mc_reference(r), c) for c in CHOICES] for r in mc_rows]
    np.testing.assert_allclose([s["loglikelihoods"] for s in log if s["task"] == "mc"], hf_lls, atol=1e-4, rtol=0)
    assert report["mc"]["metrics"]["acc"] == np.mean([np.argmax(h) == r["answer"] for h, r in zip(hf_lls, mc_rows)])
    # Few-shot: each row's two examples (the other rows, in order) with their images before their text, then the
    # question with its own; the processor reads the images in that order.
    want_shots = []
    for i, row in enumerate(shot_rows):
        texts, names = [], []
        for r in [*shot_rows[:i], *shot_rows[i + 1:], row]:
            text, own = _mc_reference(r)
            texts.append(text + (" " + CHOICES[r["answer"]] if r is not row else ""))
            names += own
        want_shots.append([_hf_loglikelihood(vlm, "\n\n".join(texts), names, c) for c in CHOICES])
    np.testing.assert_allclose([s["loglikelihoods"] for s in log if s["task"] == "shots"], want_shots, atol=1e-4,
                               rtol=0)
    context = f"<image>User:{QUESTION} {CHOICES[shot_rows[0]['answer']]}\n\nUser:{QUESTION}"
    np.testing.assert_allclose([s["loglikelihoods"] for s in log if s["task"] == "shot_file"],
                               [[_hf_loglikelihood(vlm, context, [f"fs/{fs_image}"], c) for c in CHOICES]],
                               atol=1e-4, rtol=0)
    for name in ("gen", "prompt"):
        assert [s["answer"] for s in log if s["task"] == name] == want
    assert report["gen"]["metrics"]["exact_match"] == 0.5 and report["prompt"]["metrics"]["exact_match"] == 1.0
    assert want[0] != want[1]


@pytest.mark.slow
def test_full_forward_with_images_is_transformers(vlm):
    """Slow: a model load and a compilation of its own. The full forward of eval/loglikelihood.py (each context
    and choice one row, no cache) with the rows' images gives transformers' log-likelihoods too (1e-4)."""
    import zoo
    from chat.images import ImageExpander
    from eval.image_prompts import row_images
    from eval.loglikelihood import request_scores
    from eval.multiple_choice import mc_image_questions
    from eval.task_files import load_task
    from zoo.data.tokenizer import load_tokenizer

    task = load_task(_mc_task(vlm))
    tok = load_tokenizer(vlm.ckpt)
    model = zoo.load(vlm.ckpt, dtype=np.float32)
    images = row_images(task, ImageExpander.from_folder(vlm.ckpt / "tokenizer", tok), model.cfg, task.rows(), 0)
    qs = mc_image_questions(tok, task, task.rows(), images=images)
    requests = [(ctx + c, len(c)) for (ctx, conts, _, _), _ in qs for c in conts]
    frames = [f for (_, conts, _, _), f in qs for _ in conts]
    full = request_scores(model.cfg, model.param_dict(), requests, batch_size=12, frames=frames)  # one compilation
    hf_lls = [[_hf_loglikelihood(vlm, *_mc_reference(r), c) for c in CHOICES] for r in _mc_rows(vlm)]
    np.testing.assert_allclose(np.reshape([s for s, _ in full], (4, 3)), hf_lls, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------- bad rows: one line, exit 2


def _chat_row(n_parts: int, images: list) -> dict:
    user = [{"type": "image", "text": None}] * n_parts + [{"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": user},
                         {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]}],
            "images": images}


# case -> (the bad row's images and image parts, what its error says)
BAD = {
    "missing image": (1, ["missing.png"], "images[0] 'missing.png' not found"),
    "unreadable image": (1, ["broken.png"], "images[0] 'broken.png' is not an image Pillow can read"),
    "text model": (1, ["img0.png"], "has no vision tower"),
    "more images than placeholders": (1, ["img0.png", "img1.png"],
                                      "Number of images provided (2) does not match number of image placeholders (1)"),
    "fewer images than placeholders": (2, ["img0.png"],
                                       "Number of images provided (1) does not match number of image placeholders (2)"),
    "too long": (8, ["img0.png"] * 8, None),  # each command says it in its own words (below)
}
TOO_LONG = {"sft": "past data.seq_len = 64", "eval": "more than the model's context of 256",
            "generate": "more than the model's context of 256"}
# zoo generate --image puts one image part per image itself: the reverse of a mismatch is a typed <image>.
GENERATE = {"missing image": "no such file", "unreadable image": "is not an image Pillow can read",
            "text model": "has no vision tower", "fewer images than placeholders": "has 2 <image> placeholder(s) for 1",
            "too long": TOO_LONG["generate"]}


@pytest.fixture(scope="module")
def bad_inputs(vlm, tiny_family):
    """The broken image file beside the data, and a text model's checkpoint (a copy of the shared tiny Llama's,
    with the vision model's tokenizer: the rows' images are refused before any token is read)."""
    import shutil

    (vlm.root / "broken.png").write_bytes(b"not a png at all")
    text_model = vlm.root / "text_model"
    shutil.copytree(tiny_family("llama")[1] / "zoo", text_model)
    shutil.copytree(vlm.ckpt / "tokenizer", text_model / "tokenizer", dirs_exist_ok=True)
    return SimpleNamespace(text_model=text_model)


def _one_line(capsys, run, args) -> str:
    capsys.readouterr()
    assert run(args) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.out + captured.err
    return err[0].removeprefix("error: ")


@pytest.mark.parametrize(("case", "command"), [(case, command) for case in BAD for command in ("sft", "eval", "generate")
                                               if command != "generate" or case in GENERATE])
def test_bad_image_input_is_one_line_naming_the_row(vlm, bad_inputs, tmp_path, capsys, command, case):
    """Each problem with a row's images is one line, exit 2, before step 1 (nothing trains, scores or
    generates): naming the data file and line for `sft train` and `zoo eval` (line 2 holds the bad row after a
    good one), the --image flag for `zoo generate`."""
    n_parts, images, says = BAD[case]
    says = says or TOO_LONG[command]
    ckpt = bad_inputs.text_model if case == "text model" else vlm.ckpt
    if command == "generate":
        prompt = QUESTION + (" <image>" if case == "fewer images than placeholders" else "")
        err = _one_line(capsys, main, ["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "2",
                                       *[a for n in images for a in ("--image", str(vlm.root / n))]])
        assert GENERATE[case] in err, err
        return
    data = vlm.root / f"bad_{command}_{case.replace(' ', '_')}.jsonl"
    write_jsonl(data, [_chat_row(1, [vlm.images[0]]), _chat_row(n_parts, images)])  # line 2 is the bad row
    if command == "sft":
        err = _one_line(capsys, sft_main, ["train", f"model.path={ckpt}", f"data.path={data}", "data.seq_len=64",
                                           "data.packing=false", "batch_size=1", "max_steps=1",
                                           f"output_dir={tmp_path / 'out'}"])
    else:
        import yaml

        task = tmp_path / "task.yaml"
        task.write_text(yaml.safe_dump({"kind": "generation", "data": str(data), "messages": "messages"}))
        err = _one_line(capsys, main, ["eval", str(ckpt), "--tasks", str(task)])
    line = 1 if case == "text model" else 2  # on a text model, the good row's image is refused already
    assert err.startswith(f"{data}, line {line}: ") and says in err, err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("metrics.jsonl"))


def test_what_images_do_not_go_with_yet_is_one_line(vlm, tmp_path, capsys):
    """Few-shot examples with images in a generation task (`zoo eval`), and image rows in eval.tasks during
    training (refused when the hook is made, before the model loads): one line each, naming the task or the row."""
    from eval.during_training import ScoredTasks
    from zoo.errors import UserError

    rows = [{"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Red."}]}] * 2
    rows[1] = {**rows[1], "images": [vlm.images[0]]}
    task = _task(vlm.root, "shots", rows, kind="generation", messages="messages")
    err = _one_line(capsys, main, ["eval", str(vlm.ckpt), "--tasks", task, "--num-fewshot", "1"])
    assert err.startswith(f"task shots ({task}): generation rows with images do not go with few-shot examples yet"), err
    with pytest.raises(UserError, match=r"shots\.jsonl, line 2: the row has images, which eval\.tasks does not "
                                        r"score during training yet"):
        ScoredTasks([task], None, None, 8)
