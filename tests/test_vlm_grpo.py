"""`grpo train` on image prompts (TRL's VLM rows: conversational prompts with ``{"type": "image"}`` parts and an
``images`` column) on a tiny SmolVLM (tests/vlm_models.py) and its processor (tests/vlm_processors.py): the prompts'
ids are the processor's, the sampler's and the update's per-token log-probabilities of the completions are
transformers' forward with the pixel values, the reward functions get the rows' fields, and rows whose images cannot
be read are one line naming the row, exit 2, before step 1."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from grpo.cli import main as grpo_main
from tests.run_files import one_line_error, read_metrics, write_jsonl
from tests.vlm_models import make_vlm
from tests.vlm_processors import reference_processor, smolvlm_folder, write_images
from zoo.cli import main as zoo_main

QUESTION = "What is in this picture?"
COLORS = ["red", "blue", "red", "blue"]
# A reward that reads a row field (`color`) and records what it was given, one JSON line a call.
REWARDS = '''
import json


def says_color(prompts, completions, completion_ids, color, images, **columns):
    """1 when the completion names the row's colour."""
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"prompts": prompts, "color": color, "images": images, "completions": completions,
                            "others": sorted(columns)}}) + "\\n")
    return [float(c in t[0]["content"]) for c, t in zip(color, completions)]
'''


def _prompt(n_images: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny random SmolVLM converted at ``zoo`` with the tiny SmolVLM tokenizer and image processor in its
    ``tokenizer/`` folder, transformers' model (``hf``), four image prompt rows (``prompts.jsonl``: images of two
    sizes, one padded by the processor) and a reward module."""
    root = tmp_path_factory.mktemp("vlm_grpo")
    proc = smolvlm_folder(root / "proc", splitting=False)
    tok = reference_processor(proc).tokenizer
    hf = make_vlm(root / "hf", vocab_size=len(tok), image_token_id=tok.convert_tokens_to_ids("<image>"))
    assert zoo_main(["convert", str(root / "hf"), "--out", str(root / "zoo")]) == 0
    for f in proc.iterdir():  # the processor's files beside the checkpoint's tokenizer
        shutil.copy(f, root / "zoo" / "tokenizer" / f.name)
    names = write_images(root, [(28, 28), (20, 28), (28, 14), (24, 24)])
    rows = [{"prompt": _prompt(), "images": [n], "color": c} for n, c in zip(names, COLORS)]
    write_jsonl(root / "prompts.jsonl", rows)
    (root / "rewards.py").write_text(REWARDS.format(log=str(root / "calls.jsonl")))
    return SimpleNamespace(root=root, proc=proc, hf=hf, tok=tok, rows=rows)


def _args(vlm, out, *overrides) -> list[str]:
    return ["train", f"model.path={vlm.root / 'zoo'}", f"data.path={vlm.root / 'prompts.jsonl'}", "data.seq_len=32",
            "batch_size=4", "grpo.num_generations=2", "grpo.max_completion_length=4", "grpo.num_iterations=2",
            f"grpo.rewards=[{vlm.root / 'rewards.py'}:says_color]", "max_steps=2", "log_every=1",
            "checkpoint.every=100", "optimizer.learning_rate=1e-9", f"output_dir={out}", *overrides]


@pytest.fixture(scope="module")
def run(vlm, tmp_path_factory):
    """`grpo train` (2 steps of 2 image prompts x 2 completions, 2 updates a step, a learning rate too small to move
    a greedy choice; 2 prompts held out, completed at the last step) with every batch of prompts it completed
    recorded: (run folder, [(Completed, row indices, RolloutBatch, Rollouts) a step], {mode: (Completed, row
    indices)} of the held-out prompts)."""
    from grpo.rollouts import Rollouts

    seen, completed = [], []
    complete, rollout = Rollouts.complete, Rollouts.rollout

    def recording_complete(self, weights, rows, step, source, mode="train"):
        done = complete(self, weights, rows, step, source, mode)
        completed.append((mode, done, np.asarray(rows["row"])[..., 0].reshape(-1)))
        return done

    def recording_rollout(self, *args, **kwargs):
        out = rollout(self, *args, **kwargs)
        seen.append((*completed[-1][1:], out.batch, self))
        return out

    out = tmp_path_factory.mktemp("vlm_grpo_run") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Rollouts, "complete", recording_complete)
        mp.setattr(Rollouts, "rollout", recording_rollout)
        assert grpo_main(_args(vlm, out, "data.eval_fraction=0.5", "eval_every=2")) == 0
    return out, seen, {mode: (done, rows) for mode, done, rows in completed if mode != "train"}


def _hf_logps(vlm, prompt_ids: list[int], completion: list[int], image: str, blank: bool = False,
              greedy: bool = False) -> np.ndarray:
    """transformers' log-probabilities of ``completion``'s tokens after the prompt with its image's pixel values
    from transformers' own processor (zeros with ``blank``); ``greedy``: its argmax tokens there instead."""
    from PIL import Image

    proc = reference_processor(vlm.proc)
    text = proc.tokenizer.apply_chat_template(_prompt(), tokenize=False, add_generation_prompt=True)
    ref = proc(text=[text], images=[[Image.open(vlm.root / image).convert("RGB")]], return_tensors="pt",
               add_special_tokens=False)
    assert ref["input_ids"][0].tolist() == prompt_ids  # the rollout's prompt: the processor's ids
    pixels = ref["pixel_values"] * (0 if blank else 1)
    ids = torch.tensor([prompt_ids + completion])
    with torch.no_grad():
        logits = vlm.hf(input_ids=ids, pixel_values=pixels, pixel_attention_mask=ref["pixel_attention_mask"]).logits
    logp = torch.log_softmax(logits[0].float(), -1).numpy()
    n = len(prompt_ids)
    if greedy:
        return logp[n - 1:n - 1 + len(completion)].argmax(-1)
    return np.array([logp[n - 1 + k, t] for k, t in enumerate(completion)])


@pytest.mark.slow
def test_completion_logps_of_image_prompts_are_transformers(vlm, run):
    """Slow: the `run` fixture's GRPO run compiles the sampler, the layout, the old policy's pass and the train
    step, each with the image tower (it serves the next test too); the rows of one completion each compile their
    layout and pass here. Step 1 (the starting weights): each completion's per-token log-probabilities, as the
    sampler drew them and as the update's pass computes them (the old policy's, on the rows that share each group's
    prompt and its images; and on rows of one completion each, every row with its prompt's images:
    grpo.share_prompt false, TRL's layout), equal transformers' forward with the processor's pixel values (1e-4);
    with blank pixels they would not (the images are read)."""
    import zoo
    from grpo.batch import UpdateRows
    from grpo.programs import Programs

    done, row_ids, batch, rollouts = run[1][0]
    prompts = np.asarray(done.drawn.prompt_rows["tokens"]).reshape(4, -1)
    valid = np.asarray(done.drawn.prompt_rows["tokens_segment_ids"]).reshape(4, -1) > 0
    sampler = np.asarray(batch.sampler_logps).reshape(4, -1)
    old = np.asarray(batch.old_logps).reshape(4, -1)
    assert batch.vision is not None and batch.inputs.shape[1] == 2  # one row a group, its images with it
    assert row_ids[0] == row_ids[1] != row_ids[2] == row_ids[3]  # a group's G = 2 rows: one prompt
    p, d = rollouts.programs, done.drawn
    apart = Programs(rollouts.cfg, p.mcfg, p.sharding.mesh, p.compute, p.spec.eos_ids, UpdateRows(False, 2, 33, 4))
    rows = apart.layout(d.prompt_rows["tokens"], d.prompt_rows["tokens_segment_ids"], d.completions, d.lengths,
                        d.sampler_logps, np.zeros(4, np.float32), np.ones(4, bool), None, d.vision)
    assert rows.vision.patches.shape[:2] == rows.inputs.shape[:2] == (1, 4)  # each completion's row: its images
    one_each = np.asarray(apart.logps(zoo.load_params(vlm.root / "zoo"), rows)).reshape(4, -1)
    at = np.asarray(rows.weights).reshape(4, -1) > 0  # per position of a prompt + completion row: the completion's
    for r, comp in enumerate(done.ids):
        image = vlm.rows[row_ids[r]]["images"][0]
        want = _hf_logps(vlm, prompts[r][valid[r]].tolist(), comp, image)
        np.testing.assert_allclose(sampler[r, :len(comp)], want, atol=1e-4)
        np.testing.assert_allclose(old[r, :len(comp)], want, atol=1e-4)
        np.testing.assert_allclose(one_each[r][at[r]], want, atol=1e-4)
        if r == 0:
            blank = _hf_logps(vlm, prompts[r][valid[r]].tolist(), comp, image, blank=True)
            assert np.abs(blank - want).max() > 1e-3


@pytest.mark.slow
def test_grpo_train_on_image_prompts_gives_the_rewards_the_rows_fields(vlm, run):
    """Slow: the `run` fixture's (shared with the test above). The run completes its steps, logging the reward; the reward function got each completion's row fields
    (its colour and its images, as the rows have them) beside TRL's prompts and completions."""
    out, seen, _ = run
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and all(0 <= m["reward"] <= 1 for m in metrics)
    assert (out / "final").is_dir()
    calls = [json.loads(x) for x in (vlm.root / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 4  # each step's, then the held-out prompts' (sampled and greedy)
    for call, (done, row_ids, _, _) in zip(calls, seen):
        assert call["prompts"] == done.prompts and len(call["completions"]) == 4
        by_prompt = [next(row for row in vlm.rows if row["images"][0] == im[0]) for im in call["images"]]
        assert call["color"] == [row["color"] for row in by_prompt]
        assert [row["prompt"] for row in by_prompt] == call["prompts"]
        assert call["images"] == [vlm.rows[i]["images"] for i in row_ids]
        assert call["others"] == []


@pytest.mark.slow
def test_held_out_image_prompts_are_completed_with_their_images(vlm, run):
    """Slow: the `run` fixture's. The held-out prompts (data.eval_fraction) are completed with their own images:
    each greedy completion is transformers' argmax, token by token, after its prompt and the processor's pixel
    values; their rewards are logged under TRL's eval names."""
    out, seen, held = run
    assert {"eval_reward", "eval_greedy_reward"} <= set(read_metrics(out)[-1])
    done, row_ids = held["greedy"]
    assert not set(row_ids[:2]) & {int(i) for _, ids, _, _ in seen for i in ids}  # held out of training
    prompts = np.asarray(done.drawn.prompt_rows["tokens"]).reshape(4, -1)
    valid = np.asarray(done.drawn.prompt_rows["tokens_segment_ids"]).reshape(4, -1) > 0
    for r in range(2):  # the two held-out prompts (the batch's other rows repeat the last)
        image = vlm.rows[row_ids[r]]["images"][0]
        want = _hf_logps(vlm, prompts[r][valid[r]].tolist(), done.ids[r], image, greedy=True)
        assert done.ids[r] == want.tolist()


def _one_line_error(capsys, args) -> str:
    return one_line_error(capsys, grpo_main, args)


def test_bad_image_prompts_are_one_line_naming_the_row(vlm, tmp_path, capsys):
    """Exit 2, one line naming the file and line, before step 1: a missing image, a prompt whose image tokens
    data.seq_len would cut, more patches than data.max_patches, more images than image parts, and images on a
    model with no vision tower."""
    data = vlm.root / "bad.jsonl"  # beside the images
    base = ["model.path=" + str(vlm.root / "zoo"), f"data.path={data}", f"output_dir={tmp_path / 'o'}"]

    def error(rows, *more) -> str:
        write_jsonl(data, rows)
        return _one_line_error(capsys, [*_args(vlm, tmp_path / "o"), *base, *more])

    good = vlm.rows[0]
    err = error([good, {**good, "images": ["no_such.png"]}])
    assert err.startswith(f"{data}, line 2: images[0]") and "no_such.png" in err
    err = error([good, good], "data.seq_len=8")
    assert err.startswith(f"{data}, line 1: its prompt of ") and "would cut its image tokens" in err
    err = error([good, good], "data.max_patches=8")
    assert err.startswith(f"{data}, line 1: its 1 image(s) make 1 frame(s) of 16 patches in all, more than "
                          "data.max_patches = 8")
    err = error([{**good, "images": good["images"] * 2}, good])
    assert err.startswith(f"{data}, line 1: Number of images provided (2) does not match number of image "
                          "placeholders (1)")
    text_only = tmp_path / "text_only"
    _text_model(text_only, vlm)
    capsys.readouterr()  # the conversion's own output
    err = error([good, good], f"model.path={text_only}")
    assert err.startswith(f"{data}, line 1: the row has images, and the model {text_only} has no vision tower")


def _text_model(folder, vlm) -> None:
    """A tiny random text-only Llama of the tokenizer's vocabulary, converted at ``folder`` with the tokenizer."""
    from tests.hf_models import make_hf

    make_hf(vlm.root / "hf_text", "llama", vocab_size=len(vlm.tok))
    vlm.tok.save_pretrained(str(vlm.root / "hf_text"))
    assert zoo_main(["convert", str(vlm.root / "hf_text"), "--out", str(folder)]) == 0


# ------------------------------------------------------------------------------------- Gemma 3: image blocks


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """transformers' tiny Gemma 3 (``hf``: sliding layers, so the update lays one completion a row, as a run would)
    over the tiny Gemma 3 tokenizer and image processor, `zoo convert`ed (``ckpt``), and two image prompt rows
    (``prompts.jsonl``: one image before the question, two after it)."""
    from transformers import AutoTokenizer

    from tests.vlm_models import make_gemma3
    from tests.vlm_processors import gemma3_folder

    root = tmp_path_factory.mktemp("gemma3_grpo")
    src = gemma3_folder(root / "hf")
    tok = AutoTokenizer.from_pretrained(str(src))
    ids = tuple(tok.convert_tokens_to_ids(t) for t in ("<image_soft_token>", "<start_of_image>", "<end_of_image>"))
    hf = make_gemma3(src, vocab_size=len(tok), tokens=ids, untied=True)
    assert zoo_main(["convert", str(src), "--out", str(root / "zoo")]) == 0
    names = write_images(root, [(40, 20), (28, 28), (12, 40)], seed=4)
    rows = [{"prompt": _prompt(), "images": names[:1]},
            {"prompt": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image"},
                                                     {"type": "image"}]}], "images": names[1:]}]
    write_jsonl(root / "prompts.jsonl", rows)
    return SimpleNamespace(root=root, src=src, ckpt=root / "zoo", hf=hf, tok=tok, image_id=ids[0], rows=rows)


@pytest.mark.slow
def test_gemma3_image_prompts_sample_and_score_as_transformers(gemma3):
    """Slow: a model of its own and one program of the sampler and the update's pass (about 35 s on a loaded
    2-core machine). Gemma 3's prompts with images (one image, two): their ids are Gemma3Processor's, and each completion `grpo
    train`'s sampler draws has per-token log-probabilities, as drawn (the cached prefill with each image's tokens
    one bidirectional block, then causal decoding steps) and as the update's pass computes them, equal to
    transformers' forward with the processor's pixels and token_type_ids (1e-4); read causally over the images
    (no token_type_ids), transformers' first tokens would differ (the blocks are what is checked)."""
    from PIL import Image

    from tests.vlm_grpo_programs import G, grpo_draws, hf_completion_logps
    from tests.vlm_processors import gemma3_reference_processor

    got = grpo_draws(gemma3.ckpt, gemma3.rows, gemma3.root / "prompts.jsonl", layouts=(False,))
    assert not any(gemma3.image_id in c for c in got.completions) and any(len(set(c)) > 1 for c in got.completions)
    proc = gemma3_reference_processor(gemma3.src)
    for r, (ids, comp) in enumerate(zip(got.ids, got.completions)):
        row = gemma3.rows[got.order[r]]
        text = gemma3.tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        ref = proc(text=[text], images=[[Image.open(gemma3.root / n).convert("RGB") for n in row["images"]]],
                   return_tensors="pt", add_special_tokens=False)
        assert ref["input_ids"][0].tolist() == ids
        blocks = lambda t: (t == gemma3.image_id).long()  # noqa: E731  (Gemma3Processor's token_type_ids)
        want = hf_completion_logps(gemma3.hf, ids, comp, pixel_values=ref["pixel_values"], token_type_ids=blocks)
        np.testing.assert_allclose(got.sampler[r], want, rtol=0, atol=1e-4)
        np.testing.assert_allclose(got.update[False][r], want, rtol=0, atol=1e-4)
        causal = hf_completion_logps(gemma3.hf, ids, comp, pixel_values=ref["pixel_values"])
        assert abs(causal[0] - want[0]) > 1e-3
    assert len(got.ids) == 2 * G
