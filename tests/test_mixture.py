"""Data mixtures (`data.path` as a list of weighted sources, pretrain/data/mixture.py): config, proportions, resume."""

import json

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import zoo
from pretrain.cli import main as pretrain_main
from pretrain.config import data_sources, load_config, to_yaml
from pretrain.data.run import read_run_data
from pretrain.loop import train
from pretrain.runfolder import config_changes
from sft.config import SFTConfig
from sft.task import SFTTask
from tests.tiny_lm import copy_tiny_lm
from zoo.errors import UserError

COLORS = "red blue green yellow black white".split()
SHAPES = "circle square triangle star".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    """A tiny model and two SFT sources in two formats: `messages` (colours) and prompt/completion (shapes)."""
    root = tmp_path_factory.mktemp("mix")
    tok = copy_tiny_lm(tiny_lm, root)
    rng = np.random.RandomState(0)
    with open(root / "colours.jsonl", "w") as f:
        for _ in range(96):
            c = COLORS[rng.randint(len(COLORS))]
            f.write(json.dumps({"messages": [{"role": "system", "content": "Repeat."},
                                             {"role": "user", "content": f"colour {c}"},
                                             {"role": "assistant", "content": " ".join([c] * rng.randint(1, 9))}]})
                    + "\n")
    with open(root / "shapes.jsonl", "w") as f:
        for _ in range(96):
            s = SHAPES[rng.randint(len(SHAPES))]
            f.write(json.dumps({"prompt": f"shape {s} ->", "completion": " " + " ".join([s] * rng.randint(1, 9))})
                    + "\n")
    return root, tok


def _cfg(root, out, *overrides):
    # data.format is the colours' format; the shapes source names its own (it has no `messages` column).
    sources = (f"data.path=[{{path: {root / 'colours.jsonl'}, weight: 0.7}}, "
               f"{{path: {root / 'shapes.jsonl'}, weight: 0.3, format: prompt_completion}}]")
    return load_config(None, [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", sources,
                              "data.format=messages", "data.seq_len=64", "batch_size=4", "data.eval_fraction=0.05",
                              "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
                              "checkpoint.every=2", f"output_dir={out}", *overrides], SFTConfig)


def _data(cfg, tok):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "fsdp"))
    sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
    return read_run_data(cfg, SFTTask(cfg), tok, len(tok), sharding, cfg.batch_size)


def test_mixture_draws_its_weights_and_reports_them(setup, tmp_path):
    root, tok = setup
    data = _data(_cfg(root, tmp_path, "max_steps=1"), tok)
    chat = tok.convert_tokens_to_ids("<|im_start|>")  # in every rendered conversation, in no prompt/completion
    docs, tokens = {"colours": 0, "shapes": 0}, {"colours": 0, "shapes": 0}
    for _ in range(60):  # 240 rows, ~700 documents
        b = next(data.batches)
        assert not [k for k in b if k.startswith("mixture_source")]  # the source tags stay out of the batches
        for row, seg in zip(b["tokens"], b["tokens_segment_ids"]):  # best-fit: whole documents, one per segment
            for s in set(seg[seg > 0].tolist()):
                source = "colours" if chat in row[seg == s] else "shapes"
                docs[source] += 1
                tokens[source] += int((seg == s).sum())
    report = data.mixture_report()
    assert list(report) == ["colours", "shapes"]
    # The counts the checkpointed state keeps are what the batches really hold (sources told apart by content).
    assert {k: v["documents"] for k, v in report.items()} == docs
    assert {k: v["tokens"] for k, v in report.items()} == tokens
    assert report["colours"]["weight"] == pytest.approx(0.7) and report["shapes"]["path"].endswith("shapes.jsonl")
    # grain's mix is a fixed interleave by weight, not a sample, so the proportions drawn from it are exact; what
    # the batches hold lags by the documents best-fit still keeps in its 32 open rows per lane, mostly short ones
    # (fillers): here 0.61 of the documents are colours after 10 batches, 0.69 after 60 (of ~180 per lane).
    assert report["colours"]["realized_fraction"] == pytest.approx(0.7, abs=0.02)
    assert report["shapes"]["realized_fraction"] == pytest.approx(0.3, abs=0.02)
    assert report["colours"]["token_fraction"] > report["colours"]["realized_fraction"]  # its documents are longer
    # Each source holds out its own eval rows (data.eval_fraction), reported by source.
    assert {k: len(v) for k, v in data.eval_sets.items()} == {"colours": 4, "shapes": 4}
    assert len(data.eval_docs) == 8
    # One document per row (no packing holds any back): each lane's k-th row is the mix's k-th draw, so after
    # 20 batches each of the 4 lanes is within one document of 0.7 x 20.
    rows = _data(_cfg(root, tmp_path, "max_steps=1", "data.packing=false"), tok)
    for _ in range(20):
        next(rows.batches)
    assert abs(rows.mixture_report()["colours"]["documents"] - 0.7 * 80) <= 4


def test_same_seed_same_draws_and_exact_resume_of_the_data(setup, tmp_path):
    root, tok = setup
    cfg = _cfg(root, tmp_path, "max_steps=1")
    a, b = _data(cfg, tok), _data(cfg, tok)
    first = [next(a.batches) for _ in range(5)]
    for x in first:
        y = next(b.batches)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    state = json.loads(json.dumps(a.batches.get_state()))  # as grain's checkpoint handler writes it
    report = a.mixture_report()
    for _ in range(3):
        next(b.batches)
    b.batches.set_state(state)  # back to where `a` is: lanes, best-fit's open rows and the counts
    assert b.mixture_report() == report
    for _ in range(5):
        x, y = next(a.batches), next(b.batches)
        assert all(np.array_equal(x[k], y[k]) for k in x)
    assert b.mixture_report() == a.mixture_report() != report
    other = _data(_cfg(root, tmp_path, "max_steps=1", "seed=1"), tok)
    assert not np.array_equal(next(other.batches)["tokens"], first[0]["tokens"])
    # A mixture of one source packs exactly what the plain path (which never goes through the mix) packs.
    plain, one = (_data(_cfg(root, tmp_path, "max_steps=1", f"data.path={p}"), tok)
                  for p in (root / "colours.jsonl", f"[{root / 'colours.jsonl'}]"))
    for _ in range(3):
        x, y = next(plain.batches), next(one.batches)
        assert set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x)


@pytest.mark.slow
def test_interrupted_mixture_run_resumes_bit_for_bit(setup, tmp_path, monkeypatch):
    root, _ = setup
    cfg = _cfg(root, tmp_path / "full", "max_steps=4")
    full = train(cfg, progress=False, task=SFTTask(cfg))
    import pretrain.steps as trainer

    real, calls = trainer.to_model_batch, []

    def crash_at_3(b):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed after step 2 was checkpointed
        return real(b)

    cfg = _cfg(root, tmp_path / "resumed", "max_steps=4")
    monkeypatch.setattr(trainer, "to_model_batch", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, task=SFTTask(cfg))
    counted = []
    monkeypatch.setattr(trainer, "to_model_batch", lambda b: counted.append(1) or real(b))
    resumed = train(cfg, progress=False, task=SFTTask(cfg))
    assert len(counted) == 2  # it resumed at step 2 (a restart would pass the rest of the test too)
    losses = [[json.loads(x)["loss"] for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("full", "resumed")]
    assert losses[1][-2:] == losses[0][-2:]
    for x, y in zip(jax.tree.leaves(zoo.load_params(full)), jax.tree.leaves(zoo.load_params(resumed))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The saved config round trips, sources included; the checkpointed data state holds the counts per source.
    saved = load_config(tmp_path / "resumed" / "config.yaml", schema=SFTConfig)
    assert saved == cfg and [s.name for s in data_sources(saved)] == ["colours", "shapes"]
    state = json.loads(next((tmp_path / "resumed" / "checkpoints" / "4" / "data").glob("process_0-of-1.json"))
                       .read_text())
    assert len(state["mixture"]["documents"]) == 2 and min(state["mixture"]["documents"]) > 0


@pytest.mark.slow
def test_eval_loss_per_source_and_the_report_in_final(setup, tmp_path, capsys):
    root, _ = setup
    # grad_accum 4: an eval batch is one row, which each source's 4 held-out examples fill.
    cfg = _cfg(root, tmp_path / "run", "max_steps=1", "eval_every=1", "grad_accum=4")
    final = train(cfg, progress=False, task=SFTTask(cfg))
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"eval_loss", "eval_loss/colours", "eval_loss/shapes"} <= set(rec)
    assert rec["eval_loss/colours"] != rec["eval_loss/shapes"]
    assert min(rec["eval_loss/colours"], rec["eval_loss/shapes"]) <= rec["eval_loss"] <= \
        max(rec["eval_loss/colours"], rec["eval_loss/shapes"])
    mixture = zoo.checkpoints.format.read_meta(final)["training"]["mixture"]
    assert set(mixture) == {"colours", "shapes"} and mixture["colours"]["weight"] == pytest.approx(0.7)
    assert sum(m["documents"] for m in mixture.values()) > 0
    assert "data mixture: colours" in capsys.readouterr().err


def test_inspect_shows_each_source_in_its_own_format(setup, capsys):
    from sft.cli import main as sft_main

    root, _ = setup
    sources = (f"data.path=[{{path: {root / 'colours.jsonl'}, weight: 0.7}}, "
               f"{{path: {root / 'shapes.jsonl'}, weight: 0.3, format: prompt_completion}}]")
    assert sft_main(["inspect", f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", sources,
                     "data.format=messages", "max_steps=1", "-n", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "colours.jsonl: 96 rows, format messages" in out and "shapes.jsonl: 96 rows, format prompt_completion" in out
    assert "shapes.jsonl, line 1:" in out


def _error(capsys, argv):
    code = pretrain_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("sources, words", [
    ("[{path: a.jsonl, weight: 0.7}, {path: b.jsonl, weight: -1}]", ["data.path[1].weight", "positive"]),
    ("[{path: a.jsonl, weight: 0.7}, {path: b.jsonl, wieght: 0.3}]", ["data.path[1].wieght", "data.path[1].weight"]),
    ("[{path: a.jsonl, weight: lots}]", ["data.path[0].weight", "float"]),
    ("[{weight: 1}]", ["data.path[0].path"]),
    ("[]", ["data.path", "at least one source"]),
    ("[{path: a.jsonl, name: x}, {path: b.jsonl, name: x}]", ["data.path[1].name", "'x'"]),
])
def test_bad_sources_are_one_line_errors(capsys, sources, words):
    err = _error(capsys, ["train", "model.path=m", "max_steps=1", f"data.path={sources}", "--print-config"])
    assert all(w in err for w in words), err


def test_print_config_round_trips_a_mixture(tmp_path, capsys):
    args = ["model.path=m", "max_steps=1", "data.path=[{path: a.jsonl, weight: 2}, b.txt]"]
    assert pretrain_main(["train", *args, "--print-config"]) == 0
    shown = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(shown)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg == load_config(None, args) and to_yaml(cfg) == shown
    assert yaml.safe_load(shown)["data"]["path"][1] == {"path": "b.txt", "weight": 1.0, "name": None,
                                                      "text_field": None, "split": None, "eval_path": None}
    assert [(s.name, s.weight) for s in data_sources(cfg)] == [("a", 2.0), ("b", 1.0)]
    assert [s.path for s in data_sources(load_config(None, ["model.path=m", "max_steps=1", "data.path=x.jsonl"]))] \
        == ["x.jsonl"]  # a plain path is one source


# ---- a source's keys from the command line: data.path[N].key=value (issue 41, item 12) ---------------------------

MIX = "data.path=[{path: a.jsonl, weight: 0.7}, b.jsonl]"  # the second source a plain path


def _mix(*overrides):
    return load_config(None, ["model.path=m", "max_steps=1", MIX, *overrides], SFTConfig)


def test_an_override_sets_one_key_of_one_source():
    cfg = _mix("data.path[1].weight=0.5", "data.path[1].format=prompt_completion", "data.path[0].name=chat")
    assert [(s.path, s.weight, s.format, s.name) for s in data_sources(cfg)] == [
        ("a.jsonl", 0.7, None, "chat"), ("b.jsonl", 0.5, "prompt_completion", "b")]
    assert [s.path for s in data_sources(_mix("data.path[0]=c.jsonl"))] == ["c.jsonl", "b.jsonl"]  # a whole source


@pytest.mark.parametrize("override, message", [
    ("data.path.1.weight=0.5", "override 'data.path.1.weight': index a list as data.path[1], e.g. "
                               "data.path[1].weight=..."),
    ("data.path[2].weight=0.5", "override 'data.path[2].weight': data.path has 2 items (index 0 to 1), no item 2"),
    ("data.path[1].weight=-1", "config key 'data.path[1].weight' must be positive, got -1.0"),
    ("data.path[1].wieght=1", "unknown config key 'data.path[1].wieght'; did you mean 'data.path[1].weight'?"),
    ("data.path[-1].weight=1", "override 'data.path[-1].weight': write a list item as name[N] (N = 0, 1, ...)"),
])
def test_a_bad_source_override_is_a_clear_error(override, message):
    with pytest.raises(UserError) as e:
        _mix(override)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_indexing_a_plain_path_is_a_clear_error():
    with pytest.raises(UserError) as e:
        load_config(None, ["model.path=m", "max_steps=1", "data.path=a.jsonl", "data.path[0].weight=2"], SFTConfig)
    assert str(e.value).startswith("override 'data.path[0].weight': data.path is 'a.jsonl', not a list")


def test_resume_names_the_one_source_key_that_changed(tmp_path):
    """A changed weight was reported as both whole source lists; it is named as the one key it is."""
    out = tmp_path / "run"
    (out / "checkpoints" / "2").mkdir(parents=True)  # a run that a rerun continues
    (out / "config.yaml").write_text(to_yaml(_mix(f"output_dir={out}")))
    changed = _mix(f"output_dir={out}", "data.path[1].weight=0.5")
    with pytest.raises(UserError) as e:
        config_changes(out, changed)
    assert str(e.value).startswith(f"{out} holds a run with another config (data.path[1].weight: 1.0 -> 0.5); ")
    assert "--resume-with-changes data.path " in str(e.value)
    assert config_changes(out, changed, ["data.path"]) == [("data.path[1].weight", 1.0, 0.5)]
    assert config_changes(out, changed, ["data.path[1].weight"]) == [("data.path[1].weight", 1.0, 0.5)]
    # A source added: the lists no longer pair item by item, so the whole list is the change.
    added = _mix(f"output_dir={out}", "data.path=[a.jsonl, b.jsonl, c.jsonl]")
    assert [k for k, _, _ in config_changes(out, added, ["data"])] == ["data.path"]
