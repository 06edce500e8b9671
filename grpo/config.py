"""GRPO's config schema: the ``grpo:`` section (sampling, rewards, loss, reference) and the prompt data keys.

Defaults are TRL 1.16's ``GRPOConfig`` where the two share a setting, so a
TRL config carries over key by key (``mask_truncated_completions`` is
``mask_truncated`` here, ``log_completions`` a cadence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from chat.config import ChatDataSection
from pretrain.config import COMMON_UNREAD, TEXT_FIELD_UNREAD, TrainConfig, layout_unread
from pretrain.config_unread import Unread, keys_unread
from zoo.errors import UserError

# The settings grpo/losses.py implements; here, so that a config is read and checked without importing JAX.
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_LEVELS = ("token", "sequence")
SAMPLER_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# how a completion's advantage is estimated (grpo/advantages.py, one class by each name): GRPO's group-relative
# one, RLOO's leave-one-out (TRL's RLOOTrainer, its own loss), REINFORCE++ with or without its group-mean baseline
# (OpenRLHF); with the keys of its own each reads
ESTIMATOR_KEYS = {"group": (), "rloo": ("reward_clip_range", "normalize_advantages"),
                  "reinforce_pp": ("reward_clip_range",), "reinforce_pp_baseline": ("reward_clip_range",)}
ADVANTAGES = tuple(ESTIMATOR_KEYS)
ROLLOUT_MODES = ("sync", "async")


@dataclass
class GrpoSection:
    """Group relative policy optimization (`grpo train`, grpo/): rollouts, rewards, the loss and the reference."""

    # G: completions sampled per prompt (a group); batch_size counts completions
    num_generations: int = field(default=8, metadata={"range": "[2, inf)", "why": "a group compares its completions"})
    # new tokens per completion at most (decoding has this fixed shape)
    max_completion_length: int = field(default=512, metadata={"range": "[1, inf)"})
    # sampling temperature; the trainer's log-probabilities use it too
    temperature: float = field(default=1.0, metadata={
        "range": "(0, inf)", "why": "greedy decoding makes a group's completions equal"})
    top_p: float = field(default=1.0, metadata={"range": "(0, 1]"})  # nucleus sampling (1.0: off)
    top_k: int = field(default=0, metadata={"range": "[0, inf)"})  # keep the k most likely tokens (0: off)
    # reward functions: a shipped verifier's name (exact_match, final_number, format, length_penalty), a
    # `module:function` or `path/to/file.py:function`; or a mapping {function: ..., name: ..., other keys are
    # keyword arguments of the function}
    rewards: list[Any] = field(default_factory=list)
    # one weight per reward function (None: all 1); any finite number (a negative one penalizes), not all 0
    reward_weights: list[float] | None = None
    # how each completion's advantage is estimated: group (GRPO's), rloo (TRL's RLOOTrainer, its own loss),
    # reinforce_pp or reinforce_pp_baseline (REINFORCE++, the KL in the reward)
    advantage: str = field(default="group", metadata={"choices": ADVANTAGES})
    # rloo: (A - mean) / (std + 1e-4) over the batch's scorable completions (TRL RLOOConfig.normalize_advantages)
    normalize_advantages: bool = False
    # rloo, reinforce_pp*: [low, high] the rewards are clipped to before anything else (None: no clipping)
    reward_clip_range: list[float] | None = None
    # the surrogate and how its token losses are averaged (TRL's): grpo per sequence, dr_grpo over
    # max_completion_length, dapo over the batch's tokens, bnpo over each micro-batch's; cispo (MiniMax-M1: the
    # ratio clipped at epsilon_high, detached, times A logp; as dapo), sapo (a soft sigmoid gate; as grpo), luspo
    # (token sums averaged over completions), vespo (a gamma weight of the sequence's ratio times A logp; as dapo)
    loss_type: str = field(default="dapo", metadata={"choices": LOSS_TYPES})
    # sapo: the gate's temperature for tokens of positive advantage, and of the others
    sapo_temperature_pos: float = field(default=1.0, metadata={"range": "(0, inf)"})
    sapo_temperature_neg: float = field(default=1.05, metadata={"range": "(0, inf)"})
    # vespo: phi(w) = exp(lambda + k log w - lambda w), k and lambda for advantages >= 0 and for negative ones
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    # advantages divided by the rewards' std of the group, of the batch, or not at all (Dr. GRPO)
    scale_rewards: str = field(default="group", metadata={"choices": SCALE_REWARDS})
    epsilon: float = field(default=0.2, metadata={"range": "(0, inf)"})  # the ratio is clipped below at 1 - epsilon
    # ... and above at 1 + epsilon_high (None: epsilon; DAPO's clip-higher); cispo: the ratio's own upper clip
    # (the ScaleRL paper's 5.0)
    epsilon_high: float | None = field(default=None, metadata={"range": "(0, inf)"})
    # mu: optimizer updates per rollout batch (> 1 reuses it with its old log-probs)
    num_iterations: int = field(default=1, metadata={"range": "[1, inf)"})
    # one importance ratio per token (GRPO) or per sequence (GSPO: the mean log ratio of the completion)
    importance_sampling_level: str = field(default="token", metadata={"choices": IMPORTANCE_LEVELS})
    # weigh each completion token's loss by exp(trainer's old log p - the sampler's), the correction TRL 1.16 makes
    # for vLLM's logprobs (its vllm_importance_sampling_* keys, here without the prefix)
    importance_sampling_correction: bool = False
    # token_ or sequence_ (one weight per completion, its summed log-ratio), truncate (clipped to [clip_min,
    # clip_max]) or mask (0 outside it)
    importance_sampling_mode: str = field(default="sequence_mask", metadata={"choices": SAMPLER_IS_MODES})
    importance_sampling_clip_min: float | None = field(default=None, metadata={"range": "[0, inf)"})
    importance_sampling_clip_max: float | None = field(default=3.0, metadata={"range": "(0, inf)"})
    # weight of the k3 KL to the reference (0: no reference pass at all)
    beta: float = field(default=0.0, metadata={"range": "[0, inf)"})
    # beta > 0: base, the model the run starts from (LoRA: the base, adapters off; full fine-tuning: a frozen copy of
    # the starting checkpoint, as TRL) | a zoo checkpoint path
    reference: str = "base"
    mask_truncated: bool = False  # completions that hit max_completion_length train nothing
    # the update reads each group's prompt once, its G completions after it (eval.rollout_batch.assemble_groups), where
    # the model and mesh allow it (no sliding-window layers, attention auto or blockwise, whole groups per shard
    # of each micro-batch); off: one prompt + completion row each, as TRL lays them out
    share_prompt: bool = True
    # sync: each step samples with the weights it trains; async: a rollout thread samples the next batches while the
    # trainer updates (grpo/pipeline.py), each sample tagged with the policy version it came from
    rollout: str = field(default="sync", metadata={"choices": ROLLOUT_MODES})
    # async: how many updates a sample may lag behind the policy it trains (TRL AsyncGRPOConfig's); the rollout
    # thread samples at most this many batches ahead, and a staler batch is dropped and counted (0: as sync)
    max_staleness: int = field(default=1, metadata={"range": "[0, inf)"})
    # async: the devices of each process the engine samples on (the last ones), the rest train (0: the engine
    # shares the training devices, interleaved)
    rollout_devices: int = field(default=0, metadata={"range": "[0, inf)"})
    # write every completion of every Nth step to completions.jsonl (0: never)
    log_completions_every: int = field(default=10, metadata={"range": "[0, inf)"})
    # functions the model may call over several turns: `module:function` or `path/to/file.py:function`, their type
    # hints and docstrings the schemas the chat template shows (grpo/tools.py)
    tools: list[str] = field(default_factory=list)
    # TRL's environment_factory: `path/to/file.py:factory` (one instance per rollout, its public methods the
    # tools, reset(**row) starts an episode, get_reward() scores it), or {name: factory} picked by each row's
    # `environment` column
    environment: Any = None
    # assistant turns per episode at most (None: until max_completion_length, which tools' tokens share)
    max_turns: int | None = field(default=None, metadata={"range": "[1, inf)"})
    tool_timeout: float = field(default=10.0, metadata={"range": "(0, inf)"})  # seconds a tool call may take
    # how tool calls are read from the model's text: auto (the chat template's family), hermes, llama3_json,
    # mistral, mistral_args, or path/to/file.py:function
    tool_parser: str = "auto"

    @property
    def agentic(self) -> bool:
        """Whether episodes run over several turns with tools (grpo.tools or grpo.environment)."""
        return bool(self.tools) or self.environment is not None

    def check(self) -> None:
        """The rewards named and weighted consistently (each number's range is its field's ``range``)."""
        if isinstance(self.rewards, str):  # `grpo.rewards=a:f,b:g` on the command line
            self.rewards = [r.strip() for r in self.rewards.split(",") if r.strip()]
        if isinstance(self.tools, str):
            self.tools = [t.strip() for t in self.tools.split(",") if t.strip()]
        if not self.rewards and self.environment is None:  # an environment may score episodes itself (get_reward)
            raise UserError("grpo.rewards is empty; name at least one reward function (e.g. grpo.rewards=[final_number] "
                            "or a module:function)")
        if self.reward_weights is not None:
            if isinstance(self.reward_weights, (int, float)):
                self.reward_weights = [self.reward_weights]
            if len(self.reward_weights) != len(self.rewards):
                raise UserError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                                f"{len(self.rewards)} reward functions; give one per function")
            self.reward_weights = _reward_weights(self.reward_weights)
        if (self.importance_sampling_correction and self.loss_type == "vespo"
                and not self.importance_sampling_mode.startswith("token")):
            raise UserError(f"grpo.loss_type vespo folds the sampler correction into its per-token weights: set "
                            f"grpo.importance_sampling_mode to token_truncate or token_mask, not "
                            f"{self.importance_sampling_mode}")
        lo, hi = self.importance_sampling_clip_min, self.importance_sampling_clip_max
        if lo is not None and hi is not None and lo > hi:
            raise UserError(f"grpo.importance_sampling_clip_min ({lo}) is above grpo.importance_sampling_clip_max "
                            f"({hi}); give a range [min, max]")
        if not self.reference.strip():
            raise UserError("grpo.reference must be base or a zoo checkpoint path, got ''")
        if self.reward_clip_range is not None:
            r = self.reward_clip_range
            if not (isinstance(r, list) and len(r) == 2 and all(isinstance(x, (int, float)) for x in r)
                    and r[0] < r[1]):
                raise UserError(f"grpo.reward_clip_range must be [low, high] with low < high, got {r}")


def _reward_weights(weights: list[Any]) -> list[float]:
    """``grpo.reward_weights`` as floats: finite (a negative weight penalizes what its function rewards), and not
    all 0 (the total reward would be 0 for every completion: no advantage, nothing learned)."""
    try:
        out = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise UserError(f"grpo.reward_weights must be numbers, got {weights!r}") from None
    if not all(math.isfinite(w) for w in out):
        raise UserError(f"grpo.reward_weights must be finite numbers, got {weights!r}")
    if not any(out):
        raise UserError(f"grpo.reward_weights are all 0 ({weights!r}): every completion's reward would be 0 and "
                        "nothing is learned; give at least one function a nonzero weight")
    return out


@dataclass
class PromptDataSection(ChatDataSection):
    """GRPO's data keys: rows with a prompt (text, or a message list rendered with the chat template)."""

    prompt_field: str = "prompt"  # the column holding each row's prompt; the other columns go to the rewards
    # the longest prompt, in tokens (longer ones: data.long_examples, truncate keeps the end)
    seq_len: int = field(default=512, metadata={"range": "[1, inf)"})
    # prompts with images (a vision-language model): the patches a row holds at most (its images' frames times the
    # tower's patches per frame); None: the largest prompt's (grpo/vision.py)
    max_patches: int | None = field(default=None, metadata={"range": "[1, inf)"})


# The grpo keys a run reads only under a condition (pretrain/config_unread.py).
GRPO_UNREAD: tuple[Unread, ...] = (
    *keys_unread(("grpo.loss_type", "grpo.importance_sampling_level"), lambda c: c.grpo.advantage == "rloo",
                 "is not read with grpo.advantage: rloo, whose loss is its own (one importance ratio per completion, "
                 "as TRL's RLOOTrainer, whose RLOOConfig has no such key): remove it"),
    *keys_unread(("grpo.sapo_temperature_pos", "grpo.sapo_temperature_neg"),
                 lambda c: c.grpo.loss_type != "sapo" or c.grpo.advantage == "rloo",
                 "is read by grpo.loss_type sapo only: remove it, or set grpo.loss_type=sapo"),
    *keys_unread(("grpo.vespo_k_pos", "grpo.vespo_lambda_pos", "grpo.vespo_k_neg", "grpo.vespo_lambda_neg"),
                 lambda c: c.grpo.loss_type != "vespo" or c.grpo.advantage == "rloo",
                 "is read by grpo.loss_type vespo only: remove it, or set grpo.loss_type=vespo"),
    *keys_unread(("grpo.importance_sampling_correction",), lambda c: c.grpo.advantage == "rloo",
                 "is read by the token surrogates (grpo.advantage group, reinforce_pp, reinforce_pp_baseline), not "
                 "RLOO's loss: remove it"),
    *keys_unread(("grpo.importance_sampling_mode", "grpo.importance_sampling_clip_min",
                  "grpo.importance_sampling_clip_max"), lambda c: not c.grpo.importance_sampling_correction,
                 "is read with grpo.importance_sampling_correction=true only: set it, or remove this key"),
    Unread("grpo.scale_rewards", lambda c: c.grpo.advantage != "group",
           "scales group advantages (grpo.advantage: group); {cfg.grpo.advantage}'s are not (RLOO's by "
           "grpo.normalize_advantages, REINFORCE++'s always whitened; TRL's RLOOConfig has no scale_rewards): "
           "remove it"),
    Unread("grpo.reward_clip_range", lambda c: "reward_clip_range" not in ESTIMATOR_KEYS[c.grpo.advantage],
           "is read by grpo.advantage rloo, reinforce_pp and reinforce_pp_baseline; remove it, or choose one of them"),
    Unread("grpo.normalize_advantages", lambda c: "normalize_advantages" not in ESTIMATOR_KEYS[c.grpo.advantage],
           "is RLOO's (grpo.advantage: rloo); group advantages are scaled by grpo.scale_rewards and REINFORCE++'s "
           "are always whitened: remove it"),
    Unread("grpo.max_turns", lambda c: not c.grpo.agentic,
           "counts the turns of episodes with tools; set grpo.tools or grpo.environment, or remove grpo.max_turns"),
    *keys_unread(("grpo.tool_parser", "grpo.tool_timeout"), lambda c: not c.grpo.agentic,
                 "is read by episodes with tools only; set grpo.tools or grpo.environment, or remove it"),
    *keys_unread(("grpo.max_staleness", "grpo.rollout_devices"), lambda c: c.grpo.rollout != "async",
                 "is read by asynchronous rollouts only: set grpo.rollout=async, or remove it"),
    Unread("grpo.reference", lambda c: c.grpo.beta == 0,
           "is the KL term's reference, and grpo.beta is 0 (no KL term, no reference pass): set grpo.beta, or "
           "remove it"),
)


@dataclass
class GRPOConfig(TrainConfig):
    """Everything a GRPO run needs (`grpo train`)."""

    UNREAD: ClassVar[tuple[Unread, ...]] = (*COMMON_UNREAD, TEXT_FIELD_UNREAD, *layout_unread("grpo train"),
                                            *GRPO_UNREAD)

    data: PromptDataSection = field(default_factory=PromptDataSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)

    def check(self) -> None:
        """The shared checks, then the ``grpo:`` section's and the batch against the group size."""
        super().check()
        self.grpo.check()
        g = self.grpo.num_generations
        if self.batch_size % g:
            raise UserError(f"batch_size={self.batch_size} completions must be a multiple of grpo.num_generations="
                            f"{g} (each prompt's {g} completions form a group); e.g. batch_size="
                            f"{max(g, self.batch_size // g * g)}")
        if isinstance(self.data.path, list):
            raise UserError("grpo train reads one prompt dataset: data.path must be a single path, not a mixture")
