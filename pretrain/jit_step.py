"""The jitted, sharded train step (gradient accumulation, one optimizer update) and the train state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, NamedTuple, Protocol, TypeAlias, TypeVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jax.typing import DTypeLike

from pretrain.batch import B, TokenBatch
from pretrain.metrics import LossOutput
from pretrain.task import FrozenInputs, PretrainTask, Task, Totals
from zoo.compiled.compiler import compile_lowered
from zoo.lora.weights import LoraRun, Weights
from zoo.memory import release_free_memory
from zoo.model.config import ModelConfig
from zoo.model.sharding import mesh_context

# The train state: {"params": the trained weights, "opt_state": the optimizer's state, "step": updates made}.
TrainState: TypeAlias = dict[str, Any]
# A pytree of shardings laid out as the values it shards (the train state, a params dict, a task's frozen inputs).
Shardings: TypeAlias = "jax.sharding.Sharding | dict[str, Shardings] | list[Shardings] | tuple[Shardings, ...] | None"

B_contra = TypeVar("B_contra", bound=TokenBatch, contravariant=True)  # the batch class a step reads


class TrainStep(Protocol[B_contra]):
    """:func:`make_step`'s train step: ``(state, batch, frozen=None, *, frozen_inputs=None)`` -> (the state after
    one update on the global ``batch``, the step's metrics: ``loss``, ``grad_norm``, ``target_tokens``,
    ``padding`` and the task's finished metrics under ``task``)."""

    def __call__(self, state: TrainState, batch: B_contra, frozen: dict[str, Any] | None = None, *,
                 frozen_inputs: FrozenInputs = None) -> tuple[TrainState, dict[str, Any]]: ...

    def lower(self, state: TrainState, batch: B_contra, frozen: dict[str, Any] | None = None, *,
              frozen_inputs: FrozenInputs = None) -> jax.stages.Lowered:
        """The step lowered for these arguments (arrays, or ``jax.ShapeDtypeStruct`` s with shardings)."""
        ...


class EvalStep(Protocol[B_contra]):
    """:func:`make_step`'s evaluation: ``(params, batch, frozen=None, frozen_inputs=None)`` -> the task's
    :class:`LossOutput` of ``batch``."""

    def __call__(self, params: dict[str, Any], batch: B_contra, frozen: dict[str, Any] | None = None,
                 frozen_inputs: FrozenInputs = None) -> LossOutput: ...


class StepFunctions(NamedTuple, Generic[B]):
    """What :func:`make_step` returns, a task's train step and evaluation (it unpacks as ``(train, evaluate)``)."""

    train: TrainStep[B]
    evaluate: EvalStep[B]


def make_step(mcfg: ModelConfig, tx: optax.GradientTransformation, compute: DTypeLike, remat: str = "none",
              state_sharding: Shardings = None, batch_sharding: NamedSharding | None = None,
              task: Task[B] | None = None, lora: LoraRun | None = None, frozen_sharding: Shardings = None,
              frozen_inputs_sharding: Shardings = None, freeze: frozenset[str] = frozenset()) -> StepFunctions[B]:
    """(train step, eval fn), a :class:`StepFunctions`: gradient accumulation over the leading micro-batch axis,
    one optimizer update.

    The task (default: pretraining's next-token loss) computes the loss sums of
    a micro-batch; the step differentiates them with respect to ``state["params"]``
    only. With ``lora`` (a :class:`zoo.lora.weights.LoraRun`: the adapters'
    scale, LoRA dropout) those are LoRA adapters and the base weights come
    as the third argument, ``frozen``, which is never differentiated: no base
    gradient and no optimizer state exist. With ``state_sharding`` and
    ``batch_sharding`` the step is compiled once for exactly those layouts (its
    outputs keep the state's layout, so the second call does not recompile).

    LoRA dropout is applied in the train step, never in eval. Its masks come
    from a key derived from ``lora.seed``, the state's step and the
    micro-batch index alone, so a resumed run draws exactly the masks the
    uninterrupted run would have.

    The task's frozen inputs (what its ``prepare`` returned: a reference
    model, say; sharded as ``frozen_inputs_sharding``) come as the keyword
    argument ``frozen_inputs`` and reach ``loss_sums`` under that name, never
    differentiated. The task returns a :class:`pretrain.metrics.LossOutput`:
    its outputs over the micro-batches are combined (each metric by its own
    reduction) and reported, finished, under ``metrics["task"]``. Evaluation
    returns the task's :class:`LossOutput` of the eval batch.

    The task's ``batch_totals(batch)``, computed once on the whole global batch
    (every micro-batch, every device; in evaluation, the eval batch), reaches
    each micro-batch's ``loss_sums`` as ``totals``: counts a micro-batch cannot
    see by itself (e.g. the global batch's answer tokens, to weigh a token
    mean into per-example loss sums exactly whatever ``grad_accum`` and the
    mesh). A task with ``reads_step`` gets the state's step (the number of
    updates made so far) as ``step`` in the train step; evaluation passes None.
    """
    run_task: Task[Any] = task or PretrainTask()
    loss_of = _loss_of(run_task, mcfg, compute, remat, lora, freeze)
    step = _train_step(run_task, tx, loss_of, None if lora is None else lora.dropout_seed)

    def evaluate(params: dict[str, Any], batch: TokenBatch, frozen: dict[str, Any] | None = None,
                 frozen_inputs: FrozenInputs = None) -> LossOutput:
        return loss_of(params, batch, frozen, frozen_inputs, totals=run_task.batch_totals(batch))

    if state_sharding is None:
        return StepFunctions(compile_then_trim(jax.jit(step, donate_argnums=0)), compile_then_trim(jax.jit(evaluate)))
    assert batch_sharding is not None, "a sharded step's batch_sharding"
    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    mesh = batch_sharding.mesh
    platform = mesh.devices.flat[0].platform  # the mesh's, not the default backend's
    step_jit = compile_then_trim(jax.jit(
        step, donate_argnums=0,
        in_shardings=(state_sharding, batch_sharding, frozen_sharding, frozen_inputs_sharding),
        out_shardings=(state_sharding, replicated)), platform, mesh)
    return StepFunctions(ShardedStep(step_jit),
                         compile_then_trim(jax.jit(evaluate, out_shardings=replicated), platform, mesh))


def _loss_of(task: Task[Any], mcfg: ModelConfig, compute: DTypeLike, remat: str,
             lora: LoraRun | None, freeze: frozenset[str] = frozenset()) -> Callable[..., LossOutput]:
    """The task's loss of a micro-batch as a function of the trained weights: the whole model's, or with
    ``lora`` LoRA's adapters on the frozen base (the third argument), dropout drawn from ``rng``; the task
    gets them as one :class:`zoo.lora.weights.Weights`. The whole model's parts ``freeze`` names
    (``model.freeze``) are behind ``stop_gradient``: the backward pass neither computes nor stores a gradient
    there (the optimizer gives them zero updates, pretrain/optim.py)."""

    def loss_of(trainable: dict[str, Any], mb: TokenBatch, frozen: Any,
                frozen_inputs: FrozenInputs = None, rng: jax.Array | None = None, totals: Totals = None,
                step_number: jax.Array | None = None) -> LossOutput:
        if freeze and lora is None:
            trainable = {k: jax.lax.stop_gradient(v) if k in freeze else v for k, v in trainable.items()}
        weights = Weights.of(trainable, frozen, lora, rng)
        return task.loss_sums(mcfg, weights, mb, compute, remat, frozen_inputs=frozen_inputs, totals=totals,
                              step=step_number)

    return loss_of


def _train_step(task: Task[Any], tx: optax.GradientTransformation, loss_of: Callable[..., LossOutput],
                dropout_seed: int | None) -> Callable[..., tuple[TrainState, dict[str, Any]]]:
    """The train step (not yet jitted): gradients of ``loss_of`` accumulated over the batch's micro-batches,
    divided by the global batch's count, one optimizer update; LoRA dropout keys from ``dropout_seed`` (None: no
    dropout)."""

    def objective(*args: Any) -> tuple[jax.Array, LossOutput]:
        out = loss_of(*args)
        return out.objective, out

    def dropout_rngs(step_number: jax.Array, micro_batches: int) -> jax.Array | None:
        """One dropout key per micro-batch of this step ([micro_batches]), or None without dropout."""
        if dropout_seed is None:
            return None
        key = jax.random.fold_in(jax.random.key(dropout_seed), step_number)
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(micro_batches))

    def step(state: TrainState, batch: TokenBatch, frozen: dict[str, Any] | None = None,
             frozen_inputs: FrozenInputs = None) -> tuple[TrainState, dict[str, Any]]:
        grad_fn = jax.value_and_grad(objective, has_aux=True)
        totals = task.batch_totals(batch)  # over the global batch, not one micro-batch
        number = state["step"] if task.reads_step else None

        def micro(carry: tuple[dict[str, Any], LossOutput], xs: Any) -> tuple[tuple[dict[str, Any], LossOutput],
                                                                                None]:
            g_acc, out_acc = carry
            mb, rng = xs
            (_, out), g = grad_fn(state["params"], mb, frozen, frozen_inputs, rng, totals, number)
            return (jax.tree.map(jnp.add, g_acc, g), out_acc.combine(out)), None

        micro_batches = jax.tree.leaves(batch)[0].shape[0]
        rngs = dropout_rngs(state["step"], micro_batches)
        if micro_batches == 1:
            # No accumulation: skip the scan, whose gradient carry costs full-size copies.
            (_, out), g = grad_fn(state["params"], jax.tree.map(lambda x: x[0], batch), frozen, frozen_inputs,
                                  None if rngs is None else rngs[0], totals, number)
        else:
            zeros = jax.tree.map(jnp.zeros_like, state["params"])
            shapes = jax.eval_shape(lambda: loss_of(state["params"], jax.tree.map(lambda x: x[0], batch), frozen,
                                                    frozen_inputs, None if rngs is None else rngs[0], totals,
                                                    number))
            out0 = LossOutput.empty(shapes)
            (g, out), _ = jax.lax.scan(micro, (zeros, out0), (batch, rngs))
        n = jnp.maximum(out.count, 1.0)
        # Divided in each leaf's own dtype, which the gradient keeps (else Adam's moments would follow float32 and
        # step 2 need another program). A bfloat16 leaf divided by the float32 count is promoted to a float32 copy
        # of the whole leaf, even cast back at once: XLA keeps it where the gradient changes layout after the layer
        # scan (896 MiB a chip on Llama-3.1-8B). The count rounded to bfloat16 moves the scale by at most 2**-8;
        # float32 leaves divide exactly as before.
        g = jax.tree.map(lambda x: x / n.astype(x.dtype), g)
        updates, opt_state = tx.update(g, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": out.loss / n, "grad_norm": optax.tree.norm(g), "target_tokens": n,
                   "padding": 1.0 - (batch.segment_ids != 0).mean(), "task": out.means(n)}
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics

    return step


class ShardedStep:
    """The sharded train step: ``step(state, batch, frozen=None, *, frozen_inputs=None)`` (jit's in_shardings name
    every positional argument, so the optional ones are filled in); :meth:`lower` lowers it without running."""

    def __init__(self, jitted: CompileThenTrim):
        self.jitted = jitted

    def __call__(self, state: TrainState, batch: TokenBatch, frozen: dict[str, Any] | None = None, *,
                 frozen_inputs: FrozenInputs = None) -> tuple[TrainState, dict[str, Any]]:
        out: tuple[TrainState, dict[str, Any]] = self.jitted(state, batch, frozen, frozen_inputs)
        return out

    def lower(self, state: TrainState, batch: TokenBatch, frozen: dict[str, Any] | None = None, *,
              frozen_inputs: FrozenInputs = None) -> jax.stages.Lowered:
        """The step lowered for these arguments (``jax.ShapeDtypeStruct`` s with shardings: no data, no devices'
        memory); ``zoo.compiled.compiler.compile_lowered(lowered, platform)`` compiles it with the platform's options."""
        return self.jitted.lower(state, batch, frozen, frozen_inputs)


class CompileThenTrim:
    """``jitted``, but each new argument signature is compiled ahead of its first run (on the CPU with
    :data:`zoo.compiled.compiler.CPU_COMPILER_OPTIONS`) and the compiler's freed memory handed back to the system
    (:func:`zoo.memory.release_free_memory`) before the step's own buffers are allocated; :meth:`lower` lowers
    it (from ``jax.ShapeDtypeStruct`` s too: a step compiled without data).

    XLA frees its working memory after compiling, but glibc keeps it in the
    heap; left there, it sits under the first step's peak, and the
    process's peak RSS is the compile's garbage plus the step's
    temporaries (0.27 GB on SmolLM2-135M's train step). Later calls with the
    same shapes, dtypes and shardings run the executable compiled then.

    With ``mesh`` it is traced under ``jax.set_mesh(mesh)``: the attention kernel's choice (:mod:`zoo.kernels.choice`)
    sees the program's platform, and splash attention shards itself over the mesh (:mod:`zoo.kernels.splash`).
    """

    def __init__(self, jitted: jax.stages.Wrapped, platform: str | None = None,
                 mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None):
        self.jitted = jitted
        self.platform = platform
        self.mesh = mesh
        self.compiled: dict[str, Any] = {}

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The jitted function lowered for these arguments (arrays or ``jax.ShapeDtypeStruct`` s), under ``mesh``
        (:func:`zoo.model.sharding.mesh_context`): activations keep the batch split (:func:`zoo.model.sharding.batch_sharded`)
        and splash attention shards itself over it."""
        with mesh_context(self.mesh):
            return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = jax.tree.map(lambda a: (getattr(a, "shape", None), getattr(a, "dtype", None),
                                      str(getattr(a, "sharding", None))), (args, kwargs))
        key = str(jax.tree.structure(sig)) + str(jax.tree.leaves(sig))
        if key not in self.compiled:
            self.compiled[key] = compile_lowered(self.lower(*args, **kwargs), self.platform)
            release_free_memory()
        return self.compiled[key](*args, **kwargs)


compile_then_trim = CompileThenTrim


def state_shardings(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    """(optimizer state's shardings, the step counter's): each moment takes its parameter's sharding (arrays or
    ``jax.ShapeDtypeStruct`` s with shardings); factored (adafactor) and scalar state is small: replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_sharding = optax.tree_map_params(
        tx, lambda s, p: p.sharding if s.shape == p.shape else replicated, jax.eval_shape(tx.init, params), params,
        transform_non_params=lambda _: replicated, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return opt_sharding, replicated


def init_state(tx: optax.GradientTransformation, params: dict[str, Any], mesh: jax.sharding.Mesh) -> TrainState:
    """The train state {params, opt_state, step}; optimizer moments take their parameter's sharding."""
    opt_sharding, replicated = state_shardings(tx, params, mesh)
    opt_state, step = jax.jit(lambda p: (tx.init(p), jnp.zeros((), jnp.int32)),
                              out_shardings=(opt_sharding, replicated))(params)
    return {"params": params, "opt_state": opt_state, "step": step}


def state_layout(tx: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh) -> TrainState:
    """:func:`init_state`'s state as ``jax.ShapeDtypeStruct`` s with their shardings, from abstract ``params``
    (nothing computed or allocated): what ``--compile-only`` lowers the step with."""
    opt_sharding, replicated = state_shardings(tx, params, mesh)
    opt = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       jax.eval_shape(tx.init, params), opt_sharding)
    return {"params": params, "opt_state": opt, "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
