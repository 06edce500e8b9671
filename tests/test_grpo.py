"""`grpo train` end to end on a tiny word-level model: sampling, learning, compilations, resume, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from tests.grpo_fixtures import (
    LOW,
    WORDS,
    build_setup,
    fixed_completions,
    read_metrics,
    run_cfg,
    run_overrides,
    trl_fixed_step,
)
from tests.processes import devices_env, ended, free_port, kill_after_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The module's tiny word-level model (transformers and zoo checkpoints), prompts and rewards."""
    return build_setup(tmp_path_factory.mktemp("grpo"))


def _learn(root: Path) -> tuple[str, ...]:
    """What learning_run, one_step_run, the masked run of test_truncated_completions_are_counted_and_optionally_masked
    and the held-out run set beside the module's settings, so that they share one step program: dr_grpo's loss
    and, beside low_words, a reward function named `reward` that applies to no completion (the total stays
    low_words')."""
    rewards = root / "rewards.py"
    return ("grpo.loss_type=dr_grpo",
            f"grpo.rewards=[{rewards}:low_words, {{function: {rewards}:applies_to_none, name: reward}}]")


@pytest.mark.slow
def test_sampler_logps_equal_a_teacher_forced_forward(setup):
    """What the sampler says each drawn token's log-probability is (softmax of the logits over the temperature,
    before top-k cuts them) is what the trainer computes on the laid-out rows, to 1e-5 in float32; with LoRA
    adapters too (run beside the base matmuls in both); and on the rows that share each group's prompt
    (grpo.share_prompt: one row per group, each completion reading the one copy of its prompt).
    Slow (about 91 s in a loaded 2-worker baseline): XLA compiles each of its model configurations (forward and
    gradients) on CPU."""
    import zoo
    from eval.generate import Sampler
    from eval.rollout import RolloutSpec, sample_group_completions
    from eval.rollout_batch import assemble, assemble_groups, completion_view
    from zoo.model.logps import batch_logps

    model = zoo.load(setup / "zoo", dtype=np.float32)
    # Doubled weights: more peaked distributions than the random init's, so top-k cuts something. (NumPy here and
    # below, the layouts jitted: on CPU each eager JAX op of a new shape compiles a program of its own.)
    cfg = model.cfg
    params = jax.tree.map(lambda x: np.asarray(x) * np.float32(2.0) if x.ndim > 1 else np.asarray(x),
                          model.param_dict())
    g, p, t = 3, 7, 9
    prompts = [[2, 5, 9], [3], [4, 4, 4, 4, 4, 4, 4], [7, 8]]
    tokens = np.zeros((len(prompts) * g, p), np.int32)
    valid = np.zeros_like(tokens, bool)
    for i, pr in enumerate(prompts):
        tokens[i * g:(i + 1) * g, :len(pr)], valid[i * g:(i + 1) * g, :len(pr)] = pr, True
    from zoo.lora.params import LoraConfig, init_lora, lora_scale
    from zoo.lora.weights import Weights

    lora_cfg = LoraConfig(rank=4, alpha=8.0, targets="all")
    lora = jax.jit(init_lora, static_argnums=(0, 1))(cfg, lora_cfg, jax.random.key(1))
    lora = jax.tree_util.tree_map_with_path(  # B = 0: nonzero B, so the adapters add something
        lambda path, x: np.asarray(x) + np.float32(0.3) * np.random.RandomState(len(str(path))).standard_normal(
            x.shape).astype(np.float32) if str(path[-1]) == "['b']" else np.asarray(x), lora)
    # The forward: one jitted program per layout. The sampler compiles one program per configuration: two
    # configurations, not three (top-k at a temperature and the adapters together, each still checked; and the
    # plain sampler).
    logps_of = jax.jit(batch_logps, static_argnums=0, static_argnames=("temperature", "max_segments"))
    lay_out, lay_out_groups = jax.jit(assemble), jax.jit(assemble_groups, static_argnums=7)
    for temperature, top_k, adapters in ((1.0, 0, None), (0.7, 5, lora)):
        spec = RolloutSpec(g, t, Sampler(temperature, top_k, 1.0), (1,))
        policy = Weights(params, adapters, None if adapters is None else lora_scale(lora_cfg))
        comp, logps, lengths = sample_group_completions(cfg, policy, tokens, valid, spec, jax.random.key(3))
        comp, logps, lengths = np.asarray(comp), np.asarray(logps), np.asarray(lengths)
        assert (lengths >= 1).all() and (lengths <= t).all()
        b = lay_out(tokens, valid, comp, lengths, {"sampler": logps}, {}, np.ones(len(tokens), bool))
        trainer = np.asarray(logps_of(cfg, policy, b, temperature=temperature)[0])
        w = np.asarray(b["weights"]) > 0
        assert w.sum() == lengths.sum()
        np.testing.assert_allclose(trainer[w], np.asarray(b["sampler"])[w], atol=1e-5)
        # The laid-out rows hold prompt + completion, the completion tokens being the targets weighed.
        r = 1
        n = valid[r].sum()
        assert list(np.asarray(b["inputs"])[r, :n]) == list(tokens[r, :n])
        assert list(np.asarray(b["targets"])[r][w[r]]) == list(comp[r, :lengths[r]])
        if adapters is None:
            continue  # the shared-prompt rows: with top-k and adapters
        trained = np.ones(len(tokens), bool)
        trained[4] = False  # a masked completion (grpo.mask_truncated) weighs nothing in either layout
        shared = lay_out_groups(tokens, valid, comp, lengths, {"sampler": logps}, {}, trained, g)
        assert shared["inputs"].shape == (len(prompts), p - 1 + g * (t + 1))  # one row per group
        per_pos = logps_of(cfg, policy, shared, temperature=temperature, max_segments=g + 1)[0]
        got = np.asarray(jax.jit(completion_view, static_argnums=(1, 2, 3))(per_pos, p, g, t))
        w = np.asarray(shared["weights"]) > 0
        assert w.sum() == lengths.sum() - lengths[4] and not w[4].any()
        np.testing.assert_allclose(got[w], logps[w], atol=1e-5)
        np.testing.assert_array_equal(np.asarray(shared["sampler"]), logps)
    # The G rows of a group share the prompt, not the draw.
    assert len({tuple(c) for c in comp[:g]}) > 1


@pytest.fixture(scope="module")
def learning_run(setup, tmp_path_factory):
    """16 steps of the module's configuration with _learn's settings (the step program one_step_run compiles),
    completions logged every 8, trained once, counting the traced programs at each rollout's start: the run
    test_grpo_raises_the_reward_without_recompiling checks and whose first two steps
    test_held_out_rewards_are_logged_and_leave_training_unchanged compares against. Returns (run folder,
    traces seen at each rollout's start)."""
    from jax._src.dispatch import JAXPR_TRACE_EVENT

    from grpo.task import GRPOTask
    from pretrain.loop import train

    traces: list[str] = []
    seen: list[int] = []

    def listen(event: str, duration: float, **kw) -> None:
        if event == JAXPR_TRACE_EVENT:
            traces.append(event)

    class Counting(GRPOTask):
        def rollout(self, *args, **kwargs):
            seen.append(len(traces))
            return super().rollout(*args, **kwargs)

    out = tmp_path_factory.mktemp("grpo_learning") / "run"
    cfg = run_cfg(setup, out, *_learn(setup), "max_steps=16", "grpo.log_completions_every=8")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        train(cfg, task=Counting(cfg), progress=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return out, seen


@pytest.mark.slow
def test_grpo_raises_the_reward_without_recompiling(learning_run):
    """A synthetic verifiable task (the share of completion words from half the vocabulary, about 0.5 at random):
    the mean reward rises by at least 0.3 within 100 steps (here 16, at the module's learning rate under dr_grpo's
    loss (_learn; the default dapo's runs: tests/test_grpo_tools.py): the last 5 steps' mean is about 1 from step 10
    on), and no step after the first compiles anything.
    Slow: a whole training run through the loop."""
    out, seen = learning_run
    assert seen[2] > seen[1] or seen[1] > 0  # the listener hears traces at all
    assert seen[-1] == seen[2], f"traces at each step's start: {seen[:4]} ... {seen[-1]}: a later step recompiled"
    rewards = [m["reward"] for m in read_metrics(out)]
    assert len(rewards) == 16
    first, last = rewards[0], np.mean(rewards[-5:])  # the starting policy's batch; the last steps'
    assert 0.35 < first < 0.65  # about half the words, at random
    assert last - first >= 0.3, (first, last)
    logged = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert {x["step"] for x in logged} == {8, 16} and len(logged) == 2 * 16
    assert set(logged[0]) >= {"step", "prompt", "completion", "completion_ids", "rewards"}
    assert set(logged[0]["rewards"]) == {"low_words", "reward"}


# Two micro-batches, the policy's old log-probabilities (num_iterations 2) and a reference (beta), plain SGD (updates
# proportional to the gradients): the run that the unshared layout, the two-process run and the killed and resumed
# run must follow.
# grpo.loss_type=grpo: the one end-to-end run of that loss (the losses' values: tests/test_grpo_losses.py).
ACCUM = ("max_steps=3", "grad_accum=2", "grpo.num_iterations=2", "grpo.beta=0.1", "optimizer.name=sgd",
         "optimizer.learning_rate=0.5", "grpo.log_completions_every=1", "grpo.loss_type=grpo")


@pytest.fixture(scope="module")
def accum_run(setup, tmp_path_factory):
    """ACCUM trained once in this process on one device, with grpo.share_prompt at its default (on): the run
    test_shared_prompt_rows_train_as_one_row_per_completion, test_two_processes_follow_the_one_process_run and
    test_kill_9_and_resume_is_bit_identical compare against. Returns (run folder, whether the task laid groups
    out as one row each)."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    out = tmp_path_factory.mktemp("grpo_accum") / "one"
    cfg = run_cfg(setup, out, *ACCUM)
    task = GRPOTask(cfg)
    train(cfg, task=task, progress=False)
    return out, task.grouped


@pytest.mark.slow
def test_shared_prompt_rows_train_as_one_row_per_completion(setup, accum_run, tmp_path):
    """grpo.share_prompt (the default) lays each group out in one row, its prompt once: the same run with it off
    (one prompt + completion row each, TRL's layout) logs the same rewards, loss, grad norm, entropy, KL and clip
    ratios within 1e-5 at every step, with the policy's old log-probabilities (num_iterations 2), a reference
    (beta) and two micro-batches. Slow (about 20 s): two runs (one shared with the two-process test), each
    compiling its step."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    on_out, grouped = accum_run
    assert grouped is True
    cfg = run_cfg(setup, tmp_path / "off", *ACCUM, "grpo.share_prompt=false")
    task = GRPOTask(cfg)
    train(cfg, task=task, progress=False)
    assert task.grouped is False
    logs = {True: read_metrics(on_out), False: read_metrics(tmp_path / "off")}
    keys = ("reward", "loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean", "completions/mean_length")
    assert len(logs[True]) == len(logs[False]) == 3
    assert logs[True][-1]["kl"] > 0  # the reference was used
    for on, off in zip(logs[True], logs[False]):
        for k in keys:
            np.testing.assert_allclose(on[k], off[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_kill_9_and_resume_is_bit_identical(setup, accum_run, tmp_path, capsys):
    """`grpo train` SIGKILLed after its step-2 checkpoint and rerun (for step 3) ends with the weights, metrics and
    logged completions of the run that never stopped (sampling keys come from the seed and the step; the data position
    is checkpointed; completions.jsonl is trimmed to the restored step): ACCUM (two micro-batches, mu = 2, beta > 0
    with the starting checkpoint as the reference, kept so across the resume), whose run never stopped is the
    module's accum_run (checkpointing changes nothing it trains or logs); the resumed run says its reference is the
    starting model. LoRA's resume: tests/test_grpo_tools.py's
    test_kill_and_resume_with_tools_is_bit_identical; LoRA with beta > 0 (the base as the reference):
    test_rloo_and_reinforce_pp_steps_use_their_advantages_and_log_trls_names[reinforce_pp_baseline].
    Slow (slow lane): `grpo train` runs in a subprocess (killed) and again in this process (resumed), each loading
    the programs accum_run compiled (the session's compilation cache)."""
    import os
    import signal
    import subprocess
    import sys

    import zoo
    from grpo.cli import main

    whole, _ = accum_run
    out = tmp_path / "killed"
    args = ["train", *run_overrides(setup, out, *ACCUM, "checkpoint.every=2")]
    proc = subprocess.run([sys.executable, "-c", kill_after_checkpoint("grpo.cli"), "2", *args],
                          capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert (out / "checkpoints" / "2").is_dir() and not (out / "final").exists()
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    said = [x for x in printed.splitlines() if x.startswith("grpo.reference:")]
    assert len(said) == 1 and f"the starting model (model.path {setup / 'zoo'})" in said[0], said
    assert "Resuming from step 2" in printed
    a = zoo.load(whole / "final", dtype=np.float32).param_dict()
    b = zoo.load(out / "final", dtype=np.float32).param_dict()
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    skip = {"step_time", "tokens_per_sec", "rollout_tokens_per_sec", "train_tokens_per_sec", "generation_share"}
    ma = [{k: v for k, v in m.items() if k not in skip} for m in read_metrics(whole)]
    mb = [{k: v for k, v in m.items() if k not in skip} for m in read_metrics(out)]
    assert ma == mb and len(ma) == 3
    assert ma[-1]["kl"] > 0  # the reference (the starting checkpoint) was used
    ca = (whole / "completions.jsonl").read_text()
    assert ca == (out / "completions.jsonl").read_text() and len(ca.splitlines()) == 3 * 16


def _strict(line: str) -> dict:
    """A JSON line parsed as strict readers do: NaN and Infinity are errors, not numbers."""
    def reject(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=reject)


# One step of _learn's settings (dr_grpo's loss, the reward function named `reward` beside low_words), beta 0,
# completions logged: what test_records_and_metrics_keep_trls_names_and_strict_json reads and
# test_truncated_completions_are_counted_and_optionally_masked's unmasked run, whose seed draws completions both cut
# and ended.
ONE_STEP = ("max_steps=1", "grpo.log_completions_every=1", "seed=1")


@pytest.fixture(scope="module")
def one_step_run(setup, tmp_path_factory):
    """ONE_STEP trained once; returns its run folder."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    out = tmp_path_factory.mktemp("grpo_one_step") / "run"
    cfg = run_cfg(setup, out, *_learn(setup), *ONE_STEP)
    train(cfg, task=GRPOTask(cfg), progress=False)
    return out


def test_records_and_metrics_keep_trls_names_and_strict_json(one_step_run):
    """One step at beta 0 with a reward function named `reward` that applies to no completion: completions.jsonl
    keeps the weighted total as `reward` and each function's value under `rewards` (a function named like a
    record field overwrites nothing); metrics.jsonl names the per-function metrics `rewards/{fn}/mean|std`, as
    TRL's GRPOTrainer, logs no `kl` without a reference (TRL neither), and writes the all-None function's mean as
    null, never NaN (strict JSON)."""
    (line,) = (one_step_run / "metrics.jsonl").read_text().splitlines()
    m = _strict(line)
    rows = [_strict(x) for x in (one_step_run / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["rewards"]["reward"] is None for r in rows)
    low = [r["rewards"]["low_words"] for r in rows]
    assert [r["reward"] for r in rows] == low and len(set(low)) > 1  # the total: low_words alone (None drops out)
    assert "kl" not in m and not [k for k in m if k.startswith("reward/")]
    assert m["rewards/low_words/mean"] == pytest.approx(np.mean(low))
    assert m["rewards/low_words/std"] == pytest.approx(np.std(low, ddof=1))
    assert m["rewards/reward/mean"] is None and m["reward"] == pytest.approx(np.mean(low))
    assert m["reward_std"] == pytest.approx(np.std(low, ddof=1))  # TRL 1.16's: the batch's, not the groups' mean


def test_completion_records_keep_each_functions_value_in_its_own_namespace():
    """completions.jsonl's record: functions named `reward`, `advantage`, `step`, `prompt` leave the record's own
    fields (the weighted total, the advantage, the step, the prompt) as they are."""
    from grpo.completions_log import completion_records

    names = ["reward", "advantage", "step", "prompt"]
    per_fn = np.array([[0.0, 1.0, 2.0, np.nan], [1.0, np.nan, 0.5, 0.25]])
    recs = completion_records(7, ["p1", "p2"], ["a", "b"], [[1], [2, 3]], names, per_fn, np.array([-0.78, 3.0]),
                              np.array([0.5, -0.5]))
    assert recs[0] == {"step": 7, "prompt": "p1", "completion": "a", "completion_ids": [1], "reward": -0.78,
                       "advantage": 0.5, "rewards": {"reward": 0.0, "advantage": 1.0, "step": 2.0, "prompt": None}}
    assert recs[1]["reward"] == 3.0 and recs[1]["rewards"] == {"reward": 1.0, "advantage": None, "step": 0.5,
                                                               "prompt": 0.25}


def test_a_reward_that_raises_is_a_clean_error(setup, tmp_path, capsys):
    from grpo.cli import main

    # The module's first 4 prompts (answers ok, boom, ok, ok): the first batch holds them all at _cfg's shapes
    # (4 prompts x 4 completions), so the run samples with the program the module's other runs compiled.
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(x + "\n" for x in (setup / "prompts.jsonl").read_text().splitlines()[:4]))
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={data}",
            "data.seq_len=8", "batch_size=16", "grpo.num_generations=4", "grpo.max_completion_length=6",
            f"grpo.rewards=[{setup / 'rewards.py'}:picky]", "max_steps=1", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert "picky" in err and "ZeroDivisionError" in err, err
    line = int(re.search(r"prompts.jsonl, line (\d+)", err).group(1))  # the first row that raises, named
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    assert [r["answer"] for r in rows] == ["ok", "boom", "ok", "ok"] and line == 2
    assert not (tmp_path / "run").exists()  # the fresh run's folder is not left half-written


@pytest.mark.parametrize("override, message", [
    ("batch_size=10", "multiple of grpo.num_generations=4"),
    ("grpo.num_generations=1", "at least 2"),
    ("grpo.rewards=[no_such_verifier]", "no_such_verifier"),
    ("grpo.advantage=ppo", "choose one of group, rloo, reinforce_pp, reinforce_pp_baseline"),
    ("grpo.reward_clip_range=[1,-1]", "grpo.reward_clip_range must be [low, high] with low < high, got [1, -1]"),
    ("grpo.reward_clip_range=[-1,1]", "grpo.reward_clip_range is read by grpo.advantage rloo"),
    ("grpo.normalize_advantages=true", "grpo.normalize_advantages is RLOO's (grpo.advantage: rloo)"),
    ("grpo.loss_type=vespo grpo.importance_sampling_correction=true",
     "set grpo.importance_sampling_mode to token_truncate or token_mask, not sequence_mask"),
    ("grpo.importance_sampling_correction=true grpo.importance_sampling_clip_min=4",
     "grpo.importance_sampling_clip_min (4.0) is above grpo.importance_sampling_clip_max (3.0)"),
])
def test_config_errors_are_clear(setup, tmp_path, capsys, override, message):
    from grpo.cli import main

    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}",
            f"data.path={setup / 'prompts.jsonl'}", "data.seq_len=8", "batch_size=16", "grpo.num_generations=4",
            f"grpo.rewards=[{setup / 'rewards.py'}:low_words]", "max_steps=1", f"output_dir={tmp_path / 'run'}",
            *override.split()]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "final").exists()


def test_a_verifier_without_its_answer_column_stops_before_step_one(setup, tmp_path, capsys):
    """exact_match on rows whose answers are in `target`, not `answer`: rather than scoring None everywhere and
    learning nothing, `grpo train` stops before step 1 with one line naming the column it needs, the columns the
    rows have and the option that maps them, and writes no run folder."""
    from grpo.cli import main

    data = tmp_path / "targets.jsonl"
    data.write_text("".join(json.dumps({"prompt": w, "target": w}) + "\n" for w in WORDS))
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={data}",
            "data.seq_len=8", "batch_size=8", "grpo.num_generations=4", "grpo.max_completion_length=2",
            "grpo.rewards=[exact_match]", "max_steps=1", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "exact_match needs the column 'answer'" in err and "besides the prompt are target" in err, err
    assert "{function: exact_match, answer_field: target}" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_processes_follow_the_one_process_run(setup, accum_run, tmp_path):
    """2 processes x 2 CPU devices (gloo; fsdp over 4 devices; each process feeding its own rows, sampling its
    shard of the batch, every process scoring the whole batch) draw the completions the one-device run draws
    and train like it, with two micro-batches, old log-probabilities and a reference (ACCUM). Slow (slow lane):
    two `grpo train` processes (gloo) each import, compile and train."""
    import subprocess
    import sys

    one_out, _ = accum_run
    args = ["train", *run_overrides(setup, tmp_path / "two", *ACCUM)]
    env = devices_env(2)
    port = free_port()
    run = "import sys; from grpo.cli import main; sys.exit(main(sys.argv[1:]))"
    procs = [subprocess.Popen([sys.executable, "-c", run, *args, "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    for code, _, err in ended(procs):
        assert code == 0, err[-3000:]
    one, two = read_metrics(one_out), read_metrics(tmp_path / "two")
    assert len(two) == 3 and [m["reward"] for m in two] == [m["reward"] for m in one]
    for k in ("loss", "grad_norm", "entropy", "kl"):
        np.testing.assert_allclose([m[k] for m in two], [m[k] for m in one], rtol=1e-5, atol=1e-6, err_msg=k)
    logged = [(json.loads(x)["completion"]) for x in (tmp_path / "two" / "completions.jsonl").read_text().splitlines()]
    assert logged == [json.loads(x)["completion"] for x in (one_out / "completions.jsonl").read_text().splitlines()]


def test_the_example_config_reads_and_its_prompts_fit(smollm2_tokenizer):
    """examples/grpo/grpo_arith.yaml (the demo's GRPO task) is a valid config, and SmolLM2's chat template renders
    every one of its prompts within its data.seq_len."""
    from transformers import AutoTokenizer

    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask
    from pretrain.config import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "examples" / "grpo" / "grpo_arith.yaml",
                      [f"data.path={root / 'demo' / 'data' / 'grpo_train.jsonl'}"], GRPOConfig)
    task = GRPOTask(cfg)
    rows = task.load(cfg.data.path, cfg)
    made = task.documents(rows, AutoTokenizer.from_pretrained(str(smollm2_tokenizer)), cfg.data.path, False)
    docs = made.docs
    assert made.bad == 0 and not made.too_long and len(docs) == len(rows)
    assert max(len(d["tokens"]) for d in docs.values()) <= cfg.data.seq_len


def test_a_bad_prompt_row_names_its_line(setup, tmp_path, capsys):
    from grpo.cli import main

    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["red blue", 7, "gold"] * 8))
    args = ["train", f"model.path={setup / 'zoo'}", f"model.tokenizer={setup / 'tok'}", f"data.path={data}",
            "data.seq_len=8", "batch_size=8", "grpo.num_generations=4",
            f"grpo.rewards=[{setup / 'rewards.py'}:low_words]", "max_steps=1", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl, line 2" in err and "'prompt' is not a string or a list of messages (got int)" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_truncated_completions_are_counted_and_optionally_masked(setup, one_step_run, tmp_path):
    """Completions that hit grpo.max_completion_length are counted (completions/clipped_ratio) and, with
    grpo.mask_truncated, weigh nothing. Checked through dr_grpo's loss at step 1 (ratio 1, beta 0), computed here
    from the logged completions: -sum over trained completions of advantage x length / (batch x max length).
    Unmasked: the module's one_step_run (its second reward function applies to no completion: the total is
    low_words')."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    # max_completion_length: about a quarter of the completions end before it (EOS is 1 of 18 ids); the module's
    # own length, so the runs sample with the program the other runs compiled
    n = 6
    for mask in (False, True):
        out = one_step_run if not mask else tmp_path / "masked"
        if mask:
            cfg = run_cfg(setup, out, *_learn(setup), *ONE_STEP, f"grpo.max_completion_length={n}",
                       "grpo.mask_truncated=true")
            train(cfg, task=GRPOTask(cfg), progress=False)
        (m,) = read_metrics(out)
        rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
        cut = [len(r["completion_ids"]) == n and r["completion_ids"][-1] != 1 for r in rows]  # id 1: </s>
        assert 0 < sum(cut) < len(rows)  # both kinds in the batch (a fixed seed)
        assert m["completions/clipped_ratio"] == pytest.approx(sum(cut) / len(rows))
        trained = [not c or not mask for c in cut]
        want = -sum(r["advantage"] * len(r["completion_ids"]) * t for r, t in zip(rows, trained)) / (len(rows) * n)
        assert m["loss"] == pytest.approx(want, abs=1e-6), mask


@pytest.mark.slow
def test_full_fine_tuning_kl_is_to_the_starting_checkpoint_by_default_and_after_a_resume(setup, accum_run, tmp_path):
    """Full fine-tuning with grpo.beta > 0 against a reference checkpoint (the starting model): the k3 KL grows
    once the policy moves. Without grpo.reference the reference is the starting checkpoint (TRL's default): the
    module's accum_run (ACCUM, no grpo.reference) logs what the same run with the checkpoint named logs, KL
    included. That it says so in its log and stays so across a resume (not the resumed weights, against which
    step 3's KL would be 0 again): test_kill_9_and_resume_is_bit_identical, whose run resumed after step 2 logs what
    accum_run logs. The KL is 0 while the policy is the reference (a step of one update: ACCUM's steps average two):
    test_rloo_and_reinforce_pp_steps_use_their_advantages_and_log_trls_names[rloo] (full fine-tuning, the default
    reference). Slow (about 3 s quiet): a run (accum_run's programs)."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    cfg = run_cfg(setup, tmp_path / "named", *ACCUM, f"grpo.reference={setup / 'zoo'}")
    train(cfg, task=GRPOTask(cfg), progress=False)
    named = read_metrics(tmp_path / "named")
    kl = [m["kl"] for m in named]
    assert min(kl) > 1e-4, kl  # each step averages two updates, the second after the policy moved
    skip = {"step_time", "tokens_per_sec", "rollout_tokens_per_sec", "train_tokens_per_sec", "generation_share"}
    assert [{k: v for k, v in m.items() if k not in skip} for m in read_metrics(accum_run[0])] == \
        [{k: v for k, v in m.items() if k not in skip} for m in named]


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp_baseline"])
def test_rloo_and_reinforce_pp_steps_use_their_advantages_and_log_trls_names(setup, tmp_path, advantage):
    """Two steps of each estimator with a KL to the starting model (beta > 0, put into the reward): RLOO's logged
    advantages are the leave-one-out ones of the logged rewards less beta x each completion's summed KL
    (checked through the zero-KL identity at step 1, where the policy is the reference, below), REINFORCE++'s
    are whitened per token (mean 0 over the batch's completion tokens); both log TRL RLOOTrainer's names (kl,
    reward_std, frac_reward_zero_std, clip ratios) and a finite loss. REINFORCE++ trains LoRA adapters, whose
    reference is the base: its KL is 0 at step 1 (fresh adapters add nothing) and not after."""
    from grpo.task import GRPOTask
    from pretrain.loop import train

    lora = ["lora.rank=4", "lora.alpha=8"] if advantage == "reinforce_pp_baseline" else []
    cfg = run_cfg(setup, tmp_path / "kl", "max_steps=2", "grpo.log_completions_every=1", f"grpo.advantage={advantage}",
               "grpo.beta=0.05", *lora)
    train(cfg, task=GRPOTask(cfg), progress=False)
    logged = [_strict(x) for x in (tmp_path / "kl" / "completions.jsonl").read_text().splitlines()]
    m0, m = [_strict(x) for x in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    rows0, rows = ([x for x in logged if x["step"] == s] for s in (1, 2))
    # step 2: the policy has left the reference (step 1's KL is 0)
    assert {"kl", "reward_std", "frac_reward_zero_std", "clip_ratio/region_mean", "entropy"} <= set(m)
    assert np.isfinite(m["loss"]) and m["kl"] != 0 and abs(m0["kl"]) < 1e-6
    r = np.array([x["reward"] for x in rows]).reshape(-1, 4)
    adv = np.array([x["advantage"] for x in rows]).reshape(-1, 4)
    if advantage == "rloo":
        # step 1, a KL of 0: the advantages are exactly leave-one-out's, 4/3 of the deviation
        adv0 = np.array([x["advantage"] for x in rows0]).reshape(-1, 4)
        r0 = np.array([x["reward"] for x in rows0]).reshape(-1, 4)
        np.testing.assert_allclose(adv0, (r0 - r0.mean(1, keepdims=True)) * 4 / 3, rtol=1e-5, atol=1e-6)
        assert not np.allclose(adv, (r - r.mean(1, keepdims=True)) * 4 / 3, atol=1e-4)  # the KL moved them
        assert m0["reward_std"] == pytest.approx(r0.std(ddof=1), rel=1e-5)  # the batch's, not the groups' mean
    else:
        assert np.abs(adv).max() > 0.1 and "kl" in m


@pytest.mark.slow
def test_rloo_step_one_equals_trl_rloo_trainer(setup, tmp_path, monkeypatch):
    """One SGD step of `grpo train` with grpo.advantage rloo against one step of TRL 1.16's own RLOOTrainer on the
    same transformers model, both sides given the same completions (a fixed function of each prompt's tokens and
    its place in the group, ending with EOS after 1 to 4 tokens), two prompts of four completions in two
    micro-batches: loss, grad_norm, reward, reward_std, frac_reward_zero_std, the clip ratios and every weight's
    change within 1e-5."""
    from trl import RLOOConfig, RLOOTrainer

    import eval.rollout
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.trl_oracles import SGD_STEP_ONE, assert_same_change, assert_same_metrics, exported_change

    g, vocab = 4, 18
    completions, fixed_sampler, score = fixed_completions(tmp_path, g, vocab)
    prompts = [{"prompt": "red blue green"}, {"prompt": "gold pink gray"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))

    class FixedCompletions(RLOOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields):
            return completions(prompt_ids)

    want, trl_change = trl_fixed_step(FixedCompletions, RLOOConfig, setup, tmp_path / "trl", score, prompts, g)
    monkeypatch.setattr(eval.rollout, "sample_group_completions", fixed_sampler)
    cfg = run_cfg(setup, tmp_path / "ours", *SGD_STEP_ONE, "max_steps=1", "batch_size=8", "grad_accum=2",
               "grpo.max_completion_length=5", "grpo.advantage=rloo", f"data.path={tmp_path / 'p.jsonl'}",
               f"grpo.rewards=[{tmp_path / 'score.py'}:id_score]", "data.seq_len=3")
    train(cfg, task=GRPOTask(cfg), progress=False)
    got = read_metrics(tmp_path / "ours")[0]
    assert_same_metrics(got, want, ("loss", "grad_norm", "reward", "reward_std", "frac_reward_zero_std",
                                    "clip_ratio/region_mean"))
    assert_same_change(exported_change(tmp_path / "ours" / "final", setup / "hf", tmp_path / "exp"), trl_change)


@pytest.mark.slow
def test_held_out_rewards_are_logged_and_leave_training_unchanged(setup, learning_run, tmp_path):
    """data.eval_path every eval_every steps: TRL's eval names, sampled and greedy. Training draws and learns
    exactly as without the evaluation (its samples have their own key stream: its 2 steps log what the first 2
    of the module's learning run, without evaluation, log); the last step's greedy reward is
    low_words of the final model's greedy completions of the held-out prompts, made by `zoo generate`'s decoder
    (an independent path: eval/generate.py)."""
    import zoo
    from eval.generate import greedy_batch
    from grpo.task import GRPOTask
    from pretrain.loop import train
    from tests.run_files import write_jsonl

    held = [{"prompt": " ".join(WORDS[i:i + 3])} for i in range(0, 15, 3)]  # 5 prompts: a padded last batch
    write_jsonl(tmp_path / "held.jsonl", held)
    cfg = run_cfg(setup, tmp_path / "eval", *_learn(setup), "max_steps=2", f"data.eval_path={tmp_path / 'held.jsonl'}",
               "eval_every=1")
    train(cfg, task=GRPOTask(cfg), progress=False)
    timing = ("step_time", "tokens_per_sec", "rollout_tokens_per_sec", "train_tokens_per_sec", "generation_share")
    with_eval = read_metrics(tmp_path / "eval")
    assert len(with_eval) == 2
    for a, b in zip(read_metrics(learning_run[0])[:2], with_eval):
        assert {k: v for k, v in a.items() if k not in timing} == \
            {k: v for k, v in b.items() if k not in timing and not k.startswith("eval_")}
    last = with_eval[-1]
    for prefix in ("eval_", "eval_greedy_"):
        assert {f"{prefix}reward", f"{prefix}reward_std", f"{prefix}rewards/low_words/mean",
                f"{prefix}completions/mean_length", f"{prefix}completions/clipped_ratio"} <= set(last)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(setup / "tok"))
    model = zoo.load(tmp_path / "eval" / "final", dtype=np.float32)
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in held]
    outs = greedy_batch(model, prompts, 6, {tok.eos_token_id})
    texts = tok.batch_decode(outs, skip_special_tokens=True)
    want = [sum(w in LOW for w in t.split()) / max(len(o), 1) for t, o in zip(texts, outs)]
    assert last["eval_greedy_reward"] == pytest.approx(float(np.mean(want)), abs=1e-6)
    assert last["eval_greedy_completions/mean_length"] == pytest.approx(np.mean([len(o) for o in outs]))
