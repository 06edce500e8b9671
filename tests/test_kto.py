"""KTO (`dpo.loss_type: kto`, dpo/kto.py, prefs/unpaired.py) against TRL 1.16's KTOTrainer: its loss, KL and
metrics written out in NumPy (float64) through the real train step in 1, 2 and 4 micro-batches, its data rules
(paired rows unpacked, completions rotated within micro-batch chunks for the KL), the one-line errors, and one
SGD step against KTOTrainer itself."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dpo.kto
import dpo.task
from dpo.cli import dpo_tasks
from dpo.config import DPOConfig
from dpo.kto import KTOTask
from prefs.pairs import CHOSEN, PROMPT, REJECTED
from pretrain.config import load_config
from pretrain.jit_step import make_step
from pretrain.task import task_for
from tests.preference_data import LookupRows, lookup_batch_logps
from zoo.errors import UserError

BETA, WD, WU = 0.1, 1.3, 0.7
LABELS = (1, 0, 1, 1, 0, 0, 1, 0)  # micro-batches of 2 rows: (1,0), (1,1) all desirable, (0,0) none, (1,0)
Y_LENS, Z_LENS = (3, 1, 4, 2, 2, 5, 1, 3), (2, 4, 1, 3, 5, 1, 2, 2)  # completions and mismatched completions
SEQ, PROMPT_LEN = 16, 2


def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def _numbers(seed: int = 0) -> dict[str, list]:
    """Per-token log-probabilities: policy and reference of each row's completion (y) and mismatched
    completion (z), the direction the fake parameter b moves each policy token, and mean logits."""
    rng = np.random.RandomState(seed)
    out: dict[str, list] = {}
    for side, lens in (("y", Y_LENS), ("z", Z_LENS)):
        out[f"pol_{side}"] = [rng.uniform(-3.0, -0.1, n) for n in lens]
        out[f"ref_{side}"] = [rng.uniform(-3.0, -0.1, n) for n in lens]
        out[f"coef_{side}"] = [rng.uniform(-1.0, 1.0, n) for n in lens]
        out[f"logit_{side}"] = [rng.normal(0.0, 2.0, n) for n in lens]
    return out


def trl_kto(micro: int, b: float = 0.0) -> dict[str, float]:
    """KTOTrainer._compute_loss on each micro-batch, its loss averaged over them (Trainer: loss / GA) and each
    metric averaged over the micro-batches that appended it (KTOTrainer.log). ``b`` moves the policy's
    completions, not the detached KL estimate (a central difference in b is then the gradient)."""
    a = _numbers()
    logged: dict[str, list] = {}
    losses = []
    for rows in np.array_split(np.arange(len(LABELS)), micro):
        y = np.array([(a["pol_y"][i] + b * a["coef_y"][i]).sum() for i in rows])
        z = np.array([a["pol_z"][i].sum() for i in rows])  # at b = 0: TRL detaches the KL (.detach())
        ry = np.array([a["ref_y"][i].sum() for i in rows])
        rz = np.array([a["ref_z"][i].sum() for i in rows])
        lab = np.array([LABELS[i] for i in rows], bool)
        kl = max((z - rz).mean(), 0.0)
        ratio = y - ry
        chosen = 1 - _sig(BETA * (ratio[lab] - kl))
        rejected = 1 - _sig(BETA * (kl - ratio[~lab]))
        losses.append(np.concatenate([WD * chosen, WU * rejected]).mean())
        logged.setdefault("kl", []).append(kl)
        for side, m in (("chosen", lab), ("rejected", ~lab)):
            if m.any():
                logged.setdefault(f"rewards/{side}", []).append((BETA * ratio[m]).sum() / m.sum())
                logged.setdefault(f"logps/{side}", []).append(y[m].sum() / m.sum())
                toks = np.concatenate([a["logit_y"][i] for i, keep in zip(rows, m) if keep])
                logged.setdefault(f"logits/{side}", []).append(toks.mean())
        if lab.any() and (~lab).any():
            logged.setdefault("rewards/margins", []).append(logged["rewards/chosen"][-1] - logged["rewards/rejected"][-1])
    return {"loss": float(np.mean(losses)), **{k: float(np.mean(v)) for k, v in logged.items()}}


def _rows() -> dict[str, np.ndarray]:
    """Pair-layout rows: the prompt's targets, the completion (segment 1), the mismatched completion (segment
    2; each segment's last position predicts the next segment and weighs nothing), the label on every token."""
    a = _numbers()
    n = len(LABELS)
    rows = {k: np.zeros((n, SEQ), np.float32) for k in ("weights", "fake_logps", "ref_logps", "fake_coef",
                                                         "fake_logits", "label")}
    rows["segment_ids"] = np.zeros((n, SEQ), np.int32)
    for i in range(n):
        rows["segment_ids"][i, :PROMPT_LEN] = PROMPT
        rows["label"][i] = LABELS[i]
        at = PROMPT_LEN
        for side, seg in (("y", CHOSEN), ("z", REJECTED)):
            k = len(a[f"pol_{side}"][i])
            span = slice(at, at + k)
            rows["segment_ids"][i, at:at + k + 1], rows["weights"][i, span] = seg, 1.0
            rows["fake_logps"][i, span], rows["ref_logps"][i, span] = a[f"pol_{side}"][i], a[f"ref_{side}"][i]
            rows["fake_coef"][i, span], rows["fake_logits"][i, span] = a[f"coef_{side}"][i], a[f"logit_{side}"][i]
            rows["fake_logps"][i, at + k:] = rows["ref_logps"][i, at + k:] = -50.0  # never read
            at += k + 1
        rows["fake_logps"][i, :PROMPT_LEN] = rows["ref_logps"][i, :PROMPT_LEN] = -50.0
    return rows


def _step(micro: int, monkeypatch) -> dict[str, float]:
    monkeypatch.setattr(dpo.task, "batch_logps", lookup_batch_logps)
    monkeypatch.setattr(dpo.kto, "batch_logps", lookup_batch_logps)
    cfg = load_config(None, ["model.path=none", "data.path=none", "max_steps=1", "dpo.reference=precomputed",
                             "dpo.loss_type=kto", f"dpo.beta={BETA}", f"dpo.desirable_weight={WD}",
                             f"dpo.undesirable_weight={WU}", "batch_size=8", f"grad_accum={micro}"], DPOConfig)
    task = task_for(cfg, dpo_tasks())  # what `dpo train` builds
    assert isinstance(task, KTOTask)
    batch = LookupRows.of({k: jnp.asarray(v.reshape(micro, -1, SEQ)) for k, v in _rows().items()})
    step, _ = make_step(None, optax.sgd(0.0), jnp.float32, task=task)
    params = {"b": jnp.zeros((), jnp.float32)}
    state = {"params": params, "opt_state": optax.sgd(0.0).init(params), "step": jnp.ones((), jnp.int32)}
    _, m = step(state, batch)
    return {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]), **{k: float(v) for k, v in m["task"].items()}}


def test_kto_step_equals_trl_in_micro_batches(monkeypatch):
    """Desirable and undesirable rows of unequal lengths in 1, 2 and 4 micro-batches (one micro-batch all
    desirable, one all undesirable, so some metrics skip them, and the KL is each micro-batch's own): the
    loss, kl, rewards/*, logps/*, logits/* and the gradient equal TRL's."""
    h = 1e-4
    for micro in (1, 2, 4):
        want = trl_kto(micro)
        slope = (trl_kto(micro, h)["loss"] - trl_kto(micro, -h)["loss"]) / (2 * h)
        got = _step(micro, monkeypatch)
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{k}, {micro} micro")
        np.testing.assert_allclose(got["grad_norm"], abs(slope), rtol=1e-4, err_msg=f"{micro} micro")
    assert abs(trl_kto(1)["kl"] - trl_kto(4)["kl"]) > 1e-3  # the KL is per micro-batch: the split matters


KTO_ROWS = [{"prompt": "colour red:", "completion": " red", "label": True},
            {"prompt": "colour green:", "completion": " blue blue blue", "label": False},
            {"prompt": "colour white:", "completion": " white white", "label": True},
            {"prompt": "colour blue:", "completion": " red red red red", "label": False}]


def test_paired_rows_unpack_and_completions_rotate_as_trl_builds_them(dpo_models, tmp_path):
    """Paired rows become TRL's unpaired rows (trl.data_utils.unpair_preference_dataset is the oracle: chosen of
    the block, then rejected), and each row's mismatched completion is the previous row's of its micro-batch
    chunk, cyclically (KTOTrainer's add_kl_completion_ids), token by token after the row's own prompt."""
    from datasets import Dataset
    from trl.data_utils import unpair_preference_dataset

    from tests.preference_data import UNEVEN_PAIRS, dpo_cfg
    from tests.run_files import write_jsonl

    root, tok, _ = dpo_models
    pairs = UNEVEN_PAIRS[:3]
    write_jsonl(tmp_path / "pairs.jsonl", pairs)
    cfg = dpo_cfg(root, tmp_path / "out", "max_steps=1", "dpo.loss_type=kto", f"dpo.reference={root / 'reference'}",
                  f"data.path={tmp_path / 'pairs.jsonl'}")  # batch_size 4: chunks of 4 rows
    task = KTOTask(cfg)
    rows = task.load(str(tmp_path / "pairs.jsonl"), cfg)
    want = unpair_preference_dataset(Dataset.from_list(pairs))
    assert [(r["completion"], r["label"]) for r in rows.ds] == list(zip(want["completion"], want["label"]))
    docs = task.documents(rows, tok, "pairs", False).docs
    assert sorted(docs) == list(range(6))

    def segment(doc, seg):
        m = (doc["tokens_segment_ids"] == seg) & doc["loss_mask"]
        return doc["tokens"][m].tolist()

    source = {0: 3, 1: 0, 2: 1, 3: 2, 4: 5, 5: 4}  # chunks [0..3] and [4, 5]
    for i, j in source.items():
        assert segment(docs[i], REJECTED) == segment(docs[j], CHOSEN), i
        assert docs[i]["label"][0] == float(want["label"][i])


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": " b"}], "need a 'label' field"),
    ([{"prompt": "a", "completion": " b", "label": True}, {"prompt": "a", "completion": " c", "label": None}],
     "line 2: field 'label' is missing"),
    ([{"prompt": "a", "completion": " b", "label": True}, {"prompt": "a", "completion": " c", "label": "yes"}],
     "line 2: field 'label' is 'yes', not true or false"),
    ([{"prompt": "a", "answer": " b"}], "KTO rows need 'prompt', 'completion' and 'label' fields"),
])
def test_bad_kto_rows_are_one_line(dpo_models, tmp_path, rows, message):
    from tests.preference_data import dpo_cfg
    from tests.run_files import write_jsonl

    root, tok, _ = dpo_models
    write_jsonl(tmp_path / "bad.jsonl", rows)
    cfg = dpo_cfg(root, tmp_path / "out", "max_steps=1", "dpo.loss_type=kto", f"dpo.reference={root / 'reference'}",
                  f"data.path={tmp_path / 'bad.jsonl'}")
    task = KTOTask(cfg)
    with pytest.raises(UserError) as e:
        task.documents(task.load(str(tmp_path / "bad.jsonl"), cfg), tok, str(tmp_path / "bad.jsonl"), False)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_kto_needs_two_rows_per_micro_batch():
    with pytest.raises(UserError) as e:
        KTOTask(load_config(None, ["model.path=m", "data.path=d", "max_steps=1", "dpo.loss_type=kto",
                                   "batch_size=2", "grad_accum=2"], DPOConfig))
    assert "at least 2 rows per micro-batch" in str(e.value)


# One SGD step of kto at lr 100 (SGD_STEP_ONE's optimizer): at lr 1 some changes (~4e-3) are within one float32 ulp
# of their weight (6e-8) of 1e-5 of the largest.
KTO_STEP = ("optimizer.learning_rate=100", "dpo.loss_type=kto", f"dpo.beta={BETA}", f"dpo.desirable_weight={WD}",
            f"dpo.undesirable_weight={WU}")


@pytest.fixture(scope="module")
def kto_live(dpo_models, tmp_path_factory):
    """KTO_STEP against dpo_models' reference checkpoint on KTO_ROWS, trained once: the run that
    test_kto_step_one_equals_trl_kto_trainer compares with TRL and whose step-1 metrics (taken before the
    update) test_kto_references_base_and_precomputed's precomputed reference must reproduce.
    Returns the folder of kto.jsonl and the run (``ours``)."""
    from pretrain.loop import train
    from tests.preference_data import dpo_cfg
    from tests.run_files import write_jsonl
    from tests.trl_oracles import SGD_STEP_ONE

    root, _, _ = dpo_models
    folder = tmp_path_factory.mktemp("kto_live")
    write_jsonl(folder / "kto.jsonl", KTO_ROWS)
    cfg = dpo_cfg(root, folder / "ours", *SGD_STEP_ONE, *KTO_STEP, f"dpo.reference={root / 'reference'}",
                  f"data.path={folder / 'kto.jsonl'}")
    train(cfg, progress=False, task=KTOTask(cfg))
    return folder


@pytest.mark.slow
def test_kto_step_one_equals_trl_kto_trainer(dpo_models, kto_live, tmp_path):
    """One SGD step of `dpo train` (kto, a reference checkpoint, desirable and undesirable rows of unequal
    lengths, one micro-batch: TRL's KL chunk) against one step of trl.KTOTrainer on the same transformers models:
    loss, grad_norm, kl, rewards/*, logps/*, logits/* and every weight's change within 1e-5. SGD at lr 100 on both
    sides (KTO_STEP)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import KTOConfig, KTOTrainer

    from tests.run_files import read_metrics
    from tests.trl_oracles import (
        assert_same_change,
        assert_same_metrics,
        exported_change,
        reward_operands,
        trl_step_one,
    )

    root, tok, _ = dpo_models

    def load(name):
        return AutoModelForCausalLM.from_pretrained(root / name, attn_implementation="eager", dtype=torch.float32)

    want, trl_change = trl_step_one(KTOTrainer, KTOConfig, load("hf_policy"), tmp_path / "trl",
                                    dict(ref_model=load("hf_reference"), train_dataset=Dataset.from_list(KTO_ROWS),
                                         processing_class=tok),
                                    beta=BETA, desirable_weight=WD, undesirable_weight=WU, per_device_train_batch_size=4,
                                    learning_rate=100.0)
    got = read_metrics(kto_live / "ours")[0]
    assert_same_metrics(got, want, ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
                                    "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"),
                        reward_operands(want, BETA))
    assert got["kl"] > 0  # the reference differs from the policy: the KL term is exercised
    assert_same_change(exported_change(kto_live / "ours" / "final", root / "hf_policy", tmp_path / "exp"), trl_change)


@pytest.mark.slow
def test_kto_references_base_and_precomputed(dpo_models, kto_live, tmp_path, capsys):
    """`dpo train` with LoRA and dpo.reference: base (the adapters off): at step 1 the policy is its reference, so every reward
    and the KL are exactly 0 and the loss is the weighted 1 - sigmoid(0) = 0.5 mean. Precomputed scores of the
    reference checkpoint give the live checkpoint's step-1 metrics, and the log counts them as rows (KTO's are
    unpaired), not pairs. The live run is kto_live's (step 1's metrics come before its update)."""
    from pretrain.loop import train
    from tests.preference_data import DPO_LORA, dpo_cfg
    from tests.run_files import read_metrics, write_jsonl
    from tests.trl_oracles import SGD_STEP_ONE

    root, _, _ = dpo_models
    write_jsonl(tmp_path / "kto.jsonl", KTO_ROWS)
    common = ("max_steps=1", "dpo.loss_type=kto", f"dpo.desirable_weight={WD}", f"dpo.undesirable_weight={WU}",
              f"data.path={tmp_path / 'kto.jsonl'}")

    from dpo.cli import main  # the command: it picks KTOTask for dpo.loss_type kto

    assert main(["train", f"model.path={root / 'policy'}", f"model.tokenizer={root / 'tok'}", "data.seq_len=32",
                 "batch_size=4", "log_every=1", f"output_dir={tmp_path / 'base'}", *common, *DPO_LORA,
                 "dpo.reference=base"]) == 0
    base = read_metrics(tmp_path / "base")[0]
    assert base["kl"] == 0 and base["rewards/chosen"] == 0 and base["rewards/rejected"] == 0
    assert base["loss"] == pytest.approx(0.5 * (2 * WD + 2 * WU) / 4, rel=1e-6)
    live = read_metrics(kto_live / "ours")[0]
    capsys.readouterr()
    cfg = dpo_cfg(root, tmp_path / "cached", *SGD_STEP_ONE, *KTO_STEP, "dpo.reference=precomputed",
                  f"dpo.reference_model={root / 'reference'}", f"data.path={tmp_path / 'kto.jsonl'}")
    train(cfg, progress=False, task=KTOTask(cfg))
    cached = read_metrics(tmp_path / "cached")[0]
    assert f"cache miss, computed {len(KTO_ROWS)} rows with" in capsys.readouterr().err
    for k in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        assert cached[k] == pytest.approx(live[k], rel=1e-5, abs=1e-6), k
    assert live["kl"] > 0
