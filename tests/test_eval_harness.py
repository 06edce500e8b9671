"""`zoo eval --harness`: our lm-eval backend (eval/harness.py) against lm-eval's own `hf` backend, offline.

The tasks are lm-eval task YAMLs written here over local JSONL (lm-eval's ``--include_path`` way), run through
``lm_eval.simple_evaluate`` on both backends on the same weights: the training tests' tiny random Llama (512-id vocabulary) and
the real SmolLM2-135M-Instruct. Multiple choice: acc and acc_norm identical, every request's log-likelihood
within 1e-3; rolling perplexity over documents longer than the window: word/byte perplexity and bits per byte
within 1e-4 relative; generate_until with stop sequences: identical greedy outputs.
"""

import functools
import json
import math

import numpy as np
import pytest

WINDOW = 48  # both backends' max_length: the documents below run over several windows
CHUNK = 20  # tokens per forward pass of a longer row, on the tiny model: windows are read through the cache

QUESTIONS = [  # 2 to 6 choices; the contexts end in a space (it moves to the continuation)
    ("The capital of France is", ["Paris", "London", "Rome"], 0),
    ("Two plus two equals", ["four", "five"], 0),
    ("The colour of the sky on a clear day is", ["blue", "green", "red", "purple"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin", "Rankine", "Réaumur"], 0),
    ("A cat says", ["meow", "woof", "moo", "quack", "oink", "baa"], 0),
    ("The opposite of hot is", ["cold", "warm"], 0),
    ("Bees make", ["honey", "milk", "silk"], 0),
    ("The first letter of the alphabet is", ["A", "Z", "M", "Q"], 0),
]
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog. " * 9 + "It was the best of times, it was the worst of times.",
    "In the beginning there was nothing, and then there was a small model that learned to count: one, two, "
    "three, four, five, six, seven, eight, nine, ten. After that it learned the days of the week, Monday, "
    "Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday, and then the months of the year.",
    "Short one.",
]
# Two batches of 4 (longest first) on the tiny model, both padded to 32 prompt tokens: one generation program
# for both, and the answers still come back across batches in the requests' order.
PROMPTS = [("Once upon a time", "x"), ("List: a, b,", "x"), ("Q: What is 2+2?\nA:", "4"), ("Hello", "x"),
           ("The end of the story is", "x"), ("Roses are red,", "x"), ("One, two,", "x"), ("The sun rises in the", "x")]


def _write_tasks(folder):
    """Three lm-eval task YAMLs over local JSONL files in ``folder``."""
    def jsonl(name, rows):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(folder / name)

    mc = jsonl("mc.jsonl", [{"question": q, "choices": c, "gold": g} for q, c, g in QUESTIONS])
    docs = jsonl("docs.jsonl", [{"text": t} for t in DOCUMENTS])
    gen = jsonl("gen.jsonl", [{"prompt": p, "answer": a} for p, a in PROMPTS])
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "zoo_mc.yaml").write_text(
        f"task: zoo_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {mc}\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer: \"\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1\n")
    (folder / "zoo_ppl.yaml").write_text(
        f"task: zoo_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
        "metadata:\n  version: 1\n")
    (folder / "zoo_gen.yaml").write_text(
        f"task: zoo_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {gen}\noutput_type: generate_until\n"
        "doc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  do_sample: false\n  max_gen_toks: 12\n"
        "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1\n")
    return folder


def _evaluate(lm, folder, limit=None):
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=lm, tasks=["zoo_mc", "zoo_ppl", "zoo_gen"], log_samples=True,
                                   # the local tasks alone: lm-eval's index of its whole library takes 13 s to build
                                   task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                   bootstrap_iters=0, limit=limit)


def _compare(ours, theirs, limit=None):
    """Both backends' results and samples of the first ``limit`` items of each task (all: None)."""
    mc_o, mc_t = ours["results"]["zoo_mc"], theirs["results"]["zoo_mc"]
    assert mc_o["acc,none"] == mc_t["acc,none"] and mc_o["acc_norm,none"] == mc_t["acc_norm,none"]
    n_requests = 0
    for so, st in zip(ours["samples"]["zoo_mc"], theirs["samples"]["zoo_mc"]):
        assert so["doc"] == st["doc"]
        lo = [r[0][0] for r in so["resps"]]
        lt = [r[0][0] for r in st["resps"]]
        np.testing.assert_allclose(lo, lt, atol=1e-3, rtol=0)
        assert [r[0][1] for r in so["resps"]] == [r[0][1] for r in st["resps"]]  # is_greedy
        n_requests += len(lo)
    assert n_requests == sum(len(c) for _, c, _ in QUESTIONS[:limit])
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        a, b = ours["results"]["zoo_ppl"][m], theirs["results"]["zoo_ppl"][m]
        assert math.isfinite(a) and abs(a - b) <= 1e-4 * abs(b), (m, a, b)
    go = [s["resps"][0][0] for s in ours["samples"]["zoo_gen"]]
    gt = [s["resps"][0][0] for s in theirs["samples"]["zoo_gen"]]
    assert go == gt
    assert any(g for g in go)  # something was generated (not all cut at once)


def _hf_side(hf_model, tok):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_model, tokenizer=tok, batch_size=4, max_length=WINDOW, device="cpu")


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory):
    return _write_tasks(tmp_path_factory.mktemp("harness_tasks"))


@pytest.fixture
def local_task_index(monkeypatch):
    """`zoo eval --harness`'s TaskManager over --include-path's tasks alone (lm-eval's whole library takes about
    10 s to index; the tasks here are all local), as tests/test_command_line.py's."""
    from lm_eval import tasks

    monkeypatch.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))


@pytest.mark.slow
def test_tiny_model_matches_lm_evals_hf_backend(tiny_lm, task_folder, no_env_report):
    """Slow (slow lane): an oracle run, lm-eval's simple_evaluate of every task on both backends."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import zoo
    from eval.harness import LmzooLM

    tok = AutoTokenizer.from_pretrained(str(tiny_lm / "tok"))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_lm / "hf"), dtype=torch.float32).eval()
    model = zoo.load(tiny_lm / "zoo")
    # chunk < WINDOW: every full window (and every long multiple-choice row) is read through the KV cache in
    # chunks, and still gives lm-eval's numbers (the SmolLM2 test below reads each window whole).
    ours = _evaluate(LmzooLM(model=model, tokenizer=tok, batch_size=4, max_length=WINDOW, chunk=CHUNK), task_folder)
    _compare(ours, _evaluate(_hf_side(hf, tok), task_folder))
    # Some document spans several windows, so the rolling path was exercised.
    assert max(len(tok.encode(d)) for d in DOCUMENTS) > 2 * WINDOW
    _native_equals_harness(model, tok, task_folder, ours)


def _native_equals_harness(model, tok, folder, harness):
    """`zoo eval`'s own tasks over the same items give the harness's acc, acc_norm, per-choice log-likelihoods
    and rolling perplexities (lm-eval's definitions)."""
    from eval.scoring import evaluate
    from eval.task_files import task_from_dict

    mc = task_from_dict({"kind": "multiple_choice", "data": str(folder / "mc.jsonl"),
                         "context": "Question: {question}\nAnswer: ", "choices": "choices", "gold": "gold"},
                        folder / "native_mc.yaml")
    ppl = task_from_dict({"kind": "perplexity", "data": str(folder / "docs.jsonl"), "window": WINDOW, "chunk": CHUNK},
                         folder / "native_ppl.yaml")
    res = evaluate(model.cfg, model.param_dict(), tok, [mc, ppl], batch_size=4, progress=False, log_samples=True)
    native_mc, native_ppl = res["tasks"]["native_mc"], res["tasks"]["native_ppl"]
    for m in ("acc", "acc_norm"):
        assert native_mc["metrics"][m] == harness["results"]["zoo_mc"][f"{m},none"], m
    for item, sample in zip(native_mc["log"], harness["samples"]["zoo_mc"]):
        np.testing.assert_allclose(item["loglikelihoods"], [r[0][0] for r in sample["resps"]], atol=1e-4, rtol=0)
    for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        a, b = native_ppl["metrics"][m], harness["results"]["zoo_ppl"][f"{m},none"]
        assert abs(a - b) <= 1e-4 * abs(b), (m, a, b)


@pytest.mark.slow
def test_smollm2_matches_lm_evals_hf_backend(smollm2, task_folder, no_env_report):
    """Slow (slow lane): an oracle run of lm-eval on the real SmolLM2-135M, on both backends."""
    import zoo
    from eval.harness import LmzooLM

    ckpt, hf, tok = smollm2
    # The first two items of each task (5 choices of 2 and 3, the long document and another, 2 prompts): running
    # the real model on both sides is most of the cost; every kind of request still runs on both (the tiny model
    # above runs every item, several batches of each kind).
    ours = _evaluate(LmzooLM(model=zoo.load(ckpt), tokenizer=tok, batch_size=4, max_length=WINDOW), task_folder, 2)
    _compare(ours, _evaluate(_hf_side(hf, tok), task_folder, 2), 2)
    assert max(len(tok.encode(d)) for d in DOCUMENTS) > 2 * WINDOW  # the rolling path: several windows


@pytest.mark.slow
def test_zoo_eval_harness_cli_writes_results_and_samples(tiny_lm, task_folder, local_task_index, no_env_report,
                                                         tmp_path, capsys):
    """Slow (slow lane): lm-eval's tasks through `zoo eval --harness`, on the training tests' tiny model (what
    the command writes is the point here; the numbers are compared with lm-eval's on both models above)."""
    import shutil

    from eval.harness_run import samples_path
    from zoo.checkpoints.format import TOKENIZER_DIR
    from zoo.cli import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_lm / "zoo", ckpt)
    shutil.copytree(tiny_lm / "tok", ckpt / TOKENIZER_DIR, dirs_exist_ok=True)  # with its tokenizer, as convert writes
    out = tmp_path / "res" / "results.json"
    # The first 4 items of each task in one batch of 4, lm-eval's context of WINDOW tokens: the programs of
    # test_tiny_model_matches_lm_evals_hf_backend's first batches, compiled once.
    assert main(["eval", str(ckpt), "--harness", "zoo_mc,zoo_gen", "--include-path", str(task_folder), "--limit", "4",
                 "--batch-size", "4", "--max-length", str(WINDOW), "--out", str(out), "--log-samples"]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "lmzoo" and set(report["results"]) == {"zoo_mc", "zoo_gen"}
    assert "acc_norm,none" in report["results"]["zoo_mc"] and "exact_match,none" in report["results"]["zoo_gen"]
    lines = [json.loads(x) for x in samples_path(out).read_text().splitlines()]
    assert sorted({x["task"] for x in lines}) == ["zoo_gen", "zoo_mc"] and len(lines) == 8  # --limit 4 each
    assert "zoo_mc" in capsys.readouterr().out  # lm-eval's table


@pytest.mark.slow
@pytest.mark.parametrize("argv, words", [
    (["--harness", "no_such_task_xyz"], ["--harness no_such_task_xyz", "not an lm-eval task"]),
    (["--harness", "zoo_mc", "--include-path", "/nonexistent/tasks"], ["--include-path", "no such folder"]),
    (["--harness", "zoo_mc", "--tasks", "wikitext_tiny"], ["either --tasks", "or --harness"]),
    (["--harness", "zoo_mc", "--log-samples"], ["--log-samples", "--out"]),
    (["--harness", "zoo_mc", "--chunk", "0"], ["--chunk 0", "at least 1"]),
    (["--tasks", "wikitext_tiny", "--max-length", "64"], ["--max-length", "--harness"]),
])
def test_harness_user_errors_are_one_line(tiny_lm, task_folder, local_task_index, argv, words, capsys):
    from zoo.cli import main

    extra = ["--include-path", str(task_folder)] if "--include-path" not in argv else []
    assert main(["eval", str(tiny_lm / "zoo"), *argv, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err


def test_harness_without_lm_eval_names_the_extra(tiny_lm, monkeypatch, capsys):
    import sys

    from zoo.cli import main

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError, as without the extra
    assert main(["eval", str(tiny_lm / "zoo"), "--harness", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lmzoo[eval]" in err, err
