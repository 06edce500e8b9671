"""GRPO as an online task of the shared loop: each step samples, scores and trains on its own batch.

The data rows are prompts. A batch of ``batch_size`` rows holds
``batch_size / G`` prompts, each read by G consecutive rows (a group:
``Task.group_size``), so the loop's lanes, sharding, checkpointed data
position and multi-process plumbing apply unchanged. Each step
(:meth:`grpo.rollouts.Rollouts.rollout`):

1. samples one completion per row with the current policy (eval/rollout.py's
   engine: the prompt prefilled once per group, one fixed-shape decoding program;
   LoRA adapters beside the base matmuls, as in training), with a key from the seed and
   the step, so a resumed run draws what the uninterrupted run drew; with
   ``grpo.tools`` or ``grpo.environment`` one episode of several turns per row
   instead (grpo/agentic.py), the tools' tokens masked out of what trains;
2. decodes them and calls the reward functions (grpo/rewards.py) on every
   process, for the whole batch;
3. computes the advantages (grpo/advantages.py: the estimator ``grpo.advantage``
   names) and lays out prompt + completion rows with per-token advantages and the
   sampler's log-probabilities; with ``num_iterations`` > 1 the policy's
   log-probabilities before the update ("old"), with ``beta`` > 0 the reference's,
   each one chunked forward pass without gradient (grpo/programs.py).

The loop then makes ``num_iterations`` optimizer updates on that batch; the
loss (:meth:`GRPOTask.loss_sums`, the estimator's objective) is the clipped surrogate with the k3 KL,
normalized as ``loss_type`` says through :class:`pretrain.metrics.Ratio` metrics, so
``grad_accum`` and the mesh change nothing (``bnpo`` excepted: it normalizes
per micro-batch, as TRL's per-device batch does). Every ``eval_every`` steps the
held-out prompts are completed and scored (grpo/held_out.py). The completions log
is grpo/completions_log.py's hook.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from chat.config import chat_template_of
from chat.formats import BadRow
from chat.images import image_column, refuse_images
from chat.templates import render, template_text
from grpo.advantages import estimator_of
from grpo.agentic import Agent
from grpo.batch import RolloutBatch, UpdateRows, completion_logps, shares_prompts
from grpo.completions_log import COMPLETIONS_FILE, CompletionsLog
from grpo.config import GRPO_UNREAD, GRPOConfig
from grpo.pipeline import Pipeline
from grpo.programs import Programs
from grpo.reward_model import SharedBase
from grpo.rewards import RewardFunction, RewardSet, load_rewards
from grpo.rollouts import Completed, Rollouts
from grpo.tools import ENVIRONMENT_FIELD, EnvironmentReward, Environments, load_tools
from grpo.vision import ImagePrompts, has_images
from pretrain import distributed
from pretrain.batch import Rollout, VisionBatch
from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from pretrain.hooks import Hook
from pretrain.metrics import LossOutput, Max
from pretrain.setup import frozen_base_quant, layout_of, param_layout, tokenizer_folder
from pretrain.task import Documents, ReadContext, RowSource, RunContext, Task, Tokenizer
from zoo.checkpoints.loading import load_reference
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document
from zoo.data.files import indexed_rows, load_dataset_rows
from zoo.data.row_origin import bad_row, row_where
from zoo.errors import UserError
from zoo.lora.weights import Weights
from zoo.model.config import ModelConfig
from zoo.model.vision_config import VisionConfig
from zoo.storage import RunPath


class GRPOTask(Task[RolloutBatch]):
    """Group relative policy optimization with verifiable rewards on prompt rows: the objective (rows, the
    update's layout, the loss); the rollouts are :class:`grpo.rollouts.Rollouts`' once set up."""

    method = "grpo"
    packing = "none"  # one prompt per row
    config_class = GRPOConfig
    online = True
    batch_class = RolloutBatch
    key_metrics = ("reward", "reward_std", "completions/mean_length")

    def __init__(self, cfg: GRPOConfig):
        super().__init__(cfg)
        self.cfg = cfg
        self.grpo = cfg.grpo
        self.chat_template = chat_template_of(cfg)
        self.group_size = cfg.grpo.num_generations
        self.updates_per_step = cfg.grpo.num_iterations
        self.agent: Agent | None = None
        if cfg.grpo.agentic:  # episodes of several turns with tools (grpo/agentic.py), checked before loading
            environments = Environments(cfg.grpo.environment) if cfg.grpo.environment is not None else None
            self.agent = Agent(cfg, load_tools(cfg.grpo.tools), environments)
        self.rewards = self._rewards(cfg)  # a bad spec fails before loading
        self.estimator = estimator_of(cfg.grpo)
        self.field = cfg.data.prompt_field
        g = cfg.grpo
        # The update's rows; grouped (a group's prompt once) is decided with the mesh (shares_prompts).
        self.rows = UpdateRows(False, g.num_generations, cfg.data.seq_len + 1, g.max_completion_length)
        self.programs: Programs | None = None  # the rollout's programs, set up by prepare
        self.reference: str | None = None  # where the reference's weights are (Rollouts), decided by prepare
        self.rollouts: Rollouts | None = None  # set up by read_inputs (a run's: it reads the tokenizer)
        self._eval_rows: RowSource | None = None  # data.eval_path's rows, read once
        self.vision: VisionConfig | None = None  # the model's vision tower's config (prepare)
        self.images: ImagePrompts | None = None  # a vision-language model's prompts with images (prepare)
        self.pipeline: Pipeline[Completed] | None = None  # asynchronous rollouts' trainer side (start_steps)
        self.engine_devices: list[Any] = []  # grpo.rollout_devices' devices (train_devices), the engine's own

    # The keys a GRPO run's card lists (those whose 0 / false / [] means "off" left out then).
    CARD_KEYS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "loss_type",
                 "advantage", "scale_rewards", "normalize_advantages", "epsilon", "epsilon_high", "beta",
                 "num_iterations", "importance_sampling_level", "rewards", "reward_weights", "tools", "environment",
                 "max_turns")

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """GRPO with its loss, advantage estimator (group, RLOO, REINFORCE++) and group size, and its keys."""
        g = cast(GRPOConfig, cfg).grpo
        # The keys this run does not read (grpo/config.py's GRPO_UNREAD: RLOO's loss_type, ...) are not on its card.
        unread = {u.key.removeprefix("grpo.") for u in GRPO_UNREAD if u.when(cfg)}
        loss = "" if "loss_type" in unread else f"loss `{g.loss_type}`, "
        return MethodCard("GRPO (group relative policy optimization: online RL on sampled completions), "
                          f"{loss}advantage `{g.advantage}`, {g.num_generations} completions per prompt",
                          ("grpo",),
                          settings(dataclasses.asdict(cfg), [f"grpo.{k}" for k in cls.CARD_KEYS if k not in unread],
                                   ("grpo.beta", "grpo.normalize_advantages", "grpo.tools", "grpo.top_k")))

    def _rewards(self, cfg: GRPOConfig) -> RewardSet:
        """grpo.rewards, and an environment class's ``get_reward`` as one more source of weight 1 (TRL's)."""
        g = cfg.grpo
        envs = self.agent.environments if self.agent is not None else None
        extra = [RewardFunction(c.__name__, EnvironmentReward(envs, c)) for c in envs.reward_classes] if envs else []
        if not g.rewards and not extra:
            raise UserError("grpo.rewards is empty and grpo.environment's class defines no get_reward(); name a "
                            "reward function, or give the environment a get_reward method")
        own = load_rewards(g.rewards, g.reward_weights) if g.rewards else RewardSet([])
        return RewardSet(own.functions + extra, [*own.weights, *[1.0] * len(extra)])

    # ---- rows -> prompt documents ------------------------------------------------------------------------

    def load(self, path: str, cfg: TrainConfig) -> RowSource:
        """The rows of ``path``; they need the prompt column (``data.prompt_field``) and the columns the shipped
        verifiers read (their answers)."""
        ds, _ = load_dataset_rows(path, cfg.data.split)
        envs = self.agent.environments if self.agent is not None else None
        if self.field not in ds.column_names and envs is None:  # an environment may supply the prompt (reset)
            raise UserError(f"data.path {path}: GRPO rows need a '{self.field}' field (a string, or a list of "
                            f"messages); columns: {ds.column_names} (data.prompt_field names another column)")
        # A shipped verifier without its answers' column would score None everywhere and learn nothing.
        self.rewards.check_columns([c for c in ds.column_names if c != self.field], f"data.path {path}")
        return RowSource(ds, self.field, path)

    def documents(self, rows: RowSource, tokenizer: Tokenizer, path: str, skip_bad: bool,
                  indices: list[int] | None = None) -> Documents:
        """Each prompt's token ids (a message list rendered with the chat template and its generation
        prompt, a string as it is, as TRL does; on a vision-language model a prompt with images as
        grpo/vision.py reads it), with its row index as the feature ``row``. Rows with images on a model without a
        vision tower are a UserError naming the first."""
        docs, bad, too_long = {}, 0, set()
        limit = self.cfg.data.seq_len
        column = image_column(list(rows.ds.column_names))
        if column is not None and self.vision is None:
            refuse_images(rows.ds, column, path, str(self.cfg.model.path))
        for i, row in indexed_rows(rows.ds, indices):
            try:
                ids = self._prompt_ids(row.get(self.field), tokenizer, row, path, i)
            except BadRow as e:
                if skip_bad:
                    bad += 1
                    continue
                raise bad_row(path, i, e) from None
            if len(ids) > limit:
                too_long.add(i)
                if self.cfg.data.long_examples == "drop":
                    continue
                if self.images is not None:  # its images' tokens must stay whole
                    self.images.check_cut(ids, limit, path, i)
                ids = ids[-limit:]  # the end holds the question and the generation prompt (TRL keeps it too)
            docs[i] = {"tokens": np.asarray(ids, np.int32), "row": np.full(len(ids), i, np.int32)}
        return Documents(docs, bad, too_long)

    def _prompt_ids(self, prompt: Any, tokenizer: Any, row: dict[str, Any], path: str, i: int) -> list[int]:
        if self.images is not None and has_images(row, prompt):  # a vision-language model's (grpo/vision.py)
            if self.agent is not None:
                raise UserError(f"{row_where(path, i)}: the row has images, and episodes with tools (grpo.tools, "
                                "grpo.environment) do not read images yet; remove the images or the tools")
            template = template_text(tokenizer, self.chat_template)
            return self.images.prompt_ids(row, tokenizer, lambda messages: render(
                tokenizer, messages, self.chat_template, template, generation_prompt=True), path, i)
        if self.agent is not None:  # rendered with the tools the row's episodes may call
            return self.agent.document_ids(row, f"field '{ENVIRONMENT_FIELD}'")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = render(tokenizer, prompt, self.chat_template, template_text(tokenizer, self.chat_template),
                          generation_prompt=True)
        else:
            what = "missing" if prompt is None else f"not a string or a list of messages (got {type(prompt).__name__})"
            raise BadRow(f"field '{self.field}' is {what}")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise BadRow(f"field '{self.field}' is empty")
        return list(ids)

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Every prompt trains (its completions do)."""
        return len(doc["tokens"]) > 0

    # ---- set-up ------------------------------------------------------------------------------------------

    @property
    def grouped(self) -> bool:
        """Whether the update's rows share each group's prompt (:func:`grpo.batch.shares_prompts`)."""
        return self.rows.grouped

    def prepare(self, ctx: RunContext) -> dict[str, Any] | None:
        """The rollout's programs and row layout; with ``beta`` > 0 returns the reference's params (the step's
        frozen inputs): the ``grpo.reference`` checkpoint, or with full fine-tuning and ``grpo.reference: base``
        (the default) the starting model; None otherwise (LoRA's reference is the frozen base, adapters off)."""
        g, cfg, mcfg = self.grpo, ctx.cfg, ctx.mcfg
        if ctx.ids.eos is None:
            raise UserError("the tokenizer has no EOS token: completions could never end before "
                            "grpo.max_completion_length")
        self.programs = self._programs(cfg, mcfg, ctx.mesh, (ctx.ids.eos,))
        self.vision = mcfg.vision
        if mcfg.vision is not None:
            self.images = ImagePrompts(mcfg.vision, mcfg.family, lambda: tokenizer_folder(cfg), self.field,
                                       self.cfg.data.max_patches, jax.process_count())
        self.reference = None if g.beta <= 0 else "base" if g.reference == "base" and ctx.lora is not None \
            else "inputs"  # LoRA's base: the frozen base the loop holds anyway, run with the adapters off
        if self.reference != "inputs":
            return None
        if g.reference == "base":
            return self._starting_model(ctx)
        dtype = DTYPES[cfg.dtype.params]
        return ctx.arrays.read(param_layout(mcfg, ctx.mesh, dtype),
                               lambda: load_reference(g.reference, "grpo.reference", "base: the starting model",
                                                      mcfg, ctx.mesh, dtype))

    def read_inputs(self, ctx: ReadContext) -> None:
        """The run's rollouts: the agent's tools and the reward functions (reward models loaded once) set up with
        the tokenizer."""
        assert self.programs is not None, "prepare first"
        programs, tokenizer = self.programs, ctx.tokenizer
        if self.agent is not None:
            self.agent.prepare(tokenizer, self.chat_template, ctx.run.mcfg, programs.spec.eos_ids,
                               programs.spec.sampler, programs.compute)
        self.rewards.prepare(ctx.run.mesh, programs.compute, self._shared_base(ctx.run))  # reward models, loaded once
        self.rollouts = Rollouts(self.cfg, programs, self.rewards, self.estimator, tokenizer, self.agent,
                                 self.reference, self.images, self.engine_devices)

    @staticmethod
    def _shared_base(ctx: RunContext) -> SharedBase | None:
        """A LoRA run's frozen base, which a LoRA reward model over the same checkpoint reads instead of a copy."""
        if ctx.lora is None or ctx.source is None:
            return None
        q = frozen_base_quant(ctx.cfg, ctx.source)
        return SharedBase(ctx.source, {"kind": q[0], "double": q[1]} if q else None, ctx.params)

    def _programs(self, cfg: TrainConfig, mcfg: ModelConfig, mesh: jax.sharding.Mesh,
                  eos_ids: tuple[int, ...]) -> Programs:
        """The update's row layout, and the rollout's programs."""
        g = self.grpo
        micro = cfg.batch_size // cfg.grad_accum
        self.rows = UpdateRows(shares_prompts(g, mcfg, mesh, micro), g.num_generations, cfg.data.seq_len + 1,
                               g.max_completion_length)
        return Programs(self.cfg, mcfg, mesh, DTYPES[cfg.dtype.compute], eos_ids, self.rows)

    def compile_programs(self, weights: Weights, frozen_inputs: Any) -> dict[str, Any]:
        """The sampler lowered for ``--compile-only`` (after :meth:`prepare`): the inference engine's prefill of the
        step's prompts and its decoding step of their G completions each (eval/rollout.py's
        :meth:`eval.rollout.RolloutEngine.lowered`), from the policy's ``weights``."""
        assert self.programs is not None, "prepare first"
        p = self.programs
        rows = jax.ShapeDtypeStruct(p.shape + (self.cfg.data.seq_len + 1,), jnp.int32, sharding=p.sharding)
        step = (jax.ShapeDtypeStruct((), jnp.int32, sharding=p.replicated),  # (step, held out): grpo/programs.py
                jax.ShapeDtypeStruct((), jnp.bool_, sharding=p.replicated))
        vision = self._vision_layout(p.shape)
        if vision is not None:  # the prompts' images, laid out as the prompts
            vision = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=p.sharding), vision)
        return {"sampler": p.sample.lower(weights, step, rows, rows, vision=vision)}  # the engine's prefill + step

    def _vision_layout(self, rows: tuple[int, ...]) -> VisionBatch | None:
        """A vision-language model's images of ``rows`` prompt rows, as ``jax.ShapeDtypeStruct`` s: the run's patch
        budget once the prompts are read (grpo/vision.py), else data.max_patches (unset: one frame's, as
        ``--compile-only`` reads no data to size it by); None for a text model."""
        v = self.vision
        if v is None:
            return None
        read = self.images.max_patches if self.images is not None else 0
        return VisionBatch.layout(rows, read or self.cfg.data.max_patches or v.patches_per_image, v.patch_dim)

    def program_kv_cache(self) -> dict[str, int]:
        """Bytes a chip holds of the sampler's KV cache (:meth:`compile_programs`' rows: the step's prompts, G
        completions each, ``max_completion_length`` new tokens): the engine's page pool, split as it splits it."""
        assert self.programs is not None, "prepare first"
        return {"sampler": self.programs.kv_cache_bytes(self.cfg.data.seq_len + 1)}

    def _starting_model(self, ctx: RunContext) -> dict[str, Any]:
        """Full fine-tuning's default reference (TRL's): the model the run starts from, a frozen copy of the params
        as loaded (``model.path``, or the seeded random init), taken before the train step, which donates the
        trained params' buffers, ever runs. A resumed run loads the starting model before restoring its
        checkpoint, so its reference is the starting model too, never the weights it resumes."""
        where = f"model.path {ctx.cfg.model.path}" if ctx.cfg.model.init != "random" else "model.init: random"
        if distributed.is_primary() and not ctx.arrays.abstract:
            print(f"grpo.reference: the starting model ({where}), kept frozen beside the trained weights (grpo.beta "
                  f"{self.grpo.beta:g} with full fine-tuning; grpo.reference: PATH names another checkpoint)",
                  flush=True)
        return ctx.arrays.read(layout_of(ctx.params), lambda: jax.tree.map(lambda x: x.copy(), ctx.params))

    # ---- each step: sample, score, lay out -----------------------------------------------------------------

    def rollout(self, weights: Weights, frozen_inputs: Any, rows: dict[str, jax.Array] | None, step: int,
                source: RowSource) -> Rollout[RolloutBatch]:
        """The step's training batch (:meth:`grpo.rollouts.Rollouts.rollout`; asynchronous rollouts: the one the
        rollout thread completed, grpo/pipeline.py); on a ``grpo.log_completions_every`` step with the completions
        to log (:meth:`hooks`)."""
        assert self.rollouts is not None, "prepare first"
        if self.pipeline is None:
            assert rows is not None, "a synchronous rollout is given its rows"
            return self.rollouts.rollout(weights, frozen_inputs, rows, step, source)
        return self.rollouts.rollout_async(self.pipeline, weights, frozen_inputs, step)

    def train_devices(self, devices: list[Any]) -> tuple[list[Any], str]:
        """Without ``grpo.rollout_devices``, every device; with it, all but the last ``rollout_devices``, on which
        the rollout thread's engine samples (one process only, for now), named by the key in mesh errors."""
        n = self.grpo.rollout_devices if self.grpo.rollout == "async" else 0
        if not n:
            return devices, "devices"
        if jax.process_count() > 1:
            raise UserError(f"grpo.rollout_devices={n} is for a run of one process (this one has "
                            f"{jax.process_count()}); set grpo.rollout_devices=0: the engine then samples on the "
                            "training devices, between the updates")
        if n >= len(devices):
            raise UserError(f"grpo.rollout_devices={n} leaves none of the {len(devices)} devices to train on; give "
                            f"at most {len(devices) - 1}")
        self.engine_devices = devices[-n:]
        return devices[:-n], f"devices (the {len(devices)} less grpo.rollout_devices={n})"

    @property
    def draws_rows(self) -> bool:
        """Asynchronous rollouts request their rows ahead of the steps (grpo/pipeline.py)."""
        return self.grpo.rollout == "async"

    def start_steps(self, start: int, total: int, next_rows: Callable[[], dict[str, jax.Array]],
                    source: RowSource) -> None:
        """With ``grpo.rollout: async``, the rollout thread and the trainer's side of it (grpo/pipeline.py)."""
        if self.grpo.rollout != "async":
            return
        assert self.rollouts is not None, "read_inputs first"
        rollouts = self.rollouts

        self.pipeline = Pipeline(lambda weights, rows, index: rollouts.complete(weights, rows, index, source),
                                 self.grpo.max_staleness, next_rows, start, total, rollouts.snapshot,
                                 inline=jax.process_count() > 1)

    def end_steps(self) -> None:
        """The rollout thread stopped."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None

    def eval_rows(self, source: RowSource | None) -> RowSource:
        """The rows the held-out prompts come from: data.eval_path's (read once), else the training rows that
        data.eval_fraction holds out of."""
        path = self.cfg.data.eval_path
        if path is None:
            assert source is not None, "data.eval_fraction holds prompts out of the training rows"
            return source
        if self._eval_rows is None:
            self._eval_rows = self.load(path, self.cfg)
        return self._eval_rows

    def eval_metrics(self, weights: Weights, docs: list[Document], source: RowSource | None,
                     step: int) -> dict[str, float] | None:
        """The rewards of the held-out prompts (data.eval_path or data.eval_fraction), sampled as the run samples
        and greedy, under TRL's eval names (grpo/held_out.py)."""
        from grpo.held_out import held_out_metrics

        assert self.rollouts is not None, "prepare first"
        return held_out_metrics(self.rollouts, weights, docs, self.eval_rows(source), step)

    def hooks(self, out: RunPath, primary: bool) -> list[Hook]:
        """The completions log (``completions.jsonl`` of the run folder; the primary process writes it)."""
        return [CompletionsLog(out / COMPLETIONS_FILE)] if primary else []

    # ---- (params, batch) -> loss sums ----------------------------------------------------------------------

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> RolloutBatch:
        """Prompt + completion rows: ``seq_len + 1`` prompt tokens and ``grpo.max_completion_length`` completion
        tokens, less one (inputs and targets); ``old_logps`` with ``num_iterations`` > 1, ``ref_logps`` with
        ``beta`` > 0; on a vision-language model each row's images (grpo/vision.py)."""
        g = self.grpo
        fields = ("old_logps",) * (g.num_iterations > 1) + ("ref_logps",) * (g.beta > 0)
        layout = self.rows.layout(grad_accum, micro, seq_len, fields)
        vision = self._vision_layout(layout.inputs.shape[:-1])  # with the rows' images: one row's each
        return layout if vision is None else dataclasses.replace(layout, vision=vision)

    def loss_sums(self, mcfg: ModelConfig, weights: Weights, mb: RolloutBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None) -> LossOutput:
        """A micro-batch of rollout rows' loss sum and count (the estimator's objective: grpo/advantages.py), its
        token means as :class:`pretrain.metrics.Ratio` metrics and the sampler's log-probability gap as a
        :class:`Max`."""
        w = weights.cast(compute)
        # A rollout row is one document (prompt + completion, then padding: eval.rollout_batch.assemble), or a group's
        # prompt and its G completions (assemble_groups), read back one row per completion.
        logp, entropy, aux = completion_logps(mcfg, w, mb, self.rows, float(self.grpo.temperature), remat, entropy=True)
        sg = jax.lax.stop_gradient
        old = sg(logp) if mb.old_logps is None else mb.old_logps
        diff = Max(jnp.max(jnp.abs(mb.sampler_logps - sg(old)) * mb.weights))
        total, n, extras = self.estimator.loss(logp, old, mb.ref_logps, mb, entropy, diff)
        objective = total + (aux["loss"] * n if aux is not None else 0.0)
        return LossOutput(objective, sg(total), n, extras)
