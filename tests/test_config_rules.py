"""Issue 60's config rules: ``model.tokenizer`` takes a zoo checkpoint (item 1); a key set that the run will not
read is a one-line error naming why, for every command (item 3); ``eval_every=0`` turns GRPO's evaluation off as
it does SFT's and DPO's (item 4); the tool metrics are per-episode means (item 5); a missing data file is said
before the model loads (item 11)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.run_files import write_jsonl

CHAT = [{"messages": [{"role": "user", "content": "colour red"}, {"role": "assistant", "content": "red red"}]}]


def _cli(command: str):
    """The ``main(argv)`` of a training command."""
    import dpo.cli
    import grpo.cli
    import pretrain.cli
    import rm.cli
    import sft.cli

    return {"pretrain": pretrain.cli.main, "sft": sft.cli.main, "dpo": dpo.cli.main, "grpo": grpo.cli.main,
            "reward": rm.cli.main}[command]


def _one_line_error(capsys, command: str, args: list[str], out: Path) -> str:
    """Run ``command train ARGS``: exit 2, one line on stderr, no traceback, nothing written in ``out``."""
    capsys.readouterr()
    assert _cli(command)(["train", *args, f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert not out.exists()
    return err[0]


# ---- item 1: model.tokenizer a zoo checkpoint -------------------------------------------------------------------

def test_model_tokenizer_takes_a_zoo_checkpoint(tiny_lm, tmp_path, capsys):
    """model.tokenizer pointing at a zoo checkpoint reads the checkpoint's tokenizer/ folder (the reference says it
    takes "a tokenizer folder (or zoo checkpoint)"), through the set-up every command shares (`sft inspect`
    tokenizes with it here)."""
    from pretrain.config import load_config
    from pretrain.setup import tokenizer_folder

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(tiny_lm / "zoo" / "model.json", ckpt / "model.json")
    shutil.copytree(tiny_lm / "tok", ckpt / "tokenizer")
    cfg = load_config(None, ["model.init=random", "model.config=tiny-llama", f"model.tokenizer={ckpt}",
                             "data.path=d.jsonl", "max_steps=1"])
    assert tokenizer_folder(cfg) == ckpt / "tokenizer"
    data = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    assert _cli("sft")(["inspect", "model.path=unused", f"model.tokenizer={ckpt}", f"data.path={data}",
                        "max_steps=1", "-n", "1"]) == 0
    assert "[[" in capsys.readouterr().out  # the trained tokens, marked


# ---- item 3: a key set that the run will not read ---------------------------------------------------------------

BASE = ["model.path=m", "data.path=d.jsonl", "max_steps=1"]
GRPO = [*BASE, "grpo.rewards=[final_number]"]


@pytest.mark.parametrize("command, args, words", [
    ("grpo", [*GRPO, "grpo.advantage=rloo", "grpo.loss_type=grpo"], ["grpo.loss_type", "rloo", "RLOOConfig"]),
    ("grpo", [*GRPO, "grpo.advantage=rloo", "grpo.scale_rewards=none"], ["grpo.scale_rewards", "rloo"]),
    ("grpo", [*GRPO, "grpo.advantage=rloo", "grpo.importance_sampling_level=sequence"],
     ["grpo.importance_sampling_level", "rloo"]),
    ("grpo", [*GRPO, "grpo.advantage=reinforce_pp", "grpo.scale_rewards=batch"], ["grpo.scale_rewards"]),
    ("grpo", [*GRPO, "grpo.sapo_temperature_neg=2"], ["grpo.sapo_temperature_neg", "grpo.loss_type=sapo"]),
    ("grpo", [*GRPO, "grpo.loss_type=sapo", "grpo.vespo_k_pos=1"], ["grpo.vespo_k_pos", "grpo.loss_type=vespo"]),
    ("grpo", [*GRPO, "grpo.importance_sampling_mode=token_mask"],
     ["grpo.importance_sampling_mode", "grpo.importance_sampling_correction=true"]),
    ("grpo", [*GRPO, "grpo.advantage=rloo", "grpo.importance_sampling_correction=true"],
     ["grpo.importance_sampling_correction", "RLOO"]),
    ("grpo", [*GRPO, "grpo.tool_parser=hermes"], ["grpo.tool_parser", "grpo.tools"]),
    ("grpo", [*GRPO, "grpo.tool_timeout=3"], ["grpo.tool_timeout", "grpo.tools"]),
    ("grpo", [*GRPO, "grpo.max_turns=2"], ["grpo.max_turns", "grpo.tools"]),
    ("grpo", [*GRPO, "grpo.reference=ckpt/ref"], ["grpo.reference", "grpo.beta"]),
    ("grpo", [*GRPO, "data.packing=false"], ["data.packing", "grpo train"]),
    ("sft", [*BASE, "distill.lmbda=0.2"], ["distill.lmbda", "distill.teacher"]),
    ("sft", [*BASE, "distill.seq_kd=true"], ["distill.seq_kd", "distill.teacher"]),
    ("sft", [*BASE, "distill.teacher=t", "distill.lmbda=0", "distill.max_new_tokens=8"],
     ["distill.max_new_tokens", "distill.lmbda 0"]),
    ("sft", [*BASE, "distill.teacher=t", "data.max_segments=4"], ["data.max_segments", "on-policy GKD"]),
    ("sft", [*BASE, "data.packing=false", "data.max_segments=4"], ["data.max_segments", "data.packing"]),
    ("sft", [*BASE, "data.text_field=body"], ["data.text_field"]),
    ("dpo", [*BASE, "dpo.loss_type=orpo", "dpo.reference=base"], ["dpo.reference", "orpo"]),
    ("dpo", [*BASE, "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], ["dpo.label_smoothing", "ipo"]),
    ("dpo", [*BASE, "dpo.simpo_gamma=1"], ["dpo.simpo_gamma", "simpo", "sigmoid"]),
    ("dpo", [*BASE, "dpo.loss_type=orpo", "dpo.cpo_alpha=0.5"], ["dpo.cpo_alpha", "cpo"]),
    ("dpo", [*BASE, "dpo.desirable_weight=2"], ["dpo.desirable_weight", "kto"]),
    ("dpo", [*BASE, "dpo.loss_type=kto", "dpo.label_smoothing=0.1"], ["dpo.label_smoothing", "kto"]),
    ("reward", [*BASE, "data.max_segments=2"], ["data.max_segments", "reward train"]),
    ("pretrain", [*BASE, "lora.alpha=8"], ["lora.alpha", "lora.rank"]),
    ("pretrain", [*BASE, "optimizer.name=sgd", "optimizer.eps=1e-6"], ["optimizer.eps", "sgd"]),
    ("pretrain", [*BASE, "optimizer.name=adafactor", "optimizer.b1=0.8"], ["optimizer.b1", "adafactor"]),
    ("pretrain", [*BASE, "schedule.name=constant", "schedule.min_lr_ratio=0"], ["schedule.min_lr_ratio"]),
    ("pretrain", [*BASE, "eval.limit=4"], ["eval.limit", "eval.tasks"]),
    ("pretrain", [*BASE, "data.eval_path=e.jsonl", "data.eval_fraction=0.1"], ["data.eval_fraction", "e.jsonl"]),
])
def test_a_key_the_run_will_not_read_is_a_one_line_error(capsys, tmp_path, command, args, words):
    err = _one_line_error(capsys, command, args, tmp_path / "run")
    assert all(w in err for w in words), err


@pytest.mark.parametrize("command, args", [
    ("grpo", [*GRPO, "grpo.advantage=rloo", "grpo.loss_type=dapo", "grpo.normalize_advantages=true"]),
    ("grpo", [*GRPO, "grpo.beta=0.04", "grpo.reference=ckpt/ref", "grpo.advantage=reinforce_pp",
              "grpo.loss_type=grpo"]),
    ("grpo", [*GRPO, "grpo.loss_type=vespo", "grpo.vespo_lambda_neg=1.5"]),
    ("grpo", [*GRPO, "grpo.loss_type=sapo", "grpo.sapo_temperature_pos=0.5"]),
    ("sft", [*BASE, "distill.teacher=t", "distill.temperature=0.5"]),
    ("dpo", [*BASE, "dpo.loss_type=kto", "dpo.desirable_weight=2"]),
    ("dpo", [*BASE, "dpo.loss_type=orpo", "dpo.reference=none"]),
    ("pretrain", [*BASE, "lora.rank=4", "lora.alpha=8", "optimizer.name=lion", "optimizer.b2=0.99"]),
])
def test_keys_the_run_reads_or_left_at_their_default_pass(capsys, command, args):
    """A key that the run reads, or one left at its default (the run is the same without it) is no error."""
    assert _cli(command)(["train", *args, "--print-config"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("command", ["pretrain", "sft", "dpo", "grpo", "reward"])
def test_print_config_reads_back(tmp_path, capsys, command):
    """What --print-config prints (every key, defaults included) is a config the command reads as it was, though
    it sets keys that the run does not read (at their defaults)."""
    args = GRPO if command == "grpo" else BASE
    assert _cli(command)(["train", *args, "--print-config"]) == 0
    shown = capsys.readouterr().out
    (tmp_path / "c.yaml").write_text(shown)
    assert _cli(command)(["train", "--config", str(tmp_path / "c.yaml"), "--print-config"]) == 0
    assert capsys.readouterr().out == shown


def test_a_removal_override_trains_a_lora_file_in_full_and_names_what_it_cannot_remove(tmp_path, capsys):
    """``'~lora'`` drops the file's LoRA section (its alpha with it), where ``lora.rank=0`` leaves the alpha the
    run would not read; removing a key the file does not set is a one-line error."""
    (tmp_path / "lora.yaml").write_text("lora:\n  rank: 16\n  alpha: 32\n")
    args = ["--config", str(tmp_path / "lora.yaml"), *BASE]
    assert "lora.alpha" in _one_line_error(capsys, "sft", [*args, "lora.rank=0"], tmp_path / "run")
    assert _cli("sft")(["train", *args, "~lora", "--print-config"]) == 0
    shown = capsys.readouterr().out
    assert "rank: 0" in shown and "alpha: 16.0" in shown, shown
    assert "~lora.dropout" in _one_line_error(capsys, "sft", [*args, "~lora.dropout"], tmp_path / "run")


# ---- item 4: eval_every=0 turns GRPO's evaluation off -----------------------------------------------------------

def test_grpo_eval_every_0_with_an_eval_set_reads_as_sft_and_dpo_do(capsys):
    """data.eval_path with eval_every=0 (evaluation off, as the quickstart teaches) is a config every command
    takes, GRPO's too."""
    for command, args in (("sft", BASE), ("dpo", BASE), ("grpo", GRPO)):
        assert _cli(command)(["train", *args, "data.eval_path=e.jsonl", "eval_every=0", "--print-config"]) == 0, \
            (command, capsys.readouterr().err)


@pytest.mark.slow
def test_grpo_with_an_eval_set_and_eval_every_0_trains_without_evaluating(tiny_lm, tmp_path, capsys):
    """The run itself: data.eval_path and eval_every=0 train, and no step logs a held-out metric."""
    from tests.run_files import read_metrics

    rows = [{"prompt": w, "answer": "1"} for w in ("red cat", "blue dog", "big mat", "small log")]
    data, held = write_jsonl(tmp_path / "p.jsonl", rows), write_jsonl(tmp_path / "held.jsonl", rows[:2])
    args = ["train", f"model.path={tiny_lm / 'zoo'}", f"model.tokenizer={tiny_lm / 'tok'}", f"data.path={data}",
            f"data.eval_path={held}", "eval_every=0", "data.seq_len=8", "batch_size=4", "grpo.num_generations=2",
            "grpo.max_completion_length=2", "grpo.rewards=[final_number]", "max_steps=1", "log_every=1",
            f"output_dir={tmp_path / 'run'}"]
    assert _cli("grpo")(args) == 0, capsys.readouterr().err
    (m,) = read_metrics(tmp_path / "run")
    assert "reward" in m and not [k for k in m if k.startswith("eval_")]


# ---- item 5: the tool metrics are means per episode ------------------------------------------------------------

def test_tool_metrics_are_per_episode_means_that_the_batch_size_does_not_scale():
    """Two calls (one failed) in one episode of two: 1 call and 0.5 failure per episode, TRL's
    tools/call_frequency (calls per episode) and tools/failure_frequency (failures per call); the same episodes
    twice over (a batch twice as large) give the same numbers."""
    from grpo.agentic import episode_metrics
    from grpo.episodes import Episode

    def batch():
        return [Episode(tool_calls=2, tool_failures=1), Episode()]

    m = episode_metrics(batch())
    assert (m["tool_calls"], m["tool_failures"], m["tools/call_frequency"], m["tools/failure_frequency"]) == \
        (1.0, 0.5, 1.0, 0.5)
    assert episode_metrics(batch() + batch()) == m


# ---- item 11: a missing data file before the model loads ---------------------------------------------------------

@pytest.mark.parametrize("command, data, words", [
    ("sft", ["data.path={missing}"], ["data.path", "missing.jsonl", "no such file"]),
    ("sft", ["data.path={chat}", "data.eval_path={missing}"], ["data.eval_path", "missing.jsonl"]),
    ("sft", ["data.path=[{chat}, {{path: {chat}, eval_path: {missing}}}]"], ["data.path[1].eval_path"]),
    ("sft", ["data.path=[{chat}, {missing}]"], ["data.path[1]", "missing.jsonl"]),
    ("dpo", ["data.path={empty}"], ["data.path", "no .jsonl"]),
    ("grpo", ["data.path={missing}", "grpo.rewards=[final_number]"], ["data.path", "missing.jsonl"]),
    ("reward", ["data.path={missing}"], ["data.path", "missing.jsonl"]),
    ("pretrain", ["data.path={missing}"], ["data.path", "missing.jsonl"]),
])
def test_a_missing_data_file_is_said_before_the_model_loads(tiny_lm, tmp_path, capsys, monkeypatch, command, data,
                                                            words):
    import pretrain.loop

    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the data files were checked")

    monkeypatch.setattr(pretrain.loop, "set_up_model", no_load)
    (tmp_path / "empty").mkdir()
    names = {"missing": tmp_path / "missing.jsonl", "chat": write_jsonl(tmp_path / "chat.jsonl", CHAT),
             "empty": tmp_path / "empty"}
    args = [f"model.path={tiny_lm / 'zoo'}", f"model.tokenizer={tiny_lm / 'tok'}", "max_steps=1",
            *(d.format(**names) for d in data)]
    err = _one_line_error(capsys, command, args, tmp_path / "run")
    assert all(w in err for w in words), err
