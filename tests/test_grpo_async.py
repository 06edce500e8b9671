"""Asynchronous GRPO rollouts (grpo.rollout: async, grpo/pipeline.py) on the tiny word-level task: staleness 0 is
the synchronous run bit for bit, staleness 1 samples a step ahead and says so, the pipeline's own rules, two
processes (issue 64 item 6: async, and episodes with tools) and the errors."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.grpo_fixtures import build_setup, read_metrics, run_cfg

# Timing and the async metrics differ between the modes by design; everything else is compared.
TIMING = {"step_time", "tokens_per_sec", "rollout_tokens_per_sec", "train_tokens_per_sec", "generation_share", "mfu",
          "sample/staleness_mean", "sample/staleness_max", "sample/dropped_stale_total", "perf/rollout_wait_s"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The module's tiny word-level model, prompts and rewards (tests/grpo_fixtures.py)."""
    return build_setup(tmp_path_factory.mktemp("grpo_async"))


def _train(setup, out, *overrides):
    from grpo.task import GRPOTask
    from pretrain.loop import train

    cfg = run_cfg(setup, out, "max_steps=3", *overrides)
    train(cfg, task=GRPOTask(cfg), progress=False)
    return read_metrics(out)


def _params(out):
    import zoo

    return jax.tree.leaves(zoo.load(out / "final", dtype=np.float32).param_dict())


@pytest.mark.slow
def test_staleness_0_is_the_synchronous_run_bit_for_bit_and_1_samples_a_step_ahead(setup, tmp_path):
    """grpo.rollout async with grpo.max_staleness 0 (the rollout thread samples each batch once the weights of its
    step are published) logs every metric of the synchronous run and ends with its parameters, bit for bit, with
    a KL reference and num_iterations 2 (old log-probabilities) in play; with max_staleness 1 the second and later
    batches come from the policy a step before (staleness 1 logged), the first from the starting one, and the
    run's rewards differ from step 2 on (sampled by another policy), none dropped.
    Slow (slow lane): three 3-step runs of one compiled step."""
    common = ("grpo.beta=0.05", "grpo.num_iterations=2")
    sync = _train(setup, tmp_path / "sync", *common)
    zero = _train(setup, tmp_path / "zero", *common, "grpo.rollout=async", "grpo.max_staleness=0")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(zero) == strip(sync) and len(sync) == 3
    assert [r["sample/staleness_max"] for r in zero] == [0, 0, 0]
    for x, y in zip(_params(tmp_path / "sync"), _params(tmp_path / "zero"), strict=True):
        np.testing.assert_array_equal(x, y)

    one = _train(setup, tmp_path / "one", *common, "grpo.rollout=async", "grpo.max_staleness=1",
                 "grpo.importance_sampling_correction=true")
    assert [r["sample/staleness_max"] for r in one] == [0, 1, 1]
    assert [r["sample/dropped_stale_total"] for r in one] == [0, 0, 0]
    assert one[0]["reward"] == sync[0]["reward"]  # batch 0: the starting policy, as sync's
    assert one[1]["reward"] != sync[1]["reward"]  # batch 1: sampled by the starting policy, not step 1's
    assert all(r["perf/rollout_wait_s"] >= 0 for r in one)
    # The sampler correction weighs what the stale policy sampled: the gap between its log-probabilities and the
    # trainer's is float noise at staleness 0 (step 1), a policy's step apart after.
    gap = [r["sampling/sampling_logp_difference/max"] for r in one]
    assert gap[0] < 1e-4 < gap[1] and gap[2] > 1e-4, gap


@pytest.mark.slow
def test_two_processes_follow_the_one_process_async_run(setup, tmp_path):
    """2 processes x 2 CPU devices with grpo.rollout async and max_staleness 1 (each process completing its requests
    in order on the trainer's thread: grpo/pipeline.py's inline mode) sample the batches, with the versions, of
    the one-process run (its rollout thread) and train like it; grpo.rollout_devices 1 on a process of 2 devices
    (the engine on the second, training on the first) with max_staleness 0 is the synchronous run; on 4 devices it
    leaves 3, which do not divide the batch: one line naming the key, exit 2.
    Slow (slow lane): a one-process run here and three `grpo train` subprocesses."""
    import subprocess
    import sys

    from tests.grpo_fixtures import run_overrides
    from tests.processes import devices_env, ended, free_port

    one = _train(setup, tmp_path / "one", "grpo.rollout=async", "grpo.max_staleness=1")
    run = "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["train", *run_overrides(setup, tmp_path / "two", "max_steps=3", "grpo.rollout=async",
                                    "grpo.max_staleness=1")]
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", run, *args, "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(2))
             for i in range(2)]
    apart = subprocess.Popen([sys.executable, "-c", run, "train", *run_overrides(
        setup, tmp_path / "apart", "max_steps=3", "grpo.rollout=async", "grpo.max_staleness=0",
        "grpo.rollout_devices=1")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(2))
    uneven = subprocess.Popen([sys.executable, "-c", run, "train", *run_overrides(  # 3 devices left for 16 rows
        setup, tmp_path / "uneven", "grpo.rollout=async", "grpo.rollout_devices=1")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(4))
    *done, (code, _, err) = ended([*procs, apart, uneven])
    for code_, _, err_ in done:
        assert code_ == 0, err_[-3000:]
    assert code == 2 and err.strip().splitlines() == [
        "error: batch_size/grad_accum = 16 sequences must divide over data x fsdp = 3 devices (the 4 less "
        "grpo.rollout_devices=1)"], err[-2000:]
    two = read_metrics(tmp_path / "two")
    assert [m["reward"] for m in two] == [m["reward"] for m in one] and len(two) == 3
    assert [m["sample/staleness_max"] for m in two] == [0, 1, 1]
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose([m[k] for m in two], [m[k] for m in one], rtol=1e-5, atol=1e-6, err_msg=k)
    sync = _train(setup, tmp_path / "sync")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(read_metrics(tmp_path / "apart")) == strip(sync)


@pytest.mark.parametrize("override, message", [
    ("grpo.max_staleness=-1", "config key 'grpo.max_staleness' must be"),
    ("grpo.rollout=later", "config key 'grpo.rollout'"),
])
def test_bad_async_settings_are_one_line(tmp_path, capsys, override, message):
    """A staleness below 0, an unknown mode: one line naming the key, exit 2, before anything is read."""
    from grpo.cli import main
    from tests.grpo_fixtures import run_overrides

    assert main(["train", *run_overrides(tmp_path, tmp_path / "run", "grpo.rollout=async", override)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.slow
def test_rollout_devices_that_leave_none_to_train_are_one_line_before_step_one(setup, tmp_path, capsys):
    """grpo.rollout_devices taking every device of the process: one line naming the key, exit 2, before the model
    loads (no metrics written). Slow (slow lane): the module's setup (a model converted)."""
    from grpo.cli import main
    from tests.grpo_fixtures import run_overrides

    out = tmp_path / "run"
    assert main(["train", *run_overrides(setup, out, "grpo.rollout=async", "grpo.rollout_devices=1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "grpo.rollout_devices=1 leaves none of the 1 devices to train on" in err, err
    assert len(err.splitlines()) == 1 and not (out / "metrics.jsonl").exists()


@pytest.mark.slow
def test_episodes_with_tools_on_two_processes_and_async_follow_the_one_process_run(tiny_lm, tmp_path):
    """Episodes with a tool called every turn (a model that ends a turn after a few sampled tokens: the turns and
    lengths vary): 2 `grpo train` processes (1 CPU device each; each runs the batch's episodes on the weights gathered whole) log the
    rewards, episodes and losses of the one-process run, and grpo.rollout async with max_staleness 0 (the episodes
    on the rollout thread, their tools on threads of their own) is that run bit for bit.
    Slow (slow lane): three runs in this process, two `grpo train` subprocesses."""
    import subprocess
    import sys

    from grpo.cli import main
    from tests.grpo_tools_model import ending_model
    from tests.processes import devices_env, ended, free_port
    from tests.run_files import write_jsonl

    root = ending_model(tiny_lm, tmp_path / "model", 1.0)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": w}]} for w in ("a", "b", "c", "d")])
    template = Path(__file__).parent / "data" / "chat_templates" / "qwen2.5.jinja"

    def args(out, *more):  # test_grpo_tools.py's runs' shapes and optimizer: the programs they compiled
        return ["train", f"model.path={root / 'zoo'}", f"model.tokenizer={tiny_lm / 'tok'}",
                f"data.path={tmp_path / 'p.jsonl'}", f"data.chat_template={template}", "data.seq_len=160",
                "batch_size=4", "grpo.num_generations=2", "grpo.max_completion_length=120",
                f"grpo.tools=[{root / 'tools.py'}:add]", f"grpo.tool_parser={root / 'tools.py'}:always_add",
                f"grpo.rewards=[{root / 'tools.py'}:one]", "grpo.max_turns=3", "lora.rank=2",
                "grpo.log_completions_every=1", "max_steps=2", "log_every=1", "optimizer.learning_rate=3e-2",
                "schedule.name=constant", "checkpoint.every=1000", f"output_dir={out}", *more]

    port = free_port()
    run = "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", run, *args(tmp_path / "two"), "--coordinator",
                               f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(1))
             for i in range(2)]
    assert main(args(tmp_path / "one")) == 0
    assert main(args(tmp_path / "zero", "grpo.rollout=async", "grpo.max_staleness=0")) == 0
    for code, _, err in ended(procs):
        assert code == 0, err[-3000:]
    one, two, zero = (read_metrics(tmp_path / n) for n in ("one", "two", "zero"))
    assert sum(m["tool_calls"] for m in one) > 2 and len(one) == 2
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(zero) == strip(one)
    assert [m["reward"] for m in two] == [m["reward"] for m in one]
    for k in ("num_turns", "tool_calls", "completions/mean_length"):
        assert [m[k] for m in two] == [m[k] for m in one], k
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose([m[k] for m in two], [m[k] for m in one], rtol=1e-5, atol=1e-6, err_msg=k)
    logged = {n: [json.loads(x)["completion"] for x in (tmp_path / n / "completions.jsonl").read_text().splitlines()]
              for n in ("one", "two", "zero")}
    assert logged["two"] == logged["one"] == logged["zero"]
