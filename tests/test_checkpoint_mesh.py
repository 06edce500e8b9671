"""A checkpoint restored onto another mesh (pretrain/checkpoints.py): written on 8 devices with FSDP, resumed on 4
devices (FSDP over 4, and a mesh of data x tensor parallelism without FSDP), the loss at the next step the same
as the run that never moved. One process throughout (its data position restores); only its devices change."""

import json

import numpy as np
import pytest

from tests.processes import devices_env, forked_codes
from tests.tiny_lm import copy_tiny_lm

# Runs `pretrain.cli main` once per JSON argument list in ARGV[2:], on the devices this process simulates
# (ARGV[1] of them); exits with the first non-zero code. ["copy", A, B] copies run folder A to B.
RUNS = r"""
import json, shutil, sys
import jax
from pretrain.cli import main
assert len(jax.devices()) == int(sys.argv[1]), jax.devices()
for args in map(json.loads, sys.argv[2:]):
    if args[0] == "copy":
        shutil.copytree(args[1], args[2])
        continue
    code = main(args)
    if code:
        sys.exit(code)
"""


def _runs(tmp_path, *batches: tuple[int, list[list[str]]]) -> list[str]:
    """Each (devices, runs) of ``batches`` in a process of that many simulated devices (children forked from one
    interpreter that imports once: tests/processes.py forked); their stdouts."""
    jobs = [{"script": RUNS, "argv": [str(devices), *map(json.dumps, runs)], "env": devices_env(devices),
             "out": str(tmp_path / f"out{i}"), "err": str(tmp_path / f"err{i}")}
            for i, (devices, runs) in enumerate(batches)]
    for i, code in enumerate(forked_codes(jobs)):
        assert code == 0, (tmp_path / f"err{i}").read_text()[-3000:]
    return [(tmp_path / f"out{i}").read_text() for i in range(len(batches))]


def _log(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_checkpoint_of_8_devices_resumes_on_4_and_onto_tensor_parallelism(tiny_lm, tmp_path):
    """8 devices (FSDP over 8): a run of 3 steps, and the same run stopped at step 2 (its checkpoint; a constant
    learning rate, so that the stop changes no step before it). On 4
    devices, two copies of the stopped run resume: FSDP over 4, and data 2 x tensor 2. Each restores step 2 and
    its step 3 has the 3-step run's loss (relative 1e-5: the meshes add up in other orders); steps 1-2 are the
    8-device run's lines, kept. Slow: two processes of simulated devices (forked from one interpreter that
    imports once: tests/processes.py forked), four runs."""
    copy_tiny_lm(tiny_lm, tmp_path)
    rng = np.random.RandomState(0)
    words = "the a cat dog sat ran on under mat log".split()
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(64):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.randint(5, 20)))}) + "\n")

    def args(out, steps, *more):
        return ["train", f"model.path={tmp_path / 'zoo'}", f"model.tokenizer={tmp_path / 'tok'}",
                f"data.path={tmp_path / 'data.jsonl'}", "data.seq_len=16", "batch_size=8", "log_every=1",
                "checkpoint.every=2", "schedule.name=constant", f"max_steps={steps}", f"output_dir={out}", *more]

    # the whole run checkpoints its last step only (each save of 8 devices' state costs about a second)
    stopped = tmp_path / "fsdp4"
    _, said = _runs(tmp_path, (8, [args(tmp_path / "whole", 3, "checkpoint.every=100"), args(stopped, 2),
                                   ["copy", str(stopped), str(tmp_path / "tensor")]]),
                    (4, [args(stopped, 3), args(tmp_path / "tensor", 3, "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=2")]))
    assert said.count("Resuming from step 2") == 2, said
    whole = _log(tmp_path / "whole")
    for name in ("fsdp4", "tensor"):
        log = _log(tmp_path / name)
        assert [r["step"] for r in log] == [1, 2, 3], name
        assert [r["loss"] for r in log[:2]] == [r["loss"] for r in whole[:2]]
        np.testing.assert_allclose(log[2]["loss"], whole[2]["loss"], rtol=1e-5, err_msg=name)
        assert log[2]["tokens_seen"] == whole[2]["tokens_seen"]
