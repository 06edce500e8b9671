"""Best-fit packing of SFT examples: whole examples, no attention across them, the loss of the examples alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain.batch import TokenBatch
from pretrain.data.pipeline import fit_documents, packed_batches
from pretrain.task import next_token_loss_sums
from zoo.data.batching import to_model_batch
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.params import nest, param_specs

CFG = ModelConfig(family="llama", vocab_size=80, hidden_size=48, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)
SEQ = 31  # rows of 32 tokens


def _docs(n=24, seed=0):
    rng = np.random.RandomState(seed)
    docs = []
    for _ in range(n):
        length = int(rng.randint(4, 17))
        mask = np.zeros(length, bool)
        mask[rng.randint(1, length - 1):] = True  # a prompt, then a trained completion
        docs.append({"tokens": rng.randint(1, 80, length).astype(np.int32), "loss_mask": mask})
    return docs


def _all_rows(docs, packing):
    return [r for b in packed_batches(docs, SEQ, 1, 0, 1, packing) for r in [b]]


def test_best_fit_keeps_examples_whole_and_pads_little():
    docs = _docs()
    rows = _all_rows(docs, "best_fit")
    seen = []
    for b in rows:
        tok, seg, pos = b["tokens"][0], b["tokens_segment_ids"][0], b["tokens_positions"][0]
        for s in sorted(set(seg[seg > 0].tolist())):
            piece = tok[seg == s]
            assert (pos[seg == s] == np.arange(len(piece))).all()  # positions restart per example
            seen.append(piece.tolist())
    # Every example appears exactly once, whole (never cut across rows).
    assert sorted(seen) == sorted(d["tokens"].tolist() for d in docs)
    # Padding of the full rows (the last row holds whatever is left at the end of the data).
    padding = 1 - np.mean([(b["tokens_segment_ids"] != 0).mean() for b in rows[:-1]])
    total = sum(len(d["tokens"]) for d in docs)
    assert len(rows) <= int(np.ceil(total / (SEQ + 1))) + 1 and padding < 0.1


def test_max_segments_bounds_the_examples_a_row_holds(tmp_path):
    """data.max_segments: best-fit rows of at most that many examples, each still whole and seen once (what cuDNN's
    packed layout is promised); pretraining's concatenated rows have no bound, so it is a one-line error there."""
    docs = _docs()
    rows = [b for b in packed_batches(docs, SEQ, 1, 0, 1, "best_fit", max_segments=2)]
    counts = [len(set(b["tokens_segment_ids"][0][b["tokens_segment_ids"][0] > 0].tolist())) for b in rows]
    assert max(counts) == 2 and max(len(set(b["tokens_segment_ids"][0].tolist()) - {0})
                                    for b in _all_rows(docs, "best_fit")) > 2  # unbounded rows hold more
    seen = sorted(b["tokens"][0][b["tokens_segment_ids"][0] == s].tolist()
                  for b in rows for s in set(b["tokens_segment_ids"][0].tolist()) - {0})
    assert seen == sorted(d["tokens"].tolist() for d in docs)

    from pretrain.config import load_config
    from pretrain.task import PretrainTask
    from sft.config import SFTConfig
    from sft.task import SFTTask
    from zoo.errors import UserError

    f = tmp_path / "c.yaml"
    f.write_text("model:\n  path: m\ndata:\n  path: d.jsonl\n  max_segments: 8\nmax_steps: 1\n")
    with pytest.raises(UserError, match="^data.max_segments: pretrain concatenates documents into rows with no bound"):
        PretrainTask(load_config(f))
    assert SFTTask(load_config(f, schema=SFTConfig)).row_segments == 8


def test_packed_loss_equals_examples_run_one_by_one():
    # Random weights of std 0.08 (sharp enough logits that the loss sums differ by example), norms at one, drawn
    # with NumPy: the model's own initializers compile a program per operation and shape (seconds).
    rng = np.random.RandomState(0)
    params = nest({path: (rng.normal(0, 0.08, spec.shape) if spec.init == "normal" else np.ones(spec.shape))
                   .astype(np.float32) for path, spec in sorted(param_specs(CFG).items())})
    assert {spec.init for spec in param_specs(CFG).values()} == {"normal", "ones"}
    docs = _docs()
    # jitted: every row has the same shape, so one compilation serves both packings (eagerly, each operation of
    # the forward compiled a program of its own)
    loss_sums = jax.jit(lambda p, mb: next_token_loss_sums(CFG, Weights(p), mb, jnp.float32, "none"))

    def sums(batches):
        s = n = 0.0
        for b in batches:
            out = loss_sums(params, TokenBatch.of({k: np.asarray(v) for k, v in to_model_batch(b).items()}))
            s, n = s + float(out.loss), n + float(out.count)
        return s, n

    packed = sums(_all_rows(docs, "best_fit"))
    alone = sums(_all_rows(docs, "none"))  # one example per row, padded
    expected = sum(int(d["loss_mask"][1:].sum()) for d in docs)
    assert packed[1] == alone[1] == expected  # exactly the trained targets count
    np.testing.assert_allclose(packed[0] / packed[1], alone[0] / alone[1], rtol=1e-5)


def test_long_examples_are_truncated_or_dropped_and_counted():
    docs = {0: {"tokens": np.arange(40, dtype=np.int32), "loss_mask": np.ones(40, bool)},
            1: {"tokens": np.arange(10, dtype=np.int32), "loss_mask": np.ones(10, bool)}}
    cut, long = fit_documents(docs, 32, "truncate")
    assert long == {0} and len(cut[0]["tokens"]) == 32 and len(cut[0]["loss_mask"]) == 32 and len(cut[1]["tokens"]) == 10
    kept, long = fit_documents(docs, 32, "drop")
    assert long == {0} and list(kept) == [1]
