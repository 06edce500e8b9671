"""GRPO as an online task of the shared loop: each step samples, scores and trains on its own batch.

The data rows are prompts. A batch of ``batch_size`` rows holds
``batch_size / G`` prompts, each read by G consecutive rows (a group:
``Task.group_size``), so the loop's lanes, sharding, checkpointed data
position and multi-process plumbing apply unchanged. Each step
(:meth:`GRPOTask.rollout`):

1. samples one completion per row with the current policy (eval/rollout.py:
   the prompt prefilled once per group, one fixed-shape decoding program;
   LoRA adapters beside the base matmuls, as in training), with a key from the seed and
   the step, so a resumed run draws what the uninterrupted run drew; with
   ``grpo.tools`` or ``grpo.environment`` one episode of several turns per row
   instead (grpo/agentic.py), the tools' tokens masked out of what trains;
2. decodes them and calls the reward functions (grpo/rewards.py) on every
   process, for the whole batch;
3. computes group-relative advantages (grpo/losses.py) and lays out prompt +
   completion rows with per-token advantages and the sampler's
   log-probabilities; with ``num_iterations`` > 1 the policy's log-probabilities
   before the update ("old"), with ``beta`` > 0 the reference's, each one
   chunked forward pass without gradient.

The loop then makes ``num_iterations`` optimizer updates on that batch; the
loss (:meth:`GRPOTask.loss_sums`) is the clipped surrogate with the k3 KL,
normalized as ``loss_type`` says through :class:`pretrain.metrics.Ratio` metrics, so
``grad_accum`` and the mesh change nothing (``bnpo`` excepted: it normalizes
per micro-batch, as TRL's per-device batch does). Every ``eval_every`` steps the
held-out prompts are completed and scored (grpo/held_out.py).
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from eval.generate import Sampler
from eval.rollout import RolloutSpec, assemble, assemble_groups, completion_view, sample_group_completions
from grpo import losses
from grpo.agentic import Agent, Episodes
from grpo.config import GRPOConfig, GrpoSection
from grpo.reward_model import SharedBase
from grpo.rewards import RewardFunction, RewardSet, load_rewards, reward_metrics
from grpo.tools import ENVIRONMENT_FIELD, EnvironmentReward, Environments, load_tools
from pretrain import distributed
from pretrain.batch import Rollout, RolloutBatch
from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from pretrain.hooks import Hook, JsonlLog, StepInfo
from pretrain.metrics import LossOutput, Max, Metric, Ratio
from pretrain.setup import frozen_base_quant
from pretrain.task import Documents, LayoutContext, RowSource, RunContext, Task, Tokenizer
from sft.chat import render, template_text
from sft.formats import BadRow
from sft.task import chat_template_of
from zoo.checkpoints.loading import load_reference
from zoo.checkpoints.method_card import MethodCard, settings
from zoo.data.batching import Document, replicated_batch
from zoo.data.files import indexed_rows, load_dataset_rows
from zoo.data.row_origin import bad_row, row_where
from zoo.errors import UserError
from zoo.lora.adapters import LoraConfig, lora_scale
from zoo.model.config import ModelConfig
from zoo.model.decode import kv_cache_bytes
from zoo.model.logps import batch_logps
from zoo.model.quant import cast_params
from zoo.model.sharding import mesh_context

COMPLETIONS_FILE = "completions.jsonl"
GREEDY = Sampler(0.0, 0, 1.0)


@dataclasses.dataclass
class Completed:
    """A batch of prompts completed (:meth:`GRPOTask.complete`): what the rewards read, their scores, and the
    arrays the update lays out."""

    prompts: list[Any]
    ids: list[list[int]]
    texts: list[str]
    ended: np.ndarray  # [B] the completion (its last turn) ended with EOS
    per_fn: np.ndarray
    total: np.ndarray
    len_h: np.ndarray  # [B] tokens after the prompt (an episode's tools' too)
    n_model: np.ndarray  # [B] of them the model's
    episodes: Episodes | None
    prompt_rows: dict[str, Any]
    completions: Any
    lengths: Any
    sampler_logps: Any
    model: Any
    t_gen: float
SAMPLER_DIFF = "logps/sampler_max_diff"  # max |sampler log p - trainer log p| over the batch's completion tokens


class GRPOTask(Task):
    """Group relative policy optimization with verifiable rewards on prompt rows."""

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
        self.field = cfg.data.prompt_field
        self.reference: str | None = None  # "base" or "inputs" with beta > 0 (prepare decides)
        self.grouped = False  # the update's rows share each group's prompt (shares_prompts; set up with the mesh)

    # The keys a GRPO run's card lists (those whose 0 / false / [] means "off" left out then).
    CARD_KEYS = ("num_generations", "max_completion_length", "temperature", "top_p", "top_k", "loss_type",
                 "advantage", "scale_rewards", "normalize_advantages", "epsilon", "epsilon_high", "beta",
                 "num_iterations", "importance_sampling_level", "rewards", "reward_weights", "tools", "environment",
                 "max_turns")

    @classmethod
    def card(cls, cfg: TrainConfig) -> MethodCard:
        """GRPO with its loss, advantage estimator (group, RLOO, REINFORCE++) and group size, and its keys."""
        g = cast(GRPOConfig, cfg).grpo
        return MethodCard("GRPO (group relative policy optimization: online RL on sampled completions), "
                          f"loss `{g.loss_type}`, advantage `{g.advantage}`, {g.num_generations} completions per "
                          "prompt", ("grpo",),
                          settings(dataclasses.asdict(cfg), [f"grpo.{k}" for k in cls.CARD_KEYS],
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
        prompt, a string as it is, as TRL does), with its row index as the feature ``row``."""
        docs, bad, too_long = {}, 0, set()
        limit = self.cfg.data.seq_len
        for i, row in indexed_rows(rows.ds, indices):
            try:
                ids = self._prompt_ids(row.get(self.field), tokenizer, row)
            except BadRow as e:
                if skip_bad:
                    bad += 1
                    continue
                raise bad_row(path, i, e) from None
            if len(ids) > limit:
                too_long.add(i)
                if self.cfg.data.long_examples == "drop":
                    continue
                ids = ids[-limit:]  # the end holds the question and the generation prompt (TRL keeps it too)
            docs[i] = {"tokens": np.asarray(ids, np.int32), "row": np.full(len(ids), i, np.int32)}
        return Documents(docs, bad, too_long)

    def _prompt_ids(self, prompt: Any, tokenizer: Any, row: dict) -> list[int]:
        if self.agent is not None:  # rendered with the tools the row's episodes may call
            return self.agent.document_ids(row, f"field '{ENVIRONMENT_FIELD}'")
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            text = render(tokenizer, prompt, self.chat_template, template_text(tokenizer, self.chat_template),
                          generation_prompt=True)
        else:
            what = "missing" if prompt is None else f"a {type(prompt).__name__}"
            raise BadRow(f"field '{self.field}' is {what}, not a string or a list of messages")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise BadRow(f"field '{self.field}' is empty")
        return list(ids)

    def trainable(self, doc: Document, seq_len: int) -> bool:
        """Every prompt trains (its completions do)."""
        return len(doc["tokens"]) > 0

    # ---- set-up ------------------------------------------------------------------------------------------

    def prepare(self, ctx: RunContext) -> dict | None:
        """Compile-ready rollout functions; with ``beta`` > 0 returns the reference's params (the step's frozen
        inputs): the ``grpo.reference`` checkpoint, or with full fine-tuning and ``grpo.reference: base`` (the
        default) the starting model; None otherwise (LoRA's reference is the frozen base, adapters off)."""
        g, cfg, mcfg, mesh, tokenizer = self.grpo, ctx.cfg, ctx.mcfg, ctx.mesh, ctx.tokenizer
        self.tokenizer = tokenizer
        eos = {tokenizer.eos_token_id} - {None}
        if not eos:
            raise UserError("the tokenizer has no EOS token: completions could never end before "
                            "grpo.max_completion_length")
        self._setup(cfg, mcfg, mesh, ctx.lora, tuple(sorted(eos)))
        if self.agent is not None:
            self.agent.prepare(tokenizer, self.chat_template, mcfg, self.eos_ids, self.spec.sampler, self.compute)
        self.rewards.prepare(mesh, self.compute, self._shared_base(ctx))  # reward models (rm:PATH), loaded once
        frozen_inputs = None
        if g.beta > 0:
            if g.reference == "base" and self.lora_cfg is not None:
                self.reference = "base"  # the frozen base the loop holds anyway, run with the adapters off
            elif g.reference == "base":
                frozen_inputs = self._starting_model(ctx)
                self.reference = "inputs"
            else:
                frozen_inputs = load_reference(g.reference, "grpo.reference", "base: the starting model", mcfg,
                                               mesh, DTYPES[cfg.dtype.params])
                self.reference = "inputs"
        self._compile(cfg)
        return frozen_inputs

    @staticmethod
    def _shared_base(ctx: RunContext) -> SharedBase | None:
        """A LoRA run's frozen base, which a LoRA reward model over the same checkpoint reads instead of a copy."""
        if ctx.lora is None or ctx.source is None:
            return None
        q = frozen_base_quant(ctx.cfg, ctx.source)
        return SharedBase(ctx.source, {"kind": q[0], "double": q[1]} if q else None, ctx.params)

    def _setup(self, cfg: TrainConfig, mcfg: ModelConfig, mesh: jax.sharding.Mesh, lora: LoraConfig | None,
               eos_ids: tuple[int, ...]) -> None:
        """What :meth:`prepare` and :meth:`compile_layout` both set up: the rollout's settings and layouts."""
        g = self.grpo
        self.mcfg, self.lora_cfg, self.eos_ids = mcfg, lora, eos_ids
        self.compute = DTYPES[cfg.dtype.compute]
        self.spec = RolloutSpec(g.num_generations, g.max_completion_length,
                                Sampler(float(g.temperature), int(g.top_k), float(g.top_p)), self.eos_ids)
        self.mesh = mesh
        self.sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.batch_shape = (cfg.grad_accum, cfg.batch_size // cfg.grad_accum)
        self.reference = None
        self.grouped = shares_prompts(g, mcfg, mesh, self.batch_shape[1])

    def compile_layout(self, ctx: LayoutContext) -> Any:
        """The update step's frozen inputs for ``--compile-only``: with ``beta`` > 0, a reference model shaped
        and sharded like the params (the starting model of full fine-tuning, or ``grpo.reference``'s
        checkpoint), which the run holds beside the trained weights; None otherwise. Sets up the rollout's
        programs too (:meth:`compile_programs`; the EOS id only fills a constant, so any id does)."""
        g = self.grpo
        self._setup(ctx.cfg, ctx.mcfg, ctx.mesh, ctx.lora, (ctx.mcfg.vocab_size - 1,))
        self._compile(ctx.cfg)
        if g.beta > 0 and not (g.reference == "base" and ctx.lora is not None):
            return ctx.params
        return None

    def compile_programs(self, trainable: Any, frozen: Any) -> dict[str, Any]:
        """The sampler lowered for ``--compile-only`` (after :meth:`compile_layout`): G completions of
        ``grpo.max_completion_length`` tokens for the step's prompts, from the policy's weights."""
        cfg = self.cfg
        rows = jax.ShapeDtypeStruct(self.batch_shape + (cfg.data.seq_len + 1,), jnp.int32, sharding=self.sharding)
        step = jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated)
        lora = trainable if self.lora_cfg is not None else None
        base = frozen if self.lora_cfg is not None else trainable
        return {"sampler": self._sample.lower(base, lora, rows, rows, step)}

    def program_kv_cache(self) -> dict[str, int]:
        """Bytes a chip holds of the sampler's KV cache (:meth:`compile_programs`' rows: the step's prompts, G
        completions each, ``max_completion_length`` new tokens), laid out as the sampler lays it out."""
        rows = self.batch_shape[0] * self.batch_shape[1]
        slots = self.cfg.data.seq_len + 1 + self.spec.new_tokens
        return {"sampler": kv_cache_bytes(self.mcfg, rows, slots, self.compute, self.mesh)}

    def _starting_model(self, ctx: RunContext) -> dict:
        """Full fine-tuning's default reference (TRL's): the model the run starts from, a frozen copy of the params
        as loaded (``model.path``, or the seeded random init), taken before the train step, which donates the
        trained params' buffers, ever runs. A resumed run loads the starting model before restoring its
        checkpoint, so its reference is the starting model too, never the weights it resumes."""
        where = f"model.path {ctx.cfg.model.path}" if ctx.cfg.model.init != "random" else "model.init: random"
        if distributed.is_primary():
            print(f"grpo.reference: the starting model ({where}), kept frozen beside the trained weights (grpo.beta "
                  f"{self.grpo.beta:g} with full fine-tuning; grpo.reference: PATH names another checkpoint)",
                  flush=True)
        return jax.tree.map(lambda x: x.copy(), ctx.params)

    def _compile(self, cfg: TrainConfig) -> None:
        """The jitted pieces of a rollout, each laid out as the train step reads its batch."""
        mcfg, spec, compute, shape = self.mcfg, self.spec, self.compute, self.batch_shape
        lora_cfg = self.lora_cfg
        b = shape[0] * shape[1]
        temperature = float(self.grpo.temperature)

        scale = None if lora_cfg is None else lora_scale(lora_cfg)
        self._scale = scale

        def sample(base: dict, lora: dict | None, tokens: jax.Array, seg: jax.Array, step: jax.Array,
                   spec: RolloutSpec = spec, held_out: bool = False):
            # The weights as the train step computes with them: cast to the compute dtype, adapters beside.
            policy = cast_params(base, compute)
            key = self._rollout_key(step, held_out)
            return sample_group_completions(mcfg, policy, tokens.reshape(b, -1), seg.reshape(b, -1) > 0, spec, key,
                                            lora, scale, mesh=self.mesh)

        def layout(tokens, seg, completions, lengths, sampler_logps, advantages, trained, model=None):
            args = (tokens.reshape(b, -1), seg.reshape(b, -1) > 0, completions, lengths,
                    {"sampler_logps": sampler_logps}, {"advantages": advantages}, trained)
            out = assemble_groups(*args, spec.group, model) if self.grouped else assemble(*args, model)
            return RolloutBatch.of({k: v.reshape(shape[:1] + (-1,) + v.shape[1:]) for k, v in out.items()})

        def logps(params: dict, batch: RolloutBatch, **forward_kwargs: Any) -> jax.Array:
            flat = jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), batch)
            p = cast_params(params, compute)
            lp = batch_logps(mcfg, p, flat.arrays(), temperature=temperature, max_segments=self._segments,
                             **forward_kwargs)[0]
            lp = self._completions(lp)
            return (lp * flat.weights).reshape(shape + lp.shape[1:])

        self._sample = jax.jit(sample)
        # Held-out prompts (grpo/held_out.py): the run's sampling on their own key stream, and greedy, one
        # completion per prompt (a group of one).
        self._sample_held_out = jax.jit(partial(sample, held_out=True))
        self._sample_greedy = jax.jit(partial(sample, spec=RolloutSpec(1, spec.new_tokens, GREEDY, spec.eos_ids),
                                              held_out=True))
        self._layout = jax.jit(layout, out_shardings=self.sharding)
        beta = float(self.grpo.beta)
        self._reinforce_pp = jax.jit(lambda r, w, kl, group, clip: losses.reinforce_pp_advantages(r, w, kl, beta, group,
                                                                                                clip),
                                     static_argnums=(3, 4))
        self._logps = jax.jit(logps, out_shardings=self.sharding)
        if lora_cfg is not None:
            self._policy_logps = jax.jit(lambda base, lora, batch: logps(base, batch, lora=lora, lora_scale=scale),
                                         out_shardings=self.sharding)
        else:
            self._policy_logps = jax.jit(lambda base, lora, batch: logps(base, batch), out_shardings=self.sharding)

    @property
    def _segments(self) -> int:
        """The documents a row of the update holds: a group's prompt and its completions, or one."""
        return self.spec.group + 1 if self.grouped else 1

    def _completions(self, x: jax.Array) -> jax.Array:
        """A per-position array of the update's rows as one row per completion (eval.rollout.completion_view),
        aligned with the batch's per-completion arrays; as it is with one row per completion."""
        if not self.grouped:
            return x
        return completion_view(x, self.cfg.data.seq_len + 1, self.spec.group, self.spec.new_tokens)

    def _rollout_key(self, step: Any, held_out: bool = False) -> jax.Array:
        """The sampling key of a step: its own stream (LoRA dropout folds the step into key(seed)); held-out
        prompts' samples have another, so evaluating never changes what training draws."""
        root = jax.random.fold_in(jax.random.key(self.cfg.seed), 0x67727)
        return jax.random.fold_in(jax.random.fold_in(root, 0xE7A1) if held_out else root, step)

    # ---- each step: sample, score, lay out -----------------------------------------------------------------

    def rollout(self, params: dict, frozen: dict | None, frozen_inputs: Any, rows: dict[str, jax.Array],
                step: int, source: RowSource) -> Rollout:
        """The step's training batch: G completions per prompt from the current policy, their rewards and
        advantages, laid out as prompt + completion rows; with the rollout's metrics (TRL's names) and, on a
        ``grpo.log_completions_every`` step, the completions to log (:meth:`hooks`)."""
        g = self.grpo
        t0 = time.perf_counter()
        lora = params if self.lora_cfg is not None else None
        base = frozen if self.lora_cfg is not None else params
        done = self.complete(cast(dict, base), lora, rows, step, source)
        t_gen = done.t_gen
        prompts, ids, texts, ended, per_fn, total = (done.prompts, done.ids, done.texts, done.ended, done.per_fn,
                                                     done.total)
        prompt_rows, completions, lengths, sampler_logps, model = (done.prompt_rows, done.completions, done.lengths,
                                                                   done.sampler_logps, done.model)
        len_h, n_model, episodes = done.len_h, done.n_model, done.episodes
        truncated = ~ended
        trained = ~truncated if g.mask_truncated else np.ones_like(truncated)
        m: dict[str, float] = {}
        if g.advantage == "group":
            adv, std, zero_std = (np.asarray(x) for x in
                                  losses.advantages(jnp.asarray(total, jnp.float32), g.num_generations,
                                                    g.scale_rewards))
            m.update({"reward_std": float(np.mean(std)), "frac_reward_zero_std": float(np.mean(zero_std))})
        else:
            adv = np.zeros(len(total), np.float32)
        given = replicated_batch({"adv": adv.astype(np.float32), "trained": trained}, self.replicated)
        batch = self._layout(prompt_rows["tokens"], prompt_rows["tokens_segment_ids"], completions, lengths,
                             sampler_logps, given["adv"], given["trained"], model)
        with mesh_context(self.sharding.mesh):  # traced for the mesh: splash attention shards itself (zoo.kernels.splash)
            old = ref = None
            if g.num_iterations > 1 or (g.advantage != "group" and g.beta > 0):
                old = self._policy_logps(base, lora, batch)  # the policy that sampled (RLOO: its KL's first term)
            if self.reference == "base":  # the LoRA base, adapters off
                ref = self._logps(frozen, batch)
            elif self.reference == "inputs":  # the starting model (full fine-tuning) or a grpo.reference checkpoint
                ref = self._logps(frozen_inputs, batch)
        if g.advantage != "group":  # the KL to the reference goes into the reward; the estimator's advantages
            batch, adv, more = self._estimator_advantages(batch, per_fn, total, old, ref, prompt_rows, completions,
                                                          lengths, sampler_logps, trained, model)
            m.update(more)
        if g.num_iterations > 1:
            batch = dataclasses.replace(batch, old_logps=old)
        if ref is not None:
            batch = dataclasses.replace(batch, ref_logps=ref)
        t_roll = time.perf_counter() - t0

        n_tokens = int(len_h.sum())
        real = int(_to_host(prompt_rows["tokens_segment_ids"] > 0).sum()) + n_tokens
        m = {
            "reward": float(np.mean(total)), **m,
            "completions/mean_length": float(n_model.mean()), "completions/min_length": float(n_model.min()),
            "completions/max_length": float(n_model.max()), "completions/clipped_ratio": float(truncated.mean()),
            "rollout_tokens_per_sec": n_tokens / max(t_gen, 1e-9),
        }
        m.update(reward_metrics(self.rewards.names, per_fn))
        if episodes is not None:
            m.update(episodes.metrics())
        every = g.log_completions_every
        log = completion_records(step + 1, prompts, texts, ids, self.rewards.names, per_fn, total, adv) \
            if every and (step + 1) % every == 0 else []
        if log and episodes is not None:  # whole episodes: messages, turns, calls and answers
            log = [{**rec, **ep} for rec, ep in zip(log, episodes.records())]
        return Rollout(batch, m, t_gen, t_roll, real * g.num_iterations, log)

    def complete(self, base: dict, lora: Any, rows: dict[str, Any], step: int, source: RowSource,
                 mode: str = "train") -> Completed:
        """Complete a batch of prompt rows and score the completions (``mode``: ``train``, the step's own draws;
        ``held_out``, the run's sampling on the held-out key stream; ``greedy``, one greedy completion per row)."""
        t0 = time.perf_counter()
        row_h = _to_host(rows["row"])[..., 0].reshape(-1)
        ds = source.ds
        records = {int(i): ds[int(i)] for i in np.unique(row_h)}
        where = lambda r: row_where(source.path, int(row_h[r]))  # noqa: E731
        episodes: Episodes | None = None
        model = None
        if self.agent is None:
            sample = {"train": self._sample, "held_out": self._sample_held_out, "greedy": self._sample_greedy}[mode]
            completions, sampler_logps, lengths = sample(base, lora, rows["tokens"], rows["tokens_segment_ids"],
                                                         np.int32(step))
            comp_h, len_h = _to_host(completions), _to_host(lengths)
            ended = np.isin(comp_h[np.arange(len(len_h)), len_h - 1], self.eos_ids)
            prompt_rows = {"tokens": rows["tokens"], "tokens_segment_ids": rows["tokens_segment_ids"]}
            n_model = len_h
        else:  # episodes of several turns with tools (grpo/agentic.py)
            sampler = GREEDY if mode == "greedy" else None
            episodes = self.agent.run(base, lora, self._scale, [records[int(i)] for i in row_h],
                                      self._rollout_key(step, mode != "train"), where, sampler)
            comp_h, len_h, ended = episodes.tokens, episodes.lengths, episodes.ended
            shape = self.batch_shape
            placed = replicated_batch({"tokens": episodes.prompt_tokens.reshape(shape + (-1,)),
                                       "tokens_segment_ids": episodes.prompt_valid.reshape(shape + (-1,)),
                                       "completions": comp_h, "sampler_logps": episodes.logps, "lengths": len_h,
                                       "model": episodes.model}, self.replicated)
            prompt_rows = {k: placed[k] for k in ("tokens", "tokens_segment_ids")}
            completions, sampler_logps, lengths, model = (placed[k] for k in ("completions", "sampler_logps",
                                                                              "lengths", "model"))
            n_model = episodes.model.sum(1)  # TRL counts the model's tokens only
        t_gen = time.perf_counter() - t0
        ids = [comp_h[r, :len_h[r]].tolist() for r in range(len(row_h))]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if episodes is None:
            prompts = [records[int(i)][self.field] for i in row_h]
            completions_in: list[Any] = [t if isinstance(p, str) else [{"role": "assistant", "content": t}]
                                         for t, p in zip(texts, prompts)]
        else:  # TRL's completions of an episode: its assistant and tool messages
            prompts, completions_in = episodes.prompts, episodes.completions
        columns = {k: [records[int(i)][k] for i in row_h] for k in ds.column_names if k != self.field}
        per_fn, total = self.rewards.compute(prompts, completions_in, ids, columns, where)
        return Completed(prompts, ids, texts, np.asarray(ended), per_fn, total, len_h, np.asarray(n_model), episodes,
                         prompt_rows, completions, lengths, sampler_logps, model, t_gen)

    def eval_rows(self, source: RowSource | None) -> RowSource:
        """The rows the held-out prompts come from: data.eval_path's (read once), else the training rows that
        data.eval_fraction holds out of."""
        path = self.cfg.data.eval_path
        if path is None:
            assert source is not None, "data.eval_fraction holds prompts out of the training rows"
            return source
        if getattr(self, "_eval_rows", None) is None:
            self._eval_rows = self.load(path, self.cfg)
        return self._eval_rows

    def eval_metrics(self, params: dict, frozen: dict | None, docs: list[Document], source: RowSource | None,
                     step: int) -> dict[str, float] | None:
        """The rewards of the held-out prompts (data.eval_path or data.eval_fraction), sampled as the run samples
        and greedy, under TRL's eval names (grpo/held_out.py)."""
        from grpo.held_out import held_out_metrics

        return held_out_metrics(self, params, frozen, docs, source, step)

    def _estimator_advantages(self, batch: RolloutBatch, per_fn: np.ndarray, total: np.ndarray, old: Any, ref: Any,
                              rows: dict, completions: Any, lengths: Any, sampler_logps: Any,
                              trained: np.ndarray, model: Any = None) -> tuple[RolloutBatch, np.ndarray,
                                                                                dict[str, float]]:
        """RLOO's or REINFORCE++'s advantages (grpo.advantage) for the laid-out batch, with their metrics (TRL
        RLOOTrainer's names). ``old``/``ref``: the sampling policy's and the reference's per-token
        log-probabilities (None without ``beta``)."""
        g = self.grpo
        clip = (float(g.reward_clip_range[0]), float(g.reward_clip_range[1])) if g.reward_clip_range else None
        w = batch.weights
        kl_tok = None if old is None or ref is None else old - ref  # k1, the first-order estimate both use
        m: dict[str, float] = {}
        if kl_tok is not None:  # TRL: the completion tokens' mean of old - ref
            m["kl"] = float(_to_host((kl_tok * w).sum() / jnp.maximum(w.sum(), 1.0)))
        if g.advantage == "rloo":
            r = total.astype(np.float64).copy()
            if per_fn.shape[1]:
                r[np.isnan(per_fn).all(1)] = np.nan  # unscorable: out of every baseline, advantage 0
            if clip is not None:
                r = np.clip(r, clip[0], clip[1])
            if kl_tok is not None:  # the sequence's summed KL, subtracted from its reward
                r = r - g.beta * _to_host((kl_tok * w).sum(-1)).reshape(-1)
            adv_j, group_std = losses.rloo_advantages(jnp.asarray(r, jnp.float32), g.num_generations,
                                                      g.normalize_advantages)
            adv = np.asarray(adv_j)
            shown = np.where(np.isnan(per_fn).all(1), np.nan, total) if per_fn.shape[1] else total
            m.update({"reward_std": float(np.nanstd(shown, ddof=1)) if np.isfinite(shown).sum() > 1 else 0.0,
                      "frac_reward_zero_std": float(np.mean(np.isclose(np.asarray(group_std), 0.0)))})
            given = replicated_batch({"adv": adv.astype(np.float32), "trained": trained}, self.replicated)
            batch = self._layout(rows["tokens"], rows["tokens_segment_ids"], completions, lengths, sampler_logps,
                                 given["adv"], given["trained"], model)
            return batch, adv, m
        group = g.num_generations if g.advantage == "reinforce_pp_baseline" else None
        flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731
        adv_tok = self._reinforce_pp(jnp.asarray(total, jnp.float32), flat(w),
                                     None if kl_tok is None else flat(kl_tok), group, clip)
        batch = dataclasses.replace(batch, advantages=adv_tok.reshape(w.shape))
        grouped = total.reshape(-1, g.num_generations)
        m.update({"reward_std": float(np.mean(grouped.std(1, ddof=1))),
                  "frac_reward_zero_std": float(np.mean(np.isclose(grouped.std(1, ddof=1), 0.0)))})
        w_h, adv_h = _to_host(flat(w)), _to_host(adv_tok)
        return batch, (adv_h * w_h).sum(-1) / np.maximum(w_h.sum(-1), 1.0), m  # each row's mean, for the log

    def hooks(self, out: Path, primary: bool) -> list[Hook]:
        """The completions log (``completions.jsonl`` of the run folder; the primary process writes it)."""
        return [CompletionsLog(out / COMPLETIONS_FILE)] if primary else []

    # ---- (params, batch) -> loss sums ----------------------------------------------------------------------

    def batch_layout(self, grad_accum: int, micro: int, seq_len: int) -> RolloutBatch:
        """Prompt + completion rows: ``seq_len + 1`` prompt tokens and ``grpo.max_completion_length`` completion
        tokens, less one (inputs and targets); ``old_logps`` with ``num_iterations`` > 1, ``ref_logps`` with
        ``beta`` > 0."""
        g = self.grpo
        fields = ("old_logps",) * (g.num_iterations > 1) + ("ref_logps",) * (g.beta > 0)
        if not self.grouped:
            return RolloutBatch.layout((grad_accum, micro, seq_len + g.max_completion_length), fields)
        # One row per group (eval.rollout.assemble_groups); the per-completion arrays one row per completion.
        G, t = g.num_generations, g.max_completion_length
        rows = RolloutBatch.layout((grad_accum, micro // G, seq_len + G * (t + 1)), ("prefix_ids",))
        tokens = RolloutBatch.layout((grad_accum, micro, t), fields)
        return dataclasses.replace(tokens, **{k: getattr(rows, k) for k in
                                              ("inputs", "targets", "segment_ids", "positions", "prefix_ids")})

    def loss_sums(self, mcfg: ModelConfig, params: dict, mb: RolloutBatch, compute: Any, remat: str, *,
                  frozen_inputs: Any = None, totals: Any = None, step: jax.Array | None = None,
                  **forward_kwargs: Any) -> LossOutput:
        """A micro-batch of rollout rows' loss sum and count, its token means as :class:`Ratio` metrics and the
        sampler's log-probability gap as a :class:`Max`."""
        g = self.grpo
        p = cast_params(params, compute)
        # A rollout row is one document (prompt + completion, then padding: eval.rollout.assemble), or a group's
        # prompt and its G completions (assemble_groups), read back one row per completion.
        logp, entropy, aux = batch_logps(mcfg, p, mb.arrays(), remat, temperature=float(g.temperature), entropy=True,
                                         max_segments=self._segments, **forward_kwargs)
        logp, entropy = self._completions(logp), self._completions(entropy)
        mask = mb.weights
        old = jax.lax.stop_gradient(logp) if mb.old_logps is None else mb.old_logps
        ref = mb.ref_logps
        eps_high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        sg = jax.lax.stop_gradient
        if g.advantage == "rloo":  # RLOOTrainer's own loss: one summed-log-ratio importance ratio per completion
            seq = losses.rloo_sequence_terms(logp, old, mb.advantages[:, 0], mask, g.epsilon, eps_high)
            total, n = seq["loss"].sum(), jnp.float32(seq["loss"].shape[0])
            one = lambda x: Ratio(x.sum(), jnp.float32(x.shape[0]))  # noqa: E731
            extras: dict[str, Metric] = {"entropy": Ratio(*losses.masked_mean_sums(entropy, mask)),
                                         "clip_ratio/low_mean": one(seq["low_clip"]),
                                         "clip_ratio/high_mean": one(seq["high_clip"]),
                                         "clip_ratio/region_mean": one(seq["region_clip"]),
                                         SAMPLER_DIFF: Max(jnp.max(jnp.abs(mb.sampler_logps - sg(old)) * mask))}
            return LossOutput(total + (aux["loss"] * n if aux is not None else 0.0), sg(total), n, extras)
        # group: one value per row, broadcast over its tokens; REINFORCE++: one per token
        adv = mb.advantages[:, 0] if g.advantage == "group" else mb.advantages
        # RLOO and REINFORCE++ put the KL into the reward (the rollout): no KL term in the loss
        terms = losses.token_terms(logp, old, ref, adv, mask, g.epsilon, eps_high,
                                   g.beta if g.advantage == "group" else 0.0, g.importance_sampling_level)
        total, n = losses.loss_sum_count(terms["loss"], mask, g.loss_type, g.max_completion_length)
        if g.importance_sampling_level == "sequence":  # one ratio per completion: TRL counts clipped sequences
            clip_of = lambda x: Ratio(*losses.masked_mean_sums(x[:, :1], jnp.ones_like(x[:, :1])))  # noqa: E731
        else:
            clip_of = lambda x: Ratio(*losses.masked_mean_sums(x, mask))  # noqa: E731
        extras = {
            "entropy": Ratio(*losses.masked_mean_sums(entropy, mask)),
            "clip_ratio/low_mean": clip_of(terms["low_clip"]),
            "clip_ratio/high_mean": clip_of(terms["high_clip"]),
            "clip_ratio/region_mean": clip_of(terms["region_clip"]),
            SAMPLER_DIFF: Max(jnp.max(jnp.abs(mb.sampler_logps - sg(old)) * mask)),
        }
        if g.beta > 0 and g.advantage == "group":  # as TRL: no reference, no kl metric (it would be a constant 0)
            extras["kl"] = Ratio(*losses.masked_mean_sums(sg(terms["kl"]), mask))
        objective = total + (aux["loss"] * n if aux is not None else 0.0)
        return LossOutput(objective, sg(total), n, extras)


def shares_prompts(g: GrpoSection, mcfg: ModelConfig, mesh: jax.sharding.Mesh, micro: int) -> bool:
    """Whether the update lays each group out in one row with its prompt once (``grpo.share_prompt``): not for
    models with sliding-window layers (their windows count row indices: zoo.model.masks), nor for the splash and cuDNN
    kernels (they cannot read a shared prefix: zoo.kernels.choice), and only with whole groups in every shard of a
    micro-batch (the rows are split over data and fsdp as they are)."""
    shards = int(mesh.shape.get("data", 1)) * int(mesh.shape.get("fsdp", 1))
    G = g.num_generations
    return (g.share_prompt and "sliding" not in mcfg.kinds and mcfg.attention in ("auto", "blockwise")
            and micro % G == 0 and (micro // G) % shards == 0)


def completion_records(step: int, prompts: list, texts: list[str], ids: list[list[int]], names: list[str],
                       per_fn: np.ndarray, total: np.ndarray, adv: np.ndarray) -> list[dict[str, Any]]:
    """One ``completions.jsonl`` record per completion of loop step ``step`` (1-based): its prompt, text, ids,
    weighted total ``reward``, ``advantage``, and each function's value (None: did not apply) under
    ``rewards`` by function name, a namespace of their own, so that no function's name (``reward``, ``step``)
    can overwrite a field of the record."""
    out = []
    for r in range(len(texts)):
        out.append({"step": step, "prompt": prompts[r], "completion": texts[r], "completion_ids": ids[r],
                    "reward": float(total[r]), "advantage": float(adv[r]),
                    "rewards": {name: None if np.isnan(v) else float(v) for name, v in zip(names, per_fn[r])}})
    return out


class CompletionsLog(JsonlLog):
    """GRPO's completions log: what each rollout gave to log, appended after its step."""

    def on_step(self, info: StepInfo) -> None:
        if info.rollout is not None and info.rollout.log:
            self.write(info.rollout.log)


def _to_host(x: jax.Array) -> np.ndarray:
    """A global array whole on this host (gathered from every process in a multi-process run)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
