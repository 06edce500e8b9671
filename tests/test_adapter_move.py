"""Adapter checkpoints that survive a move: the base named relative to the adapter checkpoint, checked by digest.

Bases are written directly (random weights, no conversion) and adapter checkpoints with pretrain/final.py's
write_final (what `sft train` / `dpo train` with LoRA call at the end), with random non-zero A and B so that
every delta counts, which is much faster than training.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from pretrain.config import TrainConfig
from pretrain.final import write_final
from zoo.checkpoints.adapter import base_checkpoint
from zoo.checkpoints.format import MODEL_FILE, read_meta
from zoo.checkpoints.loading import load_params
from zoo.checkpoints.writer import CheckpointWriter, save_params
from zoo.cli import main
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, lora_specs
from zoo.model.config import ModelConfig
from zoo.model.params import flatten, nest, param_specs

CFG = ModelConfig(family="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
SFT = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "down_proj"))
DPO = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "o_proj"))


def write_base(folder: Path, cfg: ModelConfig = CFG, dtype: str = "float32", seed: int = 0,
               provenance: dict | None = None) -> Path:
    """A zoo checkpoint of random weights (what `zoo convert` would leave, less tokenizer and HF config);
    ``provenance``: its model.json's source entries (default: a random init's)."""
    import ml_dtypes

    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    rng = np.random.RandomState(seed)
    specs = param_specs(cfg)
    flat = {p: rng.normal(0, 0.02, s.shape).astype(np_dtype) for p, s in sorted(specs.items())}
    folder.mkdir(parents=True)
    stored = save_params(folder, nest(flat), {p: s.axes for p, s in specs.items()})
    writer = CheckpointWriter(folder)
    writer.adopt(stored)
    writer.finish(cfg, **(provenance or {"source": "random", "source_format": "init"}))
    return folder


def write_run(base: Path, out: Path, lora: LoraConfig, seed: int) -> Path:
    """``out/final``: an adapter checkpoint over ``base`` as a LoRA training run writes it."""
    cfg = ModelConfig.from_dict(read_meta(base)["config"])
    rng = np.random.RandomState(seed)
    adapters = {p: rng.normal(0, 0.1, s.shape).astype(np.float32) for p, s in lora_specs(cfg, lora).items()}
    out.mkdir(parents=True)
    return write_final(out, TrainConfig(), cfg, nest(adapters), base, out / "no-tokenizer", {}, {}, "sft", lora)


def merged(ckpt: Path) -> dict[str, np.ndarray]:
    """The merged parameters of a checkpoint, as host arrays."""
    return {p: np.asarray(v) for p, v in flatten(load_params(ckpt)).items()}


def assert_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for p in a:
        np.testing.assert_array_equal(a[p], b[p], err_msg=p)


def refusal(ckpt: Path) -> str:
    """The one-line UserError that loading ``ckpt`` raises."""
    with pytest.raises(UserError) as e:
        load_params(ckpt)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_run_moved_together_with_its_base_loads_and_exports(tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    base = write_base(work / "base")
    sft = write_run(base, work / "sft", SFT, seed=1)
    dpo = write_run(sft, work / "dpo", DPO, seed=2)  # adapters over an adapter checkpoint (its model.path)
    info = read_meta(sft)["lora"]
    assert info["base"] == str(base) and info["base_relative"] == "../../base"
    assert set(info["base_digest"]) == {"config", "manifest"}
    assert read_meta(dpo)["lora"]["base_relative"] == "../../sft/final"
    want_sft, want_dpo = merged(sft), merged(dpo)
    assert np.abs(want_dpo["layers.q"] - want_sft["layers.q"]).max() > 0  # the DPO delta counts

    moved = tmp_path / "elsewhere" / "work"
    moved.parent.mkdir()
    shutil.move(work, moved)
    assert not work.exists()
    assert_equal(merged(moved / "sft" / "final"), want_sft)
    assert_equal(merged(moved / "dpo" / "final"), want_dpo)  # the chain: dpo -> sft -> base, all moved

    # Export (merged, and as PEFT, whose card names the moved base), and a further run on the moved chain.
    monkeypatch.chdir(tmp_path)  # the export names a local base relative to where it runs (no absolute path)
    assert main(["export", str(moved / "dpo" / "final"), "--out", str(tmp_path / "merged")]) == 0
    assert main(["export", str(moved / "sft" / "final"), "--adapter", "--out", str(tmp_path / "peft")]) == 0
    peft = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert peft["base_model_name_or_path"] == "elsewhere/work/base"
    capsys.readouterr()
    more = write_run(moved / "dpo" / "final", moved / "more", DPO, seed=3)
    assert read_meta(more)["lora"]["base"] == str(moved / "dpo" / "final")
    assert merged(more).keys() == want_dpo.keys()


def test_a_changed_base_is_refused_naming_both_paths(tmp_path, capsys):
    base = write_base(tmp_path / "base")
    sft = write_run(base, tmp_path / "sft", SFT, seed=1)
    cases = {
        # Same shapes, other config: re-converted from another revision, say.
        "config differs (rms_norm_eps 1e-05 -> 1e-06)": dict(cfg=dataclasses.replace(CFG, rms_norm_eps=1e-6)),
        # Same config, other dtype: re-converted with another --dtype.
        "parameter manifest differs ('embed' float32[96, 64] -> bfloat16[96, 64], and 11 more parameters)":
            dict(dtype="bfloat16"),
        # Other shapes: both differ.
        "config differs (intermediate_size 128 -> 96); parameter manifest differs "
        "('layers.down' float32[2, 128, 64] -> float32[2, 96, 64], and 2 more parameters)":
            dict(cfg=dataclasses.replace(CFG, intermediate_size=96)),
    }
    for what, kw in cases.items():
        shutil.rmtree(base)
        write_base(base, **kw)
        msg = refusal(sft)
        assert msg.startswith(f"{sft} is a LoRA adapter of base checkpoint {base}, which has changed"), msg
        assert what in msg and "put the original base back" in msg and "train the adapters anew" in msg, msg
    # The command line says the same, in one line.
    assert main(["export", str(sft), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(sft) in err[0] and str(base) in err[0] and not (tmp_path / "out").exists()


def test_the_relative_base_comes_first_then_the_recorded_one(tmp_path):
    base = write_base(tmp_path / "work" / "base")
    write_run(base, tmp_path / "work" / "sft", SFT, seed=1)
    # A copy of the run beside another base: the relative path leads to a changed base, the recorded one is fine.
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "work" / "sft", copy / "sft")
    write_base(copy / "base", dtype="bfloat16")
    assert base_checkpoint(copy / "sft" / "final", read_meta(copy / "sft" / "final")) == base
    # With the same base beside it, the relative one wins.
    shutil.rmtree(copy / "base")
    shutil.copytree(base, copy / "base")
    assert base_checkpoint(copy / "sft" / "final", read_meta(copy / "sft" / "final")) == copy / "base"
    # With both changed, the error names the relative one, the first tried.
    shutil.rmtree(base)
    write_base(base, dtype="bfloat16")
    shutil.rmtree(copy / "base")
    write_base(copy / "base", dtype="bfloat16")
    assert f"base checkpoint {copy / 'base'}, which has changed" in refusal(copy / "sft" / "final")


def test_a_missing_base_is_refused_naming_both_paths_tried(tmp_path):
    base = write_base(tmp_path / "work" / "base")
    sft = write_run(base, tmp_path / "work" / "sft", SFT, seed=1)
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "work" / "sft", moved)  # the run alone: its base stays behind ...
    shutil.rmtree(base)  # ... and then goes
    final = moved / "final"
    msg = refusal(final)
    assert msg.startswith(f"{final} is a LoRA adapter of a base checkpoint found at neither "
                          f"{tmp_path / 'base'} (where '../../base' leads from it) nor {base} (its path at training)")
    assert "move the base together with the run" in msg
    assert not sft.exists()


def test_old_adapter_checkpoints_with_only_the_absolute_path_still_load(tmp_path):
    base = write_base(tmp_path / "base")
    sft = write_run(base, tmp_path / "sft", SFT, seed=1)
    want = merged(sft)
    meta = json.loads((sft / MODEL_FILE).read_text())
    for key in ("base_relative", "base_digest"):  # as written before they existed
        del meta["lora"][key]
    (sft / MODEL_FILE).write_text(json.dumps(meta))
    assert_equal(merged(sft), want)
    shutil.move(base, tmp_path / "gone")
    assert refusal(sft) == (f"{sft} is a LoRA adapter of base checkpoint {base}, which is missing; put the base "
                            "back there (or export the merged model where both exist)")


def test_runs_carry_the_hub_repo_of_their_base_and_peft_names_it_only_for_its_model(tmp_path, monkeypatch):
    """A run keeps the Hub repo its base was converted from (model.json's hub_id), and its adapters record that
    their base is that repo's model (lora.base_hub_id), so the PEFT export names the repo even without the base
    at hand; adapters over that run are over another model (the run merged): they name the run, not the repo."""
    repo = "owner/tiny"
    base = write_base(tmp_path / "base", provenance={"source": repo, "source_format": "hf", "hub_id": repo})
    sft = write_run(base, tmp_path / "sft", SFT, seed=1)
    dpo = write_run(sft, tmp_path / "dpo", DPO, seed=2)
    assert read_meta(sft)["hub_id"] == read_meta(dpo)["hub_id"] == repo
    assert read_meta(sft)["lora"]["base_hub_id"] == repo and "base_hub_id" not in read_meta(dpo)["lora"]

    shutil.move(tmp_path / "sft", tmp_path / "elsewhere")  # the SFT run alone: its base is not beside it
    shutil.rmtree(base)
    assert main(["export", str(tmp_path / "elsewhere" / "final"), "--adapter", "--out", str(tmp_path / "p1")]) == 0
    assert json.loads((tmp_path / "p1" / "adapter_config.json").read_text())["base_model_name_or_path"] == repo
    shutil.move(tmp_path / "elsewhere", tmp_path / "sft")
    monkeypatch.chdir(tmp_path)  # a local base is named relative to where the export runs
    assert main(["export", str(dpo), "--adapter", "--out", str(tmp_path / "p2")]) == 0
    assert json.loads((tmp_path / "p2" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        "sft/final"
    assert f"It comes from the Hub's `{repo}`" in (tmp_path / "p2" / "README.md").read_text()
