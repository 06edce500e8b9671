"""GKD (distill/): the generalized JSD against a NumPy (float64) transcription of TRL 1.16's
``GKDTrainer.generalized_jsd_loss`` (trl/experimental/gkd/gkd_trainer.py), and the ``distill:`` keys' errors."""

from __future__ import annotations

import numpy as np
import pytest

from distill.config import DistillSection, check_same_tokenizer
from distill.losses import jsd_sum_count
from pretrain.config import load_config
from sft.config import SFTConfig
from zoo.errors import UserError


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_div(inp: np.ndarray, target: np.ndarray) -> np.ndarray:
    """torch.nn.functional.kl_div(inp, target, reduction='none', log_target=True): exp(t) * (t - inp)."""
    return np.exp(target) * (target - inp)


def trl_generalized_jsd(student: np.ndarray, teacher: np.ndarray, labels: np.ndarray, beta: float,
                        temperature: float) -> float:
    """TRL 1.16 generalized_jsd_loss, reduction 'batchmean' with labels (-100 ignored), transcribed."""
    s = _log_softmax(student / temperature)
    t = _log_softmax(teacher / temperature)
    if beta == 0:
        jsd = _kl_div(s, t)
    elif beta == 1:
        jsd = _kl_div(t, s)
    else:
        mix = np.logaddexp(s + np.log1p(-beta), t + np.log(beta))
        jsd = beta * _kl_div(mix, t) + (1 - beta) * _kl_div(mix, s)
    mask = labels != -100
    jsd = jsd[mask]  # [N, V] (TRL sums every element: over positions and vocabulary)
    return float(jsd.sum() / max(mask.sum(), 1))


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

    grad = np.asarray(jax.grad(ours)(jnp.asarray(student, jnp.float32)))
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


def _deeper_wider_teacher(tok, folder) -> None:
    """A teacher of 3 layers and hidden size 48 (not the student's shapes) with the student's tokenizer, at
    ``folder/hf_teacher`` and converted at ``folder/teacher``."""
    from tests.helpers import TINY_LM, make_llama
    from zoo.cli import main

    make_llama(folder / "hf_teacher", seed=3, vocab_size=len(tok), **{**TINY_LM, "hidden_size": 48, "num_hidden_layers": 3})
    tok.save_pretrained(folder / "hf_teacher")
    assert main(["convert", str(folder / "hf_teacher"), "--out", str(folder / "teacher")]) == 0


def _distill_cfg(root, tmp_path, data: str, seq_len: int, *overrides: str) -> SFTConfig:
    """`sft train` of dpo_models' policy on ``tmp_path/data`` with distill.teacher (lmbda 0), one SGD step."""
    from tests.helpers import SGD_STEP_ONE

    return load_config(None, [f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}",
                              f"data.path={tmp_path / data}", f"data.seq_len={seq_len}", "batch_size=2",
                              "log_every=1", "checkpoint.every=100", f"output_dir={tmp_path / 'ours'}",
                              *SGD_STEP_ONE, *overrides, f"distill.teacher={tmp_path / 'teacher'}",
                              "distill.lmbda=0"], SFTConfig)


@pytest.mark.slow
def test_sft_train_with_a_deeper_wider_teacher(dpo_models, tmp_path) -> None:
    """`sft train` with distill.teacher (3 layers, hidden 48: not the student's shapes), lmbda 0: the step-1 loss
    is TRL's generalized JSD of the student's and teacher's HF logits on the trained tokens (beta 0.5)."""
    from transformers import AutoModelForCausalLM

    from pretrain.trainer import train
    from sft.task import SFTTask
    from tests.helpers import hf_logits, read_metrics, write_jsonl

    root, tok, _ = dpo_models
    _deeper_wider_teacher(tok, tmp_path)
    rows = [{"prompt": "colour red:", "completion": " red"}, {"prompt": "the cat", "completion": " sat on the mat"}]
    write_jsonl(tmp_path / "pc.jsonl", rows)
    cfg = _distill_cfg(root, tmp_path, "pc.jsonl", 32)
    train(cfg, progress=False, task=SFTTask(cfg))
    got = read_metrics(tmp_path / "ours")[0]
    task = SFTTask(cfg)
    docs = task.documents(task.load(str(tmp_path / "pc.jsonl"), cfg), tok, "pc", False).docs
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_teacher", attn_implementation="eager").eval()
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
def test_gkd_step_one_equals_trl_trainer(dpo_models, tmp_path) -> None:
    """lmbda 0 (the dataset's completions): one SGD step against TRL 1.16's own GKDTrainer with a deeper, wider
    teacher: loss, grad_norm and every weight's change within 1e-5. The step is SGD at lr 100 (both sides): at lr 1
    the changes of weights near 1 (norms) are ~2e-4, where one float32 ulp of the stored weight (6e-8) exceeds
    1e-5 of the change."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDConfig, GKDTrainer
    from trl.experimental.utils import DataCollatorForChatML

    from pretrain.trainer import train
    from sft.task import SFTTask
    from tests.helpers import (
        assert_same_change,
        assert_same_metrics,
        exported_change,
        read_metrics,
        trl_step_one,
        write_jsonl,
    )

    root, tok, _ = dpo_models
    _deeper_wider_teacher(tok, tmp_path)
    rows = [{"messages": [{"role": "user", "content": "colour red:"}, {"role": "assistant", "content": "red"}]},
            {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]}]
    write_jsonl(tmp_path / "m.jsonl", rows)

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
    want, trl_change = trl_step_one(GKDTrainer, GKDConfig, load(root / "hf_policy"), tmp_path / "trl",
                                    dict(teacher_model=load(tmp_path / "hf_teacher"), data_collator=collate,
                                         train_dataset=Dataset.from_list(rows), processing_class=tok),
                                    lmbda=0.0, beta=0.5, per_device_train_batch_size=2, max_length=64,
                                    learning_rate=100.0)
    cfg = _distill_cfg(root, tmp_path, "m.jsonl", 64, "optimizer.learning_rate=100")
    train(cfg, progress=False, task=SFTTask(cfg))
    got = read_metrics(tmp_path / "ours")[0]
    assert_same_metrics(got, want, ("loss", "grad_norm"))
    assert_same_change(exported_change(tmp_path / "ours" / "final", root / "hf_policy", tmp_path / "exp"), trl_change)


@pytest.mark.parametrize("kwargs", [{"lmbda": 0.5}, {"lmbda": 0.0, "seq_kd": True}])
def test_sampled_completions_refused_in_one_line(kwargs: dict) -> None:
    """Sampled completions (lmbda > 0, seq_kd) are not implemented yet: one line, before any checkpoint is read."""
    from types import SimpleNamespace

    from distill.config import load_teacher

    ctx = SimpleNamespace(cfg=SimpleNamespace(distill=DistillSection(teacher="/nonexistent", **kwargs)))
    with pytest.raises(UserError) as e:
        load_teacher(ctx)
    assert "distill.lmbda" in str(e.value) and "\n" not in str(e.value)
