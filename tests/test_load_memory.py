"""Loading a checkpoint costs its weights in memory, not twice its weights (zoo.checkpoints.readers.load_stored_params)."""

import json
import subprocess
import sys
import textwrap

import pytest

from tests.quant_fixtures import write_random_checkpoint

# A Llama of 64M float32 parameters (256 MB): large enough that a second copy of the weights would stand
# far above the runtime's own noise in RSS.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 512,
          "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}

PROBE = textwrap.dedent("""
    import gc, json, sys
    import jax, numpy as np
    import zoo
    from zoo.model.sharding import make_mesh

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    mesh = make_mesh(devices=jax.devices()[:1])
    jax.numpy.zeros(1).block_until_ready()
    import orbax.checkpoint  # noqa: F401  (its import is not the load's cost)
    before, peak_before = status("VmRSS"), status("VmHWM")
    params = zoo.load_params(sys.argv[1], mesh)
    jax.block_until_ready(params)
    leaves = jax.tree.leaves(params)
    print(json.dumps({"weights": sum(x.nbytes for x in leaves), "largest": max(x.nbytes for x in leaves),
                      "resident": status("VmRSS") - before, "peak": status("VmHWM") - peak_before}))
""")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_holds_the_weights_once(tmp_path):
    """Slow (about 56 s in a loaded 2-worker baseline): commands in subprocesses, each importing and compiling."""
    ckpt = tmp_path / "ckpt"
    write_random_checkpoint(CONFIG, ckpt)  # as `zoo init` writes it, its weights drawn in half the time
    out = subprocess.run([sys.executable, "-c", PROBE, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    assert m["weights"] > 200 * mib
    # Restoring everything at once left the restore's staging copies resident (1.8x the weights) and
    # peaked near 2x; in groups of at most the largest parameter, the load holds the weights plus at most
    # one group's staging copies.
    assert m["resident"] <= 1.1 * m["weights"] + 48 * mib, m
    assert m["peak"] <= m["weights"] + 1.5 * m["largest"] + 64 * mib, m


def test_restore_groups_are_bounded_ordered_and_complete():
    import jax
    import numpy as np

    from zoo.checkpoints.readers import restore_groups

    mib = 2**20
    sizes = {"a": 10, "b": 30, "c": 5, "d": 30, "e": 1, "f": 29}  # MiB of float32
    abstract = {k: jax.ShapeDtypeStruct((v * mib // 4,), np.float32) for k, v in sizes.items()}
    groups = restore_groups(abstract, floor=0)
    assert [p for g in groups for p in g] == list(sizes)
    assert all(sum(sizes[p] for p in g) <= 30 for g in groups)
    assert groups == [["a"], ["b"], ["c"], ["d"], ["e", "f"]]
    assert restore_groups(abstract, floor=200 * mib) == [list(sizes)]


@pytest.mark.slow
def test_a_small_model_restores_in_one_call_and_groups_restore_the_same_values(tmp_path, monkeypatch):
    """Slow (about 39 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    import numpy as np
    import orbax.checkpoint.experimental.v1 as ocp

    import zoo.checkpoints.readers as zc
    from zoo.model.params import flatten

    ckpt = tmp_path / "ckpt"
    write_random_checkpoint({**CONFIG, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}, ckpt)
    calls = []
    load = ocp.load
    monkeypatch.setattr(ocp, "load", lambda *a, **k: calls.append(1) or load(*a, **k))
    whole = flatten(zc.load_stored_params(ckpt))
    assert len(calls) == 1  # one restore (each costs Orbax set-up, and a gc pass between groups)
    real_groups = zc.restore_groups
    # 200 KiB: three groups, most of several parameters (of this model's 417 KiB), rather than one a parameter
    # (8): a collection follows each group, and each full gc pass costs more the larger the heap.
    monkeypatch.setattr(zc, "restore_groups", lambda a: real_groups(a, floor=200 << 10))
    grouped = flatten(zc.load_stored_params(ckpt))
    assert len(calls) > 2
    assert grouped.keys() == whole.keys()
    for k in whole:
        np.testing.assert_array_equal(np.asarray(grouped[k]), np.asarray(whole[k]))
