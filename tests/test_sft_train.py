"""`sft train` on the shared loop: a tiny model learns assistant turns; only assistant tokens are targets."""

import json

import jax
import numpy as np
import pytest

import zoo
from pretrain.config import load_config
from pretrain.loop import train
from sft.cli import main as sft_main
from sft.config import SFTConfig
from sft.task import SFTTask
from tests.processes import devices_env
from tests.tiny_lm import copy_tiny_lm
from zoo.cli import main as zoo_main

COLORS = "red blue green yellow black white".split()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_lm):
    root = tmp_path_factory.mktemp("sft")
    tok = copy_tiny_lm(tiny_lm, root)
    rng = np.random.RandomState(0)
    # 120 rows: every training run tokenizes and shuffles all of them (half a second a run with 240)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(120):
            c = COLORS[rng.randint(len(COLORS))]
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "Repeat the colour."},
                {"role": "user", "content": f"colour {c}"},
                {"role": "assistant", "content": f"{c} {c}"}]}) + "\n")
    return root, tok


def _cfg(root, out, *overrides):
    # Batch 4 unless a test needs more: each row of a batch is a data lane of its own (a grain pipeline, which
    # prefetches), so a short run's setup grows with the batch.
    return load_config(None, [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={root / 'chat.jsonl'}", "data.seq_len=64", "batch_size=4",
                              "optimizer.learning_rate=0.01", "schedule.name=constant", "log_every=1",
                              "data.eval_fraction=0.1", "eval_every=20", "checkpoint.every=100",
                              f"output_dir={out}", *overrides], SFTConfig)


def test_documents_train_only_assistant_tokens(setup):
    root, tok = setup
    cfg = _cfg(root, root / "unused", "max_steps=1")
    task = SFTTask(cfg)
    rows = task.load(cfg.data.path, cfg)
    assert rows.field == "messages"
    made = task.documents(rows, tok, cfg.data.path, False, [0, 1])
    docs = made.docs
    assert made.bad == 0
    for i, d in docs.items():
        answer = rows.ds[i]["messages"][2]["content"]
        trained = tok.decode(d["tokens"][d["loss_mask"]])
        assert trained == answer + "<|im_end|>"


def test_sft_lowers_train_and_eval_loss(setup, tmp_path):
    """The fast lane's end-to-end SFT run: over 30 s in the baseline (a training run and its compilations,
    with SmolLM2's vocabulary then)."""
    root, _ = setup
    out = tmp_path / "run"
    cfg = _cfg(root, out, "max_steps=12", "eval_every=6", "batch_size=8")  # steps 8-12: about 0.28x steps 1-3
    final = train(cfg, progress=False, task=SFTTask(cfg))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs]
    evals = [r["eval_loss"] for r in recs if "eval_loss" in r]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:3])
    assert len(evals) == 2 and evals[-1] < evals[0]
    assert zoo.checkpoints.format.read_meta(final)["training"]["method"] == "sft"


def test_inspect_highlights_assistant_text(setup, capsys):
    root, _ = setup
    args = ["inspect", f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}",
            f"data.path={root / 'chat.jsonl'}", "max_steps=1", "-n", "1", "--no-color"]
    assert sft_main(args) == 0
    out = capsys.readouterr().out
    assert "format messages" in out and "[[" in out and "<|im_end|>]]" in out


def test_row_without_assistant_turn_names_file_and_row(setup, tmp_path, capsys):
    root, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = ["train", f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", f"data.path={bad}",
            "batch_size=1", "max_steps=1", f"output_dir={tmp_path / 'o'}"]
    assert sft_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl, line 1:" in err[0] and "skip_bad_rows" in err[0]


@pytest.mark.slow
def test_grad_accum_2_equals_one_batch_twice_as_large(setup, tmp_path):
    """Two SGD steps of 4 rows in 2 micro-batches of 2 equal two steps of one batch of 4: the same losses (the
    second follows the first update) and final weights (both updates).
    Slow (about 52 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    root, _ = setup
    sgd = ("max_steps=2", "optimizer.name=sgd", "optimizer.learning_rate=0.5", "data.eval_fraction=0")
    cfg_a = _cfg(root, tmp_path / "a", *sgd, "grad_accum=1")
    cfg_b = _cfg(root, tmp_path / "b", *sgd, "grad_accum=2")
    a = train(cfg_a, progress=False, task=SFTTask(cfg_a))
    b = train(cfg_b, progress=False, task=SFTTask(cfg_b))
    la = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x)["loss"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(zoo.load_params(a)), jax.tree.leaves(zoo.load_params(b))):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-5)


LORA = ("lora.rank=16", "lora.alpha=32", "optimizer.learning_rate=0.01")


@pytest.fixture(scope="module")
def lora_run(setup, tmp_path_factory):
    """LoRA SFT trained once for two tests: 20 steps at batch 8 (8 rows: an fsdp8 mesh needs them), eval every 10
    steps on the held-out 10% (steps 16-20: about 0.47x steps 1-3). Returns (run folder, final checkpoint)."""
    root, _ = setup
    out = tmp_path_factory.mktemp("lora") / "lora"
    cfg = _cfg(root, out, "max_steps=20", "eval_every=10", "batch_size=8", *LORA)
    return out, train(cfg, progress=False, task=SFTTask(cfg))


@pytest.mark.slow
def test_lora_sft_trains_only_adapters_and_final_merges(setup, lora_run, tmp_path, capsys):
    """LoRA SFT (fixture lora_run) learns with the adapters alone; its checkpoints hold optimizer state for the
    adapters only; `zoo info` describes the adapter checkpoint; zoo.load merges it (logits equal the base forward
    with the adapters beside it) and `zoo export` writes the merged weights.
    Slow (about 98 s in a loaded 2-worker baseline): a whole training run through the loop, compiling its step."""
    root, _ = setup
    out, final = lora_run
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses, evals = [r["loss"] for r in recs], [r["eval_loss"] for r in recs if "eval_loss" in r]
    # Less than full fine-tuning reaches: the tiny random base's frozen embeddings (std 0.02) cap how sharp
    # its output can get; untrained adapters would stay at the first losses.
    assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:3])
    assert len(evals) == 2 and evals[-1] < evals[0]
    meta = zoo.checkpoints.format.read_meta(final)
    assert meta["lora"]["rank"] == 16 and meta["lora"]["base"] == str(root / "zoo")
    assert set(meta["lora"]["params"]) == {f"layers.{w}.{ab}" for w in ("q", "k", "v", "o", "gate", "up", "down")
                                           for ab in "ab"}
    capsys.readouterr()
    assert zoo_main(["info", str(final)]) == 0
    info = capsys.readouterr().out
    assert "lora        rank 16, alpha 32" in info and f"base        {root / 'zoo'}" in info and "layers.q.a" in info
    # The checkpoints of the run hold optimizer state for the adapters only (nothing base-sized).
    import orbax.checkpoint as ocp

    step_dir = max((out / "checkpoints").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    tree = ocp.PyTreeCheckpointer().metadata(step_dir / "state").item_metadata.tree
    shapes = [tuple(x.shape) for x in jax.tree.leaves(tree["opt_state"]) if hasattr(x, "shape") and x.shape]
    base_shapes = {tuple(v["shape"]) for v in zoo.checkpoints.format.read_meta(root / "zoo")["params"].values()}
    assert shapes and not (set(shapes) & base_shapes)
    # zoo.load merges: its logits equal the base forward with the adapters beside it.
    from zoo.checkpoints.adapter import load_adapters, lora_config
    from zoo.lora.params import lora_scale
    from zoo.lora.weights import Weights
    from zoo.model.decoder import forward

    merged = zoo.load(final)
    base = zoo.load_params(root / "zoo")
    adapters = load_adapters(final, meta)
    tokens = jax.numpy.asarray(np.arange(1, 21, dtype=np.int32)[None])
    fwd = jax.jit(forward, static_argnums=0)  # one compilation, not one per operation
    unmerged = fwd(merged.cfg, Weights(base, adapters, lora_scale(lora_config(meta))), tokens)
    assert np.abs(np.asarray(merged(tokens)) - np.asarray(unmerged)).max() <= 1e-5
    assert np.abs(np.asarray(merged(tokens)) - np.asarray(fwd(merged.cfg, base, tokens))).max() > 1e-3
    # zoo export writes the merged model (streaming, one layer at a time).
    assert zoo_main(["export", str(final), "--out", str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    q0 = np.asarray(merged.param_dict()["layers"]["q"])[0]  # indexed in numpy: no eager compile
    np.testing.assert_allclose(hf["model.layers.0.self_attn.q_proj.weight"], q0.reshape(q0.shape[0], -1).T,
                               atol=1e-6)


def _clock(day: int):
    """A stand-in for the machine's clock as transformers' strftime_now reads it (July ``day``, 2031)."""
    import datetime

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime(2031, 7, day, 12)

    return Clock


def _killed_after_step_2(cfg, monkeypatch) -> None:
    """Run ``cfg`` and stop it (KeyboardInterrupt) as step 3's batch arrives, after step 2 was checkpointed."""
    import pretrain.steps as trainer

    real, calls = trainer.to_model_batch, []

    def crash_at_3(b):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(b)

    monkeypatch.setattr(trainer, "to_model_batch", crash_at_3)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, task=SFTTask(cfg))
    monkeypatch.setattr(trainer, "to_model_batch", real)


@pytest.mark.slow
def test_lora_kill_and_resume_is_bit_identical(setup, tmp_path, monkeypatch):
    """...also when the run resumes on another day, with a template that writes today's date (strftime_now).
    Slow (about 30 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    import transformers.utils.chat_template_utils as ctu


    root, tok = setup
    dated = tmp_path / "dated.jinja"  # ChatML with a Llama-3.2-style date line in the system turn
    dated.write_text("{{ '<|im_start|>system\nToday Date: ' + strftime_now('%d %b %Y') + '<|im_end|>\n' }}"
                     + tok.chat_template)
    common = ("max_steps=3", "checkpoint.every=2", "data.eval_fraction=0", f"data.chat_template={dated}", *LORA)
    monkeypatch.setattr(ctu, "datetime", _clock(1))
    cfg = _cfg(root, tmp_path / "full", *common)
    full = train(cfg, progress=False, task=SFTTask(cfg))
    cfg = _cfg(root, tmp_path / "resumed", *common)
    _killed_after_step_2(cfg, monkeypatch)
    monkeypatch.setattr(ctu, "datetime", _clock(2))  # resumed the next day
    assert "02 Jul 2031" in tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=dated.read_text(),
                                                    tokenize=False)
    resumed = train(cfg, progress=False, task=SFTTask(cfg))
    from zoo.checkpoints.adapter import load_adapters

    a = load_adapters(full, zoo.checkpoints.format.read_meta(full))
    b = load_adapters(resumed, zoo.checkpoints.format.read_meta(resumed))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


LORA_MESH_SCRIPT = r"""
import json, sys
import jax
from pretrain.config import load_config
from sft.config import SFTConfig
from pretrain.loop import train
from sft.task import SFTTask
assert len(jax.devices()) == 8
base = json.loads(sys.argv[1])
out = {}
for name, mesh in [("fsdp8", ["mesh.data=1", "mesh.fsdp=8"]), ("f4t2", ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"])]:
    d = sys.argv[2] + "/" + name
    cfg = load_config(None, base + mesh + [f"output_dir={d}"], SFTConfig)
    train(cfg, progress=False, task=SFTTask(cfg))
    out[name] = [json.loads(l)["loss"] for l in open(d + "/metrics.jsonl")]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_lora_on_8_devices_matches_one_device(setup, lora_run, tmp_path):
    """LoRA SFT on two meshes of 8 devices (fsdp 8; fsdp 4 x tensor 2) takes the one-device run's first 2 steps
    (fixture lora_run: the same rows, held-out split, batch and settings; its later steps do not change the
    first two). Slow (slow lane): a subprocess on 8 simulated devices trains LoRA SFT with its own compilations."""
    import subprocess
    import sys

    root, _ = setup
    ref = [json.loads(x)["loss"] for x in (lora_run[0] / "metrics.jsonl").read_text().splitlines()][:2]
    # lora_run's data (its 10% held out: the same training rows), no eval (its first is at step 10)
    base = [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", f"data.path={root / 'chat.jsonl'}",
            "data.seq_len=64", "batch_size=8", "schedule.name=constant", "log_every=1", "checkpoint.every=100",
            "data.eval_fraction=0.1", "max_steps=2", *LORA]
    env = devices_env(8)
    p = subprocess.run([sys.executable, "-c", LORA_MESH_SCRIPT, json.dumps(base), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert ref[-1] < ref[0]  # the adapters learn, so equal losses mean equal updates
    for name, losses in got.items():
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_eval_tasks_during_training_score_the_live_weights(setup, tmp_path, no_env_report, monkeypatch):
    """eval.tasks run every eval_every steps on the current (LoRA-merged) weights: metrics.jsonl and TensorBoard
    carry them, and the last values equal `zoo eval`'s scoring of the saved final checkpoint.
    Slow (about 99 s in a loaded 2-worker baseline): whole training runs through the loop, each compiling its step
    configuration."""
    import functools

    from lm_eval import tasks

    from eval.scoring import evaluate
    from pretrain.cli import training_hooks

    # lm-eval's TaskManager over the include path's tasks alone, as tests/test_eval_harness.py's: indexing its
    # whole library took 37 s of this test's 56 s under load (eval/harness_run.py builds it with the library)
    monkeypatch.setattr(tasks, "TaskManager", functools.partial(tasks.TaskManager, include_defaults=False))
    root, tok = setup
    (tmp_path / "colours.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "system", "content": "Repeat the colour."},
                                 {"role": "user", "content": f"colour {c}"},
                                 {"role": "assistant", "content": f"{c} {c}"}]}) + "\n" for c in COLORS))
    (tmp_path / "colours.yaml").write_text("kind: generation\ndata: colours.jsonl\nmessages: messages\n"
                                           "chat_template: true\nmax_new_tokens: 4\n")
    (tmp_path / "text.txt").write_text("colour red red\ncolour blue blue and green green\n")
    (tmp_path / "text.yaml").write_text("kind: perplexity\ndata: text.txt\nwindow: 16\n")
    # An lm-evaluation-harness task by name (from a local task folder): scored through eval/harness.py.
    harness = tmp_path / "harness"
    harness.mkdir()
    (harness / "hmc.jsonl").write_text("".join(json.dumps({"q": f"colour {c}", "choices": COLORS[:3], "gold": i % 3})
                                               + "\n" for i, c in enumerate(COLORS)))
    (harness / "hmc.yaml").write_text(
        f"task: hmc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {harness / 'hmc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{q}}:\"\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1\n")
    out = tmp_path / "run"
    # LORA at batch 4: the train step test_lora_kill_and_resume_is_bit_identical compiled
    cfg = _cfg(root, out, "max_steps=4", "eval_every=2", *LORA,
               f"eval.tasks={tmp_path / 'colours.yaml'},{tmp_path / 'text.yaml'},hmc", f"eval.include_path={harness}")
    final = train(cfg, progress=False, task=SFTTask(cfg), hooks=training_hooks(cfg))  # the hooks `sft train` adds
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in recs if "eval/text/ppl" in r]
    assert [r["step"] for r in scored] == [2, 4]
    assert all("eval/colours/exact_match" in r for r in scored)
    assert scored[0]["eval/text/ppl"] != scored[1]["eval/text/ppl"]  # the weights between evals changed
    events = b"".join(f.read_bytes() for f in (out / "tensorboard").glob("events.out.tfevents.*"))
    assert b"eval/text/ppl" in events and b"eval/colours/exact_match" in events
    model = zoo.load(final, dtype=np.float32)  # the adapter checkpoint, merged on load
    ref = evaluate(model.cfg, model.param_dict(), tok, [str(tmp_path / "colours.yaml"), str(tmp_path / "text.yaml")],
                   limit=cfg.eval.limit, batch_size=cfg.eval.batch_size, progress=False)["tasks"]
    assert scored[-1]["eval/text/ppl"] == pytest.approx(ref["text"]["metrics"]["ppl"], rel=1e-5)
    assert scored[-1]["eval/colours/exact_match"] == ref["colours"]["metrics"]["exact_match"]
    assert zoo_main(["plot", str(out)]) == 0 and (out / "curves.png").is_file()
    # The harness task, every eval, equal to lm-eval's own run on the final checkpoint.
    import lm_eval

    from eval.harness import LmzooLM

    assert all("eval/hmc/acc" in r and "eval/hmc/acc_norm" in r for r in scored)
    lm = LmzooLM(model=model, tokenizer=tok, batch_size=cfg.eval.batch_size, progress=False)
    want = lm_eval.simple_evaluate(model=lm, tasks=["hmc"], limit=cfg.eval.limit, bootstrap_iters=0,
                                   # the local task alone: lm-eval's own index of its library takes 13 s to build
                                   task_manager=tasks.TaskManager(include_path=str(harness), include_defaults=False)
                                   )["results"]["hmc"]
    assert scored[-1]["eval/hmc/acc"] == want["acc,none"] and scored[-1]["eval/hmc/acc_norm"] == want["acc_norm,none"]


def test_eval_tasks_need_eval_every(setup, tmp_path, capsys):
    root, _ = setup
    (tmp_path / "run.yaml").write_text("eval:\n  tasks: [prose]\n")
    rc = sft_main(["train", "--config", str(tmp_path / "run.yaml"), f"model.path={root / 'zoo'}",
                   f"data.path={root / 'chat.jsonl'}", "max_steps=1", f"output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "eval_every" in err


QLORA = (*LORA, "lora.base_quant=nf4", "lora.base_quant_double=true")


@pytest.mark.slow
def test_qlora_sft_trains_resumes_and_merges_into_the_dequantized_base(setup, tmp_path, monkeypatch, capsys):
    """QLoRA learns; the run on a stored quantized base, killed after step 2's checkpoint and resumed, ends with
    the adapters of the uninterrupted run that quantized at load; the merged model is the dequantized base plus
    the adapters, and `zoo export` writes it. Slow (about 122 s in a loaded 2-worker baseline): whole training
    runs through the loop, each compiling its step configuration."""
    from zoo.checkpoints.adapter import load_adapters, lora_config
    from zoo.lora.params import lora_scale
    from zoo.lora.weights import Weights
    from zoo.model import quant
    from zoo.model.decoder import forward
    from zoo.model.params import flatten, nest

    root, _ = setup
    common = ("max_steps=3", "checkpoint.every=2", "data.eval_fraction=0", *QLORA)
    cfg = _cfg(root, tmp_path / "full", *common)
    full = train(cfg, progress=False, task=SFTTask(cfg))
    losses = [json.loads(x)["loss"] for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]
    meta = zoo.checkpoints.format.read_meta(full)
    assert meta["lora"]["base_quant"] == {"kind": "nf4", "double": True}
    a = load_adapters(full, meta)
    # The merged model is the dequantized base plus the adapters: what the adapters were trained beside.
    merged = zoo.load(final := full)
    base = flatten(zoo.load_params(root / "zoo"))
    paths = quant.quantized_paths(merged.cfg)
    qbase = {k: quant.quantize(np.asarray(v), *paths[k], "nf4", True) if k in paths else v for k, v in base.items()}
    # jitted: eagerly, the dequantization and the forward compile a program per operation and shape (~200)
    deq = nest(jax.jit(lambda q: {k: quant.materialize(v) for k, v in q.items()})(qbase))
    tokens = jax.numpy.asarray(np.arange(1, 21, dtype=np.int32)[None])
    scale = lora_scale(lora_config(meta))
    fwd = jax.jit(forward, static_argnums=0)  # one compilation for the quantized base, one for the float ones
    trained = fwd(merged.cfg, Weights(nest(qbase), a, scale), tokens)
    beside = fwd(merged.cfg, Weights(deq, a, scale), tokens)
    assert np.abs(np.asarray(merged(tokens)) - np.asarray(trained)).max() <= 1e-5
    assert np.abs(np.asarray(trained) - np.asarray(beside)).max() <= 1e-5
    assert np.abs(np.asarray(merged(tokens)) - np.asarray(fwd(merged.cfg, Weights(nest(base), a, scale),
                                                                          tokens))).max() > 1e-4  # the float base would differ
    # zoo export streams the same merged weights (the dequantized base + adapters), one layer at a time.
    assert zoo_main(["export", str(final), "--out", str(tmp_path / "hf")]) == 0
    from safetensors.numpy import load_file

    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for name, key in (("q", "self_attn.q_proj"), ("down", "mlp.down_proj")):
        w = np.asarray(merged.param_dict()["layers"][name])[1]
        np.testing.assert_allclose(hf[f"model.layers.1.{key}.weight"], w.reshape(w.shape[0], -1).T, atol=1e-6)
    # `zoo quantize` once, then LoRA on the stored quantized base (no lora.base_quant): the run reads the fields as
    # stored, which are what the run above quantized at load, so it trains the same adapters bit for bit, also
    # when killed after step 2's checkpoint and resumed (the kill-and-resume check of QLoRA, on this run).
    assert zoo_main(["quantize", str(root / "zoo"), "--out", str(tmp_path / "nf4"), "--double-quant"]) == 0
    cfg = _cfg(root, tmp_path / "stored", *common[:-2], f"model.path={tmp_path / 'nf4'}")
    _killed_after_step_2(cfg, monkeypatch)
    assert (tmp_path / "stored" / "checkpoints" / "2").is_dir() and not (tmp_path / "stored" / "final").exists()
    stored = train(cfg, progress=False, task=SFTTask(cfg))
    smeta = zoo.checkpoints.format.read_meta(stored)
    assert smeta["lora"]["base_quant"] == {"kind": "nf4", "double": True}
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(load_adapters(stored, smeta))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.abs(np.asarray(zoo.load(stored)(tokens)) - np.asarray(merged(tokens))).max() <= 1e-6
    # Another quantization than the stored one is refused before anything is written.
    assert sft_main(["train", f"model.path={tmp_path / 'nf4'}",
                     f"model.tokenizer={root / 'tok'}", f"data.path={root / 'chat.jsonl'}", "data.seq_len=64",
                     "batch_size=4", "max_steps=1", f"output_dir={tmp_path / 'int8'}", "lora.rank=4",
                     "lora.base_quant=int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stored quantized (NF4, double quantization)" in err[0], err
    assert not (tmp_path / "int8").exists()


@pytest.mark.parametrize("bad, words", [
    (("lora.rank=4", "lora.base_quant=nf3"), ["lora.base_quant", "'nf3'", "nf4", "int8"]),
    (("lora.base_quant=nf4",), ["lora.base_quant", "lora.rank"]),
    (("lora.rank=4", "lora.base_quant=int8", "lora.base_quant_double=true"), ["base_quant_double", "nf4"]),
])
def test_qlora_settings_errors_are_one_line(setup, tmp_path, capsys, bad, words):
    root, _ = setup
    args = [f"model.path={root / 'zoo'}", f"model.tokenizer={root / 'tok'}", f"data.path={root / 'chat.jsonl'}",
            "data.seq_len=64", "batch_size=4", "max_steps=1", f"output_dir={tmp_path / 'run'}", *bad]
    capsys.readouterr()
    assert sft_main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(w in err[0] for w in words), err
    assert not (tmp_path / "run").exists()
