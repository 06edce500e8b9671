"""The DPO demo's shipped preference pairs (demo/data/prefs_*.jsonl) and the demo's DPO stage wiring (no model)."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "demo" / "data"
RECORD = re.compile(r"name: (\w+) \| age: (\d+) \| city: (\w+)")


def _rows(name):
    return [json.loads(line) for line in (DEMO / name).read_text().splitlines() if line.strip()]


def _make_prefs():
    spec = importlib.util.spec_from_file_location("make_prefs", ROOT / "examples" / "dpo" / "make_prefs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_pairs_are_what_make_prefs_writes(tmp_path, monkeypatch):
    mod = _make_prefs()
    monkeypatch.setattr(mod, "ROOT", tmp_path)
    (tmp_path / "demo" / "data").mkdir(parents=True)
    mod.main()
    for name in ("prefs_train.jsonl", "prefs_eval.jsonl"):
        assert (tmp_path / "demo" / "data" / name).read_text() == (DEMO / name).read_text(), name


def test_pairs_are_checkable_and_held_out():
    from prefs.pairs import normalize_pair

    train, held_out = _rows("prefs_train.jsonl"), _rows("prefs_eval.jsonl")
    assert 150 <= len(train) <= 300 and 24 <= len(held_out) <= 48
    names = {}
    for split, rows in (("train", train), ("eval", held_out)):
        names[split] = set()
        for row in rows:
            pair = normalize_pair(row)  # the DPO task's own row check
            assert pair.is_chat and pair.prompt[0]["role"] == "user"
            sentence = pair.prompt[0]["content"].split("\n", 1)[1]
            name, age, city = RECORD.fullmatch(pair.chosen[0]["content"]).groups()
            assert name in sentence and age in sentence and city in sentence  # the right answer is checkable
            assert pair.rejected[0]["content"] != pair.chosen[0]["content"]
            names[split] |= {name, city}
    sft = {w for r in _rows("records_train.jsonl") + _rows("records_eval.jsonl")
           for w in RECORD.fullmatch(r["messages"][-1]["content"]).group(1, 3)}
    assert not names["eval"] & (names["train"] | sft)  # held-out pairs: names and cities no stage trains on
    kinds = {r["kind"] for r in held_out}
    assert kinds == {"distractor", "value", "swapped", "format", "missing"}


def test_demo_dpo_config():
    from demo.job import DemoOptions, dpo_config

    opts = DemoOptions(ckpt=Path("/nonexistent/ckpt"), out=Path("/tmp/out"), dpo_steps=5)
    cfg = dpo_config(opts, Path("/tmp/out/run/final"))
    assert cfg.model.path == "/tmp/out/run/final" and cfg.max_steps == 5 and cfg.lora.rank == 16
    assert cfg.dpo.reference == "base" and cfg.dpo.loss_type == "sigmoid"
    assert cfg.data.path.endswith("prefs_train.jsonl")
