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


# Beside the module's settings in every run below: a KL reference and num_iterations 2 (old log-probabilities).
COMMON = ("grpo.beta=0.05", "grpo.num_iterations=2")
ONE_STEP_AHEAD = ("grpo.rollout=async", "grpo.max_staleness=1", "grpo.importance_sampling_correction=true")


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    """The module's 3-step runs, once: synchronous (``sync``), async with max_staleness 0 (``zero``), async one step
    ahead with the sampler correction (``one``). Returns {name: (folder, metrics)}."""
    root = tmp_path_factory.mktemp("grpo_async_runs")
    overrides = {"sync": (), "zero": ("grpo.rollout=async", "grpo.max_staleness=0"), "one": ONE_STEP_AHEAD}
    return {name: (root / name, _train(setup, root / name, *COMMON, *more)) for name, more in overrides.items()}


def _strip(rows):
    """Metrics without the timings and the async-only keys."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
def test_staleness_0_is_the_synchronous_run_bit_for_bit_and_1_samples_a_step_ahead(runs):
    """grpo.rollout async with grpo.max_staleness 0 (each batch requested at its own step, with that step's
    weights) logs every metric of the synchronous run and ends with its parameters, bit for bit, with a KL
    reference and num_iterations 2 in play; with max_staleness 1 the second and later batches come from the policy
    a step before (staleness 1 logged), the first from the starting one, the rewards differ from step 2 on, none
    is dropped, and the sampler correction sees the policies' gap.
    Slow (slow lane): the module's three 3-step runs of one compiled step."""
    (sync_out, sync), (zero_out, zero), (_, one) = runs["sync"], runs["zero"], runs["one"]
    assert _strip(zero) == _strip(sync) and len(sync) == 3
    assert [r["sample/staleness_max"] for r in zero] == [0, 0, 0]
    for x, y in zip(_params(sync_out), _params(zero_out), strict=True):
        np.testing.assert_array_equal(x, y)
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
def test_two_processes_follow_the_one_process_async_run(setup, runs, tmp_path):
    """2 processes x 2 CPU devices with grpo.rollout async and max_staleness 1 (each process completing its requests
    in order on the trainer's thread: grpo/pipeline.py's inline mode) sample the batches, with the versions, of
    the one-process run (its rollout thread) and train like it; grpo.rollout_devices 1 on a process of 2 devices
    (the engine on the second, training on the first) with max_staleness 0 is the synchronous run; on 4 devices it
    leaves 3, which do not divide the batch: one line naming the key, exit 2.
    Slow (slow lane): four `grpo train` subprocesses and a one-process run."""
    import subprocess
    import sys

    from tests.grpo_fixtures import run_overrides
    from tests.processes import devices_env, ended, free_port

    run = "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))"
    port = free_port()

    def launch(out, *more, devices=2, process=None):
        where = [] if process is None else ["--coordinator", f"localhost:{port}", "--num-processes", "2",
                                            "--process-id", str(process)]
        return subprocess.Popen([sys.executable, "-c", run, "train",
                                 *run_overrides(setup, tmp_path / out, "max_steps=3", *COMMON, *more), *where],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=devices_env(devices))

    # Without the sampler correction: its weights read the sampler's log-probabilities, which each process's engine
    # (of its own rows) computes to float noise apart from the one-process engine's.
    ahead = ONE_STEP_AHEAD[:-1]
    procs = [launch("two", *ahead, process=i) for i in range(2)]
    apart = launch("apart", "grpo.rollout=async", "grpo.max_staleness=0", "grpo.rollout_devices=1")
    uneven = launch("uneven", "grpo.rollout=async", "grpo.rollout_devices=1", devices=4)  # 3 left for 16 rows
    *done, (code, _, err) = ended([*procs, apart, uneven])
    for code_, _, err_ in done:
        assert code_ == 0, err_[-3000:]
    assert code == 2 and err.strip().splitlines() == [
        "error: batch_size/grad_accum = 16 sequences must divide over data x fsdp = 3 devices (the 4 less "
        "grpo.rollout_devices=1)"], err[-2000:]
    one = _train(setup, tmp_path / "one", *COMMON, *ahead)
    two = read_metrics(tmp_path / "two")
    assert [m["reward"] for m in two] == [m["reward"] for m in one] and len(two) == 3
    assert [m["sample/staleness_max"] for m in two] == [0, 1, 1]
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose([m[k] for m in two], [m[k] for m in one], rtol=1e-5, atol=1e-6, err_msg=k)
    assert _strip(read_metrics(tmp_path / "apart")) == _strip(runs["sync"][1])


@pytest.mark.parametrize("inline", [False, True])
def test_the_pipeline_requests_ahead_and_drops_a_batch_staler_than_allowed(inline):
    """grpo/pipeline.py alone, on its thread and inline (several processes), with a completion function that
    records the weights it sampled with: max_staleness 1 keeps two batches requested, each with the weights of the
    step that requested it (the first two with the starting weights); a batch older than max_staleness (which the
    pipeline's own requests never are: one submitted by hand) is dropped, counted and replaced; nothing is
    requested past the run's end; an error in completing is raised where the trainer takes."""
    from grpo.pipeline import Pipeline

    seen: list[tuple[int, str]] = []

    def complete(weights, rows, index):
        seen.append((index, weights))
        if rows == "boom":
            raise ValueError("reward function failed")
        return f"{rows}@{weights}"

    rows = iter([f"r{i}" for i in range(10)])
    p = Pipeline(complete, 1, lambda: next(rows), 0, 4, lambda w: w + "'", inline)
    got = [p.take(f"w{step}", step) for step in range(2)]
    assert [(t.made, t.staleness, t.dropped) for t in got] == [("r0@w0'", 0, 0), ("r1@w0'", 1, 0)]
    p.thread.submit(99, "old", 0, "w0'")  # behind request 2 (made at step 1): staleness 2 at step 2
    p.outstanding += 1
    t2 = p.take("w2", 2)
    assert (t2.made, t2.staleness, t2.dropped) == ("r2@w1'", 1, 0)
    t3 = p.take("w3", 3)  # the last step: request 99 (staleness 3) dropped, replaced by request 3 (w3)
    assert (t3.made, t3.index, t3.staleness, t3.dropped) == ("r3@w3'", 3, 0, 1)
    assert seen == [(0, "w0'"), (1, "w0'"), (2, "w1'"), (99, "w0'"), (3, "w3'")]
    assert p.next_index == 4  # nothing requested past the run's 4 steps
    p.close()

    boom = Pipeline(complete, 0, lambda: "boom", 0, 2, lambda w: w, inline)
    with pytest.raises(ValueError, match="reward function failed"):
        boom.take("w0", 0)


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
    assert _strip(zero) == _strip(one)
    assert [m["reward"] for m in two] == [m["reward"] for m in one]
    for k in ("num_turns", "tool_calls", "completions/mean_length"):
        assert [m[k] for m in two] == [m[k] for m in one], k
    for k in ("loss", "grad_norm", "entropy"):
        np.testing.assert_allclose([m[k] for m in two], [m[k] for m in one], rtol=1e-5, atol=1e-6, err_msg=k)
    logged = {n: [json.loads(x)["completion"] for x in (tmp_path / n / "completions.jsonl").read_text().splitlines()]
              for n in ("one", "two", "zero")}
    assert logged["two"] == logged["one"] == logged["zero"]
