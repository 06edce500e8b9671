"""GKD (distill/): the generalized JSD against a NumPy (float64) transcription of TRL 1.16's
``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd/gkd_trainer.py), and the ``distill:`` keys' errors."""

from __future__ import annotations

import numpy as np
import pytest

from distill.config import DistillSection, check_same_tokenizer
from distill.losses import jsd_sum_count
from pretrain.config import load_config
from pretrain.task import task_for
from sft.cli import sft_tasks  # the tasks `sft train` picks from: a GKD variant for distill.teacher
from sft.config import SFTConfig
from tests.trl_oracles import trl_generalized_jsd
from zoo.errors import UserError
from zoo.lora.weights import Weights


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (1.0, 1.0), (0.3, 1.0), (0.5, 2.0)])
def test_jsd_matches_trl_in_micro_batches(beta: float, temperature: float) -> None:
    """Unequal completion lengths (one row fully masked), split into 1, 2 and 4 micro-batches whose
    (sum, count) pairs combine into TRL's loss on the whole batch (its num_items_in_batch normalization)."""
    rng = np.random.default_rng(0)
    b, t, v = 4, 6, 11
    student = rng.normal(size=(b, t, v)) * 2
    teacher = rng.normal(size=(b, t, v)) * 2
    lengths = [6, 2, 0, 4]
    labels = np.full((b, t), -100)
    for i, n in enumerate(lengths):
        labels[i, t - n:] = 1
    want = trl_generalized_jsd(student, teacher, labels, beta, temperature)
    for micro in (1, 2, 4):
        tot = cnt = 0.0
        for chunk in np.split(np.arange(b), micro):
            s, c = jsd_sum_count(student[chunk].astype(np.float32), teacher[chunk].astype(np.float32),
                                 labels[chunk] != -100, beta, temperature)
            tot, cnt = tot + float(s), cnt + float(c)
        assert tot / max(cnt, 1.0) == pytest.approx(want, rel=1e-5, abs=1e-6), (micro, beta, temperature)


def test_step_loss_and_gradient_equal_trl_in_micro_batches(monkeypatch) -> None:
    """The real train step (SFT's task with distill.teacher) on rows of unequal trained lengths, the forward
    pass replaced by a lookup (student logits ``S + b * C``, teacher ``T``), in 1, 2 and 4 micro-batches: the
    loss is TRL's (every micro-batch's JSD sum over its labels, over num_items_in_batch, which TRL counts on the
    dataset's labels before sampling: here ``data_weights``, another count than the trained tokens'), and so is
    the gradient in b (a central difference of the transcription)."""
    import jax.numpy as jnp
    import optax

    import zoo.model.decoder
    from distill.batch import DistillBatch
    from pretrain.jit_step import make_step

    rng = np.random.default_rng(2)
    rows, t, v, beta = 4, 5, 7, 0.3
    ids = np.arange(rows * t).reshape(rows, t) + 1  # each position its own token id: the lookup's key
    s_tab, c_tab, t_tab = (rng.normal(size=(rows * t + 1, v)) for _ in range(3))
    weights = np.zeros((rows, t))
    for r, n in enumerate((5, 1, 3, 2)):
        weights[r, t - n:] = 1
    data_weights = np.zeros((rows, t))
    for r, n in enumerate((2, 4, 0, 3)):
        data_weights[r, :n] = 1

    def fake_forward(mcfg, params, inputs, *args, **kwargs):
        params = Weights.wrap(params).base
        if "b" in params:
            return jnp.asarray(s_tab, jnp.float32)[inputs] + params["b"] * jnp.asarray(c_tab, jnp.float32)[inputs]
        return jnp.asarray(t_tab, jnp.float32)[inputs]

    def want(b: float) -> float:
        labels = np.where(weights > 0, 1, -100)
        n = labels != -100
        return trl_generalized_jsd(s_tab[ids] + b * c_tab[ids], t_tab[ids], labels, beta, 1.0) * n.sum() \
            / data_weights.sum()

    monkeypatch.setattr(zoo.model.decoder, "forward", fake_forward)
    cfg = load_config(None, ["model.path=none", "data.path=none", "max_steps=1", "distill.teacher=t",
                             "distill.lmbda=0.5", f"distill.beta={beta}"], SFTConfig)
    task = task_for(cfg, sft_tasks())
    slope = (want(1e-4) - want(-1e-4)) / 2e-4
    for micro in (1, 2, 4):
        arrays = {"inputs": ids, "targets": ids, "weights": weights, "segment_ids": np.ones_like(ids),
                  "positions": np.tile(np.arange(t), (rows, 1)), "data_weights": data_weights}
        # NumPy inputs: made on the device, each array's conversion would compile a program of its own
        batch = DistillBatch.of({k: np.asarray(x.reshape(micro, rows // micro, t),
                                               np.float32 if "weights" in k else np.int32)
                                 for k, x in arrays.items()})
        step, _ = make_step(None, optax.sgd(0.0), jnp.float32, task=task)
        params = {"b": np.zeros((), np.float32)}
        state = {"params": params, "opt_state": optax.sgd(0.0).init(params), "step": np.zeros((), np.int32)}
        _, m = step(state, batch, frozen_inputs={"t": np.zeros((), np.float32)})
        assert float(m["loss"]) == pytest.approx(want(0.0), rel=1e-5), micro
        assert float(m["grad_norm"]) == pytest.approx(abs(slope), rel=1e-4), micro


def test_jsd_gradient_matches_finite_differences() -> None:
    """The student's gradient (the teacher's is stopped) against float64 central differences of TRL's formula."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    student = rng.normal(size=(2, 3, 5))
    teacher = rng.normal(size=(2, 3, 5))
    labels = np.array([[1, 1, -100], [-100, 1, 1]])
    beta = 0.4

    def ours(x: jax.Array) -> jax.Array:
        s, c = jsd_sum_count(x, jnp.asarray(teacher, jnp.float32), jnp.asarray(labels != -100), beta)
        return s / c

    grad = np.asarray(jax.jit(jax.grad(ours))(student.astype(np.float32)))  # one program, not each op's own
    eps = 1e-6
    for idx in [(0, 0, 0), (0, 1, 3), (1, 2, 4), (1, 0, 2)]:
        up, dn = student.copy(), student.copy()
        up[idx] += eps
        dn[idx] -= eps
        fd = (trl_generalized_jsd(up, teacher, labels, beta, 1.0)
              - trl_generalized_jsd(dn, teacher, labels, beta, 1.0)) / (2 * eps)
        assert grad[idx] == pytest.approx(fd, abs=1e-5), idx


@pytest.mark.parametrize("override", ["distill.lmbda=1.5", "distill.beta=-0.1", "distill.temperature=0",
                                      "distill.max_new_tokens=0", "distill.seq_kd=maybe"])
def test_distill_keys_one_line_errors(override: str) -> None:
    """Each out-of-range key, as `sft train` reads it: one line naming it."""
    base = ["model=m", "data.path=d", "max_steps=1", "distill.teacher=t"]
    with pytest.raises(UserError) as e:
        load_config(None, [*base, override], SFTConfig)
    assert override.split("=")[0] in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, base, SFTConfig).distill == DistillSection(teacher="t")  # TRL's defaults pass


def test_teacher_with_another_tokenizer_is_one_line() -> None:
    """A teacher whose vocabulary differs from the student's is refused, naming the teacher."""
    check_same_tokenizer({"a": 0, "b": 1}, {"a": 0, "b": 1}, "t")
    with pytest.raises(UserError) as e:
        check_same_tokenizer({"a": 0, "b": 1}, {"a": 0, "c": 1}, "ckpt/teacher")
    assert "ckpt/teacher" in str(e.value) and "tokenizer" in str(e.value) and "\n" not in str(e.value)


def test_a_teacher_without_a_tokenizer_reads_with_the_students_or_distill_teacher_tokenizer(
        dpo_models, smollm2_tokenizer, tmp_path) -> None:
    """A `zoo init` teacher (no tokenizer/ folder) is read with the student's tokenizer, as TRL's GKDTrainer reads
    every teacher with the student's processing_class; distill.teacher_tokenizer (a tokenizer folder or a zoo
    checkpoint) is checked against the student's, and a wrong or missing one is one line naming the key."""
    import shutil
    from types import SimpleNamespace

    from distill.config import check_teacher_tokenizer
    from zoo.cli import main

    root, tok, _ = dpo_models
    assert main(["init", str(root / "hf_reference" / "config.json"), "--out", str(tmp_path / "teacher")]) == 0
    assert not (tmp_path / "teacher" / "tokenizer").exists()

    def check(**keys: str) -> None:
        check_teacher_tokenizer(SimpleNamespace(distill=DistillSection(teacher=str(tmp_path / "teacher"), **keys)),
                                tok)

    check()  # the student's tokenizer, as TRL's
    check(teacher_tokenizer=str(root / "tok"))  # a tokenizer folder
    shutil.copytree(root / "policy", tmp_path / "with_tok")
    shutil.copytree(root / "tok", tmp_path / "with_tok" / "tokenizer", dirs_exist_ok=True)
    check(teacher_tokenizer=str(tmp_path / "with_tok"))  # a zoo checkpoint: its tokenizer/
    for other in (str(smollm2_tokenizer), str(tmp_path / "absent")):
        with pytest.raises(UserError) as e:
            check(teacher_tokenizer=other)
        assert str(e.value).startswith(f"distill.teacher_tokenizer {other}: ") and "\n" not in str(e.value)


def test_a_teacher_of_another_vocab_size_is_one_line(tmp_path, capsys) -> None:
    """A teacher whose vocab_size is not the student's is refused before anything compiles, as TRL's GKDTrainer
    refuses it: one line naming distill.teacher and both sizes, exit 2."""
    import json

    from sft.cli import main

    student = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "tie_word_embeddings": False}
    (tmp_path / "student.json").write_text(json.dumps(student))
    (tmp_path / "teacher.json").write_text(json.dumps({**student, "vocab_size": 320}))
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {tmp_path / 'student.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 32\n"
                 f"max_steps: 1\noutput_dir: {tmp_path / 'run'}\ndistill:\n  teacher: {tmp_path / 'teacher.json'}\n"
                 f"  lmbda: 0\n")
    assert main(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "distill.teacher" in err and "320" in err and "256" in err, err


def test_a_teacher_whose_layers_cannot_split_over_mesh_context_is_one_line(tmp_path, capsys) -> None:
    """Set-up checks the student's layers against mesh.context; a teacher runs on the same mesh: a Qwen3-Next
    teacher (linear-attention layers carry a state along the sequence) under mesh.context 2 is refused before
    anything compiles, one line naming distill.teacher, exit 2."""
    import json

    from sft.cli import main

    student = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "tie_word_embeddings": False}
    teacher = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 256,
               "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    (tmp_path / "student.json").write_text(json.dumps(student))
    (tmp_path / "teacher.json").write_text(json.dumps(teacher))
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {tmp_path / 'student.json'}\ndata:\n  seq_len: 32\noutput_dir: {tmp_path / 'run'}\n"
                 f"mesh:\n  context: 2\ndistill:\n  teacher: {tmp_path / 'teacher.json'}\n  lmbda: 0\n")
    assert main(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: distill.teacher {tmp_path / 'teacher.json'}: mesh.context: 2 splits the sequence, but "
                   "the linear-attention layers (0, 1, 2) carry a state along it and cannot run split; set "
                   "mesh.context to 1"), err


@pytest.fixture(scope="module")
def teacher(dpo_models, tmp_path_factory):
    """A teacher of 3 layers and hidden size 48 (not the student's shapes) with the student's tokenizer, at
    ``folder/hf_teacher`` and converted at ``folder/teacher``, built once for the module's runs (read-only).
    Returns the folder."""
    from tests.hf_models import make_llama
    from tests.tiny_lm import TINY_LM
    from zoo.cli import main

    _, tok, _ = dpo_models
    folder = tmp_path_factory.mktemp("distill_teacher")
    make_llama(folder / "hf_teacher", seed=3, vocab_size=len(tok), **{**TINY_LM, "hidden_size": 48, "num_hidden_layers": 3})
    tok.save_pretrained(folder / "hf_teacher")
    assert main(["convert", str(folder / "hf_teacher"), "--out", str(folder / "teacher")]) == 0
    return folder


def _distill_cfg(root, tmp_path, teacher, data: str, seq_len: int, *overrides: str) -> SFTConfig:
    """`sft train` of dpo_models' policy on ``tmp_path/data`` with the ``teacher`` fixture's teacher as
    distill.teacher (lmbda 0), one SGD step."""
    from tests.trl_oracles import SGD_STEP_ONE

    return load_config(None, [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={tmp_path / data}", f"data.seq_len={seq_len}", "batch_size=2",
                              "log_every=1", "checkpoint.every=100", f"output_dir={tmp_path / 'ours'}",
                              *SGD_STEP_ONE, f"distill.teacher={teacher / 'teacher'}", "distill.lmbda=0",
                              *overrides], SFTConfig)


# Two conversations (one answer each): the GKD runs' data.
GKD_ROWS = [{"messages": [{"role": "user", "content": "colour red:"}, {"role": "assistant", "content": "red"}]},
            {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]}]


def _gkd_cfg(root, tmp_path, teacher, lmbda: float, seq_kd: bool, *overrides: str) -> SFTConfig:
    """test_gkd_step_one_equals_trl_trainer's run of ``tmp_path/m.jsonl`` (GKD_ROWS): SGD at lr 100, two
    micro-batches, sampling (where anything is sampled) at temperature 1e-6."""
    return _distill_cfg(root, tmp_path, teacher, "m.jsonl", 64, "optimizer.learning_rate=100", "grad_accum=2",
                        f"distill.lmbda={lmbda}", f"distill.seq_kd={str(seq_kd).lower()}",
                        # the sampler's keys only where something is sampled: else a key the run will not read
                        *(["distill.temperature=1e-6", "distill.max_new_tokens=5"] if lmbda or seq_kd else []),
                        *overrides)


@pytest.fixture(scope="module")
def dataset_run(dpo_models, teacher, tmp_path_factory):
    """The GKD step on the dataset's completions (lmbda 0), trained once: test_gkd_step_one_equals_trl_trainer's
    ``dataset`` case and test_sft_train_with_a_deeper_wider_teacher read it. Returns (folder, config): the run
    is at ``folder/ours``."""
    from pretrain.loop import train
    from tests.run_files import write_jsonl

    root, _, _ = dpo_models
    folder = tmp_path_factory.mktemp("gkd_dataset")
    write_jsonl(folder / "m.jsonl", GKD_ROWS)
    cfg = _gkd_cfg(root, folder, teacher, 0.0, False)
    train(cfg, progress=False, task=task_for(cfg, sft_tasks()))
    return folder, cfg


@pytest.mark.slow
def test_sft_train_with_a_deeper_wider_teacher(dpo_models, teacher, dataset_run) -> None:
    """`sft train` with distill.teacher (3 layers, hidden 48: not the student's shapes), lmbda 0: the step-1 loss
    is TRL's generalized JSD of the student's and teacher's HF logits on the trained tokens (beta 0.5), here
    transcribed from transformers' logits (test_gkd_step_one_equals_trl_trainer checks the same run against
    TRL's GKDTrainer itself)."""
    from transformers import AutoModelForCausalLM

    from tests.hf_models import hf_logits
    from tests.run_files import read_metrics

    root, tok, _ = dpo_models
    folder, cfg = dataset_run
    got = read_metrics(folder / "ours")[0]
    task = task_for(cfg, sft_tasks())
    docs = task.documents(task.load(str(folder / "m.jsonl"), cfg), tok, "m", False).docs
    assert len(docs) == 2
    teacher = AutoModelForCausalLM.from_pretrained(teacher / "hf_teacher", attn_implementation="eager").eval()
    student = AutoModelForCausalLM.from_pretrained(root / "hf_policy", attn_implementation="eager").eval()
    total = count = 0.0
    for d in docs.values():
        ids, mask = np.asarray(d["tokens"]), np.asarray(d["loss_mask"]).astype(bool)
        labels = np.where(mask[1:], ids[1:], -100)[None]  # TRL's shifted labels: logits at i predict token i + 1
        s, t = hf_logits(student, ids[None])[:, :-1], hf_logits(teacher, ids[None])[:, :-1]
        n = int((labels != -100).sum())
        total += trl_generalized_jsd(s.astype(np.float64), t.astype(np.float64), labels, 0.5, 1.0) * n
        count += n
    assert count > 0
    np.testing.assert_allclose(got["loss"], total / count, rtol=1e-5)



@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dataset", "on_policy", "seq_kd"])
def test_gkd_step_one_equals_trl_trainer(dpo_models, teacher, tmp_path, request, mode: str) -> None:
    """One SGD step against TRL 1.16's own GKDTrainer with a deeper, wider teacher, two rows in two micro-batches:
    loss, grad_norm and every weight's change within 1e-5, on the dataset's completions (lmbda 0), on the
    student's samples (lmbda 1) and on the teacher's (lmbda 0, seq_kd). Both sides sample at temperature 1e-6, so
    each draw is the argmax on either side; the loss divides by the dataset's completion tokens on both (TRL's
    num_items_in_batch is counted before sampling). The step is SGD at lr 100 (both sides): at lr 1 the changes
    of weights near 1 (norms) are ~2e-4, where one float32 ulp of the stored weight (6e-8) exceeds 1e-5 of the
    change."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML

    from pretrain.loop import train
    from tests.run_files import read_metrics, write_jsonl
    from tests.trl_oracles import assert_same_change, assert_same_metrics, exported_change, trl_step_one

    root, tok, _ = dpo_models
    rows = GKD_ROWS
    write_jsonl(tmp_path / "m.jsonl", rows)
    lmbda, seq_kd = {"dataset": (0.0, False), "on_policy": (1.0, False), "seq_kd": (0.0, True)}[mode]

    def load(p):
        return AutoModelForCausalLM.from_pretrained(p, attn_implementation="eager", dtype=torch.float32)

    def collate(examples: list) -> dict:
        # TRL's ChatML collator also labels the "\n" after the answer's <|im_end|>, which SFT's assistant-only
        # mask leaves out (a data-layout difference, not the loss's): unlabel each row's last real token
        b = chatml(examples)
        last = b["attention_mask"].cumsum(-1).argmax(-1)
        b["labels"][torch.arange(len(last)), last] = -100
        return b

    chatml = DataCollatorForChatML(tokenizer=tok, max_length=64)
    # one row per micro-batch: TRL's generate left-pads a batch's prompts, and its training forward then counts
    # positions from the padding (our rows start each prompt at 0)
    want, trl_change = trl_step_one(GKDTrainer, GKDConfig, load(root / "hf_policy"), tmp_path / "trl",
                                    dict(teacher_model=load(teacher / "hf_teacher"), data_collator=collate,
                                         train_dataset=Dataset.from_list(rows), processing_class=tok),
                                    lmbda=lmbda, seq_kd=seq_kd, beta=0.5, per_device_train_batch_size=1,
                                    gradient_accumulation_steps=2, max_length=64, learning_rate=100.0,
                                    temperature=1e-6, max_new_tokens=5)
    if mode == "dataset":  # the module's run (test_sft_train_with_a_deeper_wider_teacher reads it too)
        ours = request.getfixturevalue("dataset_run")[0] / "ours"
    else:
        cfg = _gkd_cfg(root, tmp_path, teacher, lmbda, seq_kd)
        train(cfg, progress=False, task=task_for(cfg, sft_tasks()))
        ours = tmp_path / "ours"
    got = read_metrics(ours)[0]
    assert_same_metrics(got, want, ("loss", "grad_norm"))
    assert_same_change(exported_change(ours / "final", root / "hf_policy", tmp_path / "exp"), trl_change)
    if mode == "on_policy":  # LoRA: fresh adapters add nothing, so its student samples and scores as the base does
        lora = _distill_cfg(root, tmp_path, teacher, "m.jsonl", 64, "grad_accum=2", "distill.lmbda=1", "lora.rank=2",
                            "distill.temperature=1e-6", "distill.max_new_tokens=5", f"output_dir={tmp_path / 'lora'}")
        train(lora, progress=False, task=task_for(lora, sft_tasks()))
        assert read_metrics(tmp_path / "lora")[0]["loss"] == pytest.approx(want["loss"], rel=1e-5)


@pytest.mark.slow
def test_compile_only_lays_out_the_teacher_and_both_samplers(tmp_path, capsys) -> None:
    """`sft train --compile-only` with a wider teacher (a config.json: no weights, no data), student samples and
    seq_kd: the step compiles for v5e:2x2 with the teacher as a frozen input, and both samplers are compiled
    and reported with their KV caches (the engine's page pools: k and v x layers x rows x kv heads x head_dim x
    slots x float32)."""
    import json

    from sft.cli import main

    student = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "tie_word_embeddings": False}
    teacher = {**student, "hidden_size": 96, "num_hidden_layers": 3, "num_key_value_heads": 4}
    (tmp_path / "student.json").write_text(json.dumps(student))
    (tmp_path / "teacher.json").write_text(json.dumps(teacher))
    f = tmp_path / "run.yaml"
    f.write_text(f"model: {tmp_path / 'student.json'}\ndata:\n  path: {tmp_path / 'absent.jsonl'}\n  seq_len: 32\n"
                 f"batch_size: 8\ngrad_accum: 2\nmax_steps: 1\noutput_dir: {tmp_path / 'run'}\nlora:\n  rank: 4\n"
                 f"distill:\n  teacher: {tmp_path / 'teacher.json'}\n  lmbda: 0.5\n  seq_kd: true\n"
                 f"  max_new_tokens: 8\n")
    report = tmp_path / "report.json"
    code = main(["train", "--config", str(f), "--compile-only", "--topology", "v5e:2x2", "--report", str(report)])
    out = capsys.readouterr()
    assert code == 0, out.err
    rep = json.loads(report.read_text())
    programs = rep["programs"]
    assert set(programs) == {"sampler", "teacher_sampler"}
    slots, rows = 3 * 16, 4  # one micro-batch's prompts (batch 8 over grad_accum 2): 32 + 1 + 8 in pages of 16
    assert programs["sampler"]["kv_cache"] == 2 * 2 * rows * 2 * 16 * slots * 4  # 2 kv heads on each of 4 chips
    assert programs["teacher_sampler"]["kv_cache"] == 2 * 3 * rows * 4 * 16 * slots * 4 // 4  # 4 kv heads split
    assert rep["tokens_per_step"] == 8 * (32 + 8)
    assert not (tmp_path / "run").exists()


def test_coins_are_the_seed_and_steps_and_prompts_end_before_the_last_answer() -> None:
    """The on-policy coin of each micro-batch depends on (seed, step) alone, with rate lmbda (0: never, 1:
    always); a row's sampling prompt is every token before its last trained span (a multi-turn row keeps its
    first answer in the prompt), and a row that trains nothing has no prompt."""
    import jax

    from distill.online import coins, prompts

    assert np.array_equal(coins(3, 7, 4, 0.5), coins(3, 7, 4, 0.5))
    draws = np.concatenate([coins(3, s, 4, 0.3) for s in range(500)])
    assert abs(draws.mean() - 0.3) < 0.04 and not np.array_equal(coins(3, 7, 64, 0.5), coins(3, 8, 64, 0.5))
    assert not coins(0, 0, 64, 0.0).any() and coins(0, 0, 64, 1.0).all()
    tokens = np.asarray([[5, 6, 7, 8, 9, 10, 11, 0], [5, 6, 7, 8, 0, 0, 0, 0]], np.int32)
    mask = np.asarray([[0, 0, 1, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
    seg = np.asarray([[1] * 7 + [0], [1] * 4 + [0] * 4], np.int32)
    p, valid = jax.jit(prompts)(tokens, mask, seg)  # one program (eagerly, each of its ops compiles its own)
    np.testing.assert_array_equal(np.asarray(valid), [[1, 1, 1, 1, 1, 1, 0, 0], [0] * 8])
    np.testing.assert_array_equal(np.asarray(p)[0], [5, 6, 7, 8, 9, 10, 0, 0])


def test_a_distill_config_picks_its_gkd_task() -> None:
    """GKD is a variant of the SFT task chosen by the config, as dpo's KTO is: a teacher without sampled
    completions is GKDTask (SFT's packed rows), with them OnlineGKDTask (online, one example per row); without a
    teacher, plain SFT."""
    from sft.gkd import GKDTask, OnlineGKDTask
    from sft.task import SFTTask

    def pick(*overrides: str) -> SFTTask:
        base = ["model.path=none", "data.path=none", "max_steps=1"]
        return task_for(load_config(None, [*base, *overrides], SFTConfig), sft_tasks())

    assert type(pick()) is SFTTask
    offline = pick("distill.teacher=t", "distill.lmbda=0")
    assert type(offline) is GKDTask and not offline.online and offline.packing == "best_fit"
    for sampled in (pick("distill.teacher=t"), pick("distill.teacher=t", "distill.lmbda=0", "distill.seq_kd=true")):
        assert type(sampled) is OnlineGKDTask and sampled.online and sampled.packing == "none"
