"""Each task's train step compiles from its declared batch layout alone: no data, no weights, no devices' memory.

Every task a command can run is here: pretraining, SFT, GKD (offline and with sampled completions), DPO, KTO, the
reward model and GRPO."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest

from zoo.model.config import ModelConfig
from zoo.model.params import init_params
from zoo.model.vision_config import VisionConfig

TINY = ModelConfig(family="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=16)
ACCUM, MICRO, SEQ = 2, 2, 16
# SFT with images: TINY with SmolVLM's SigLIP tower (28 px images in 7 px patches: 16 patches, 4 image tokens)
TINY_VLM = dataclasses.replace(TINY, vision=VisionConfig(arch="SmolVLMForConditionalGeneration", hidden_size=32,
                                                        intermediate_size=64, num_layers=2, num_heads=2, patch_size=7,
                                                        image_size=28, image_token_id=255))


def _task(name: str):
    from pretrain.config import load_config

    common = ["model.path=none", "data.path=none", "max_steps=1"]
    if name == "pretrain":
        from pretrain.task import PretrainTask

        return PretrainTask(load_config(None, common))
    if name == "sft":
        from sft.config import SFTConfig
        from sft.task import SFTTask

        return SFTTask(load_config(None, common, SFTConfig))
    if name == "sft_images":
        from sft.config import SFTConfig
        from sft.task import SFTTask

        task = SFTTask(load_config(None, common + ["data.max_patches=32"], SFTConfig))  # two images a row
        task.vision = TINY_VLM.vision  # what prepare reads from the model
        return task
    if name == "dpo":
        from dpo.config import DPOConfig
        from dpo.task import DPOTask

        return DPOTask(load_config(None, common + ["dpo.reference=precomputed"], DPOConfig))
    if name == "dpo_images":
        from dpo.config import DPOConfig
        from dpo.task import DPOTask

        task = DPOTask(load_config(None, common + ["dpo.reference=precomputed", "data.max_patches=32"], DPOConfig))
        task.vision = TINY_VLM.vision  # what prepare reads from the model
        return task
    if name == "kto":
        from dpo.config import DPOConfig
        from dpo.kto import KTOTask

        return KTOTask(load_config(None, common + ["dpo.loss_type=kto", "dpo.reference=precomputed"], DPOConfig))
    if name == "reward":
        from rm.config import RMConfig
        from rm.task import RewardTask

        return RewardTask(load_config(None, common, RMConfig))
    if name in ("gkd", "gkd_online"):
        from sft.config import SFTConfig
        from sft.gkd import GKDTask, OnlineGKDTask

        sampled = ["distill.lmbda=0.5", "distill.max_new_tokens=4"] if name == "gkd_online" else ["distill.lmbda=0"]
        cfg = load_config(None, common + ["distill.teacher=t", *sampled], SFTConfig)
        task = (OnlineGKDTask if name == "gkd_online" else GKDTask)(cfg)
        task.teacher_mcfg = TINY  # what prepare reads from distill.teacher: a teacher of the student's shape
        return task
    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask

    return GRPOTask(load_config(None, common + ["grpo.rewards=[final_number]", "grpo.num_generations=2",
                                                "grpo.max_completion_length=4", "grpo.num_iterations=2",
                                                "grpo.beta=0.1"], GRPOConfig))


TASKS = ["pretrain", "sft", "sft_images", "gkd", "gkd_online", "dpo", "dpo_images", "kto", "reward", "grpo"]


@functools.cache
def _lowered(name: str):
    """(the train step lowered from ``name``'s batch layout alone, its evaluation step lowered for one micro-batch,
    the step's metrics as jax.eval_shape gives them): once per task, for the fast check and the compiling one."""
    from pretrain.jit_step import make_step

    task = _task(name)
    # a reward model's score head; a vision-language model's tower for SFT and DPO with images
    mcfg = (dataclasses.replace(TINY, num_labels=1) if name == "reward" else
            TINY_VLM if name.endswith("_images") else TINY)
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(lambda: init_params(mcfg, jax.random.key(0)))
    # GKD's frozen input is its teacher (here one of the student's shape); the other tasks have none here
    teacher = {"frozen_inputs": params} if name.startswith("gkd") else {}
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    batch = task.batch_layout(ACCUM, MICRO, SEQ)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch))
    if name.endswith("_images"):  # data.max_patches patches a row, flattened like the token fields
        assert batch.vision.patches.shape == (ACCUM, MICRO, 32 * TINY_VLM.vision.patch_dim)
    step, evaluate = make_step(mcfg, tx, jnp.float32, task=task)
    lowered = step.lower(state, batch, **teacher)  # its outputs' shapes: no second trace (jax.eval_shape)
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
    return lowered, evaluate.lower(params, one, **teacher), lowered.out_info[1]


@pytest.mark.parametrize("name", TASKS)
def test_train_step_lowers_from_the_task_layout_alone(name):
    """The fast lane's check: each task's train and evaluation steps trace and lower from its declared layout
    (shapes and dtypes only) and the step reports its loss; XLA's compilation of them is the slow test below."""
    _, _, metrics = _lowered(name)
    assert metrics["loss"].shape == () and set(metrics) >= {"loss", "grad_norm", "task"}


# The compile check's XLA options: LLVM's optimization level 0 for the machine code (conftest.py sets 1). Nothing
# here runs, so the code's speed is moot; every HLO pass (shape and layout checks, SPMD partitioning, fusion, buffer
# assignment) still runs, as XLA's whole compilation does: the part a layout the task declared wrongly would fail.
# LLVM's optimization of the tiny programs' machine code was most of their compile time (dpo_images: 26 s against
# 3 s on a loaded machine).
COMPILE_OPTIONS = {"xla_backend_optimization_level": 0}


@pytest.mark.slow
@pytest.mark.parametrize("name", TASKS)
def test_train_step_compiles_from_the_task_layout_alone(name):
    """Slow (an XLA compilation of a train step and an evaluation step a task, 0.5-3 s each): the lowered steps of
    the test above compile to executables (COMPILE_OPTIONS)."""
    step, evaluate, _ = _lowered(name)
    assert step.compile(COMPILE_OPTIONS) is not None
    assert evaluate.compile(COMPILE_OPTIONS) is not None


def test_every_task_a_command_runs_is_covered():
    """The list above is every task class the training commands pick from (a new task joins it)."""
    from dpo.cli import dpo_tasks
    from grpo.cli import grpo_tasks
    from rm.cli import reward_tasks
    from sft.cli import sft_tasks

    covered = {type(_task(name)) for name in TASKS}
    commands = {*dpo_tasks(), *grpo_tasks(), *reward_tasks(), *sft_tasks()}
    assert commands <= covered, commands - covered


@pytest.mark.parametrize("accum", [1, ACCUM])
def test_bfloat16_state_keeps_its_dtypes_through_a_step(accum):
    """bfloat16 parameters: every leaf of the state after a step has the dtype it had (Adam's moments too), so
    step 2 runs step 1's program on the donated buffers (a gradient divided by the float32 token count came out
    float32 and took Adam's moments with it)."""
    from pretrain.jit_step import make_step

    task = _task("pretrain")
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(lambda: init_params(TINY, jax.random.key(0), jnp.bfloat16))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    step, _ = make_step(TINY, tx, jnp.bfloat16, task=task)
    after, _ = jax.eval_shape(step.jitted, state, task.batch_layout(accum, MICRO, SEQ))
    dtypes = lambda tree: [(jax.tree_util.keystr(k), x.dtype) for k, x in jax.tree_util.tree_leaves_with_path(tree)]
    assert dtypes(after) == dtypes(state)
    assert {x.dtype for x in jax.tree.leaves(state["params"])} == {jnp.dtype(jnp.bfloat16)}
