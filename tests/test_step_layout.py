"""Each task's train step compiles from its declared batch layout alone: no data, no weights, no devices' memory."""

import jax
import jax.numpy as jnp
import optax
import pytest

from zoo.model.config import ModelConfig
from zoo.model.params import init_params

TINY = ModelConfig(family="llama", vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=16)
ACCUM, MICRO, SEQ = 2, 2, 16


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
    if name == "dpo":
        from dpo.config import DPOConfig
        from dpo.task import DPOTask

        return DPOTask(load_config(None, common + ["dpo.reference=precomputed"], DPOConfig))
    from grpo.config import GRPOConfig
    from grpo.task import GRPOTask

    return GRPOTask(load_config(None, common + ["grpo.rewards=[final_number]", "grpo.num_generations=2",
                                                "grpo.max_completion_length=4", "grpo.num_iterations=2",
                                                "grpo.beta=0.1"], GRPOConfig))


@pytest.mark.parametrize("name", ["pretrain", "sft", "dpo", "grpo"])
def test_train_step_compiles_from_the_task_layout_alone(name):
    from pretrain.jit_step import make_step

    task = _task(name)
    tx = optax.adamw(1e-3)
    params = jax.eval_shape(lambda: init_params(TINY, jax.random.key(0)))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32)}
    batch = task.batch_layout(ACCUM, MICRO, SEQ)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch))
    step, evaluate = make_step(TINY, tx, jnp.float32, task=task)
    assert step.lower(state, batch).compile() is not None
    _, metrics = jax.eval_shape(step.jitted, state, batch)
    assert metrics["loss"].shape == () and set(metrics) >= {"loss", "grad_norm", "task"}
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), batch)
    assert evaluate.lower(params, one).compile() is not None


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
