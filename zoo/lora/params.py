"""LoRA adapters in JAX: a second, small parameter tree trained beside the frozen base weights.

A targeted weight W (stored [*lead, *in, *out], e.g. ``layers.q`` [L, embed,
heads, head_dim]) gets A [*lead, *in, r] and B [*lead, r, *out]; the forward
pass adds ``scale * (dropout(x) @ A) @ B`` to ``x @ W`` (see :func:`zoo.model.decoder.forward`;
dropout only in training).
The adapters keep W's leading ``layers`` (and ``expert``) axes, so they are
scanned with their layer, and W's logical axes on the in/out dims (the rank
axis is replicated), so :func:`zoo.model.sharding.named_sharding` shards each
adapter like its base on any mesh.

Targets use Hugging Face module names (``q_proj`` ... ``down_proj``), as peft
does; ``experts.gate_proj`` ... (:data:`EXPERT_TARGETS`) narrow an MLP name to
the routed experts, the shared experts or the dense MLP, and the MoE router is
never adapted (naming it is an error). Each routed expert has its own adapter,
run inside the grouped expert matmul (:mod:`zoo.layers.moe`). DeepSeek's multi-head
latent attention (q_a/q_b/kv_a/kv_b/o of an MLA model) has no adapters:
attention targets are skipped on MLA models, and only the MLP projections
(dense, routed experts and shared experts) are adapted. Gemma 4's routed
experts keep gate and up fused in one ``expert_gate_up`` stack, as
transformers' ``experts.gate_up_proj``: naming gate and up (or
``experts.gate_up_proj``) gives that stack one adapter per expert, as peft's
``target_parameters`` does; naming one of the two alone is an error. Its
dense MLP and attention (the full layers' ``global_*`` weights too) are
adapted as any model's.

A vision-language model's image tower and connector are adapted only where
named (:data:`VISION_TARGETS`, :mod:`zoo.lora.vision_targets`): ``vision.q_proj`` ...
``vision.down_proj`` and ``vision.qkv`` (the tower's projections, under the text names; transformers' own
spellings, :data:`VISION_ALIASES`, name the same) and ``projector.proj``, ``projector.fc1``, ``projector.fc2``,
``projector.deepstack.fc1``, ``projector.deepstack.fc2`` (the connectors). The bare names, ``all`` and ``all-linear`` name the language
model's projections alone, so a text recipe adapts a VLM's language model only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from zoo.errors import UserError
from zoo.lora.vision_targets import VISION_ALIASES, VISION_TARGETS, tower_kind, vision_paths
from zoo.model.config import ModelConfig
from zoo.model.params import ParamSpec, flatten, nest, param_specs

# Hugging Face module name -> the zoo weights (suffixes after the layer-stack prefix) it names.
# peft matches a name as a suffix of the module path, so gate_proj also names every expert's and
# the shared experts' gate_proj.
HF_TO_ZOO: dict[str, tuple[str, ...]] = {
    "q_proj": ("q", "attn_gate"),  # Qwen3-Next's q_proj also yields the output gate (stored apart: attn_gate)
    "k_proj": ("k",),
    "v_proj": ("v",),
    "o_proj": ("o",),
    "gate_proj": ("gate", "expert_gate", "shared_gate"),
    "up_proj": ("up", "expert_up", "shared_up"),
    "down_proj": ("down", "expert_down", "shared_down"),
}
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Narrower MoE names, matched like peft's suffixes: ``experts.X`` is every routed expert's X (transformers 5 keeps
# them fused as ``mlp.experts.gate_up_proj`` [experts, 2 * mlp, embed] and ``mlp.experts.down_proj``, the names
# peft's ``target_parameters`` take), ``shared_experts.X`` DeepSeek's shared experts, ``mlp.X`` the dense MLP only.
EXPERT_TARGETS: dict[str, tuple[str, ...]] = {
    "mlp.gate_proj": ("gate",),
    "mlp.up_proj": ("up",),
    "mlp.down_proj": ("down",),
    "experts.gate_proj": ("expert_gate",),
    "experts.up_proj": ("expert_up",),
    "experts.down_proj": ("expert_down",),
    "experts.gate_up_proj": ("expert_gate", "expert_up"),
    "shared_experts.gate_proj": ("shared_gate",),
    "shared_experts.up_proj": ("shared_up",),
    "shared_experts.down_proj": ("shared_down",),
}
HF_TO_ZOO.update(EXPERT_TARGETS)
# Qwen3-Next's linear-attention layers (zoo.layers.linear_attention): transformers' in_proj_qkvz (q, k, v and the
# output gate z, split per head group), in_proj_ba (beta's and the decay's inputs) and out_proj. "all" names them
# on a model that has such layers.
LINEAR_TARGETS: dict[str, tuple[str, ...]] = {
    "in_proj_qkvz": ("lin_q", "lin_k", "lin_v", "lin_z"),
    "in_proj_ba": ("lin_b", "lin_a"),
    "out_proj": ("lin_out",),
    # Qwen3.5's separate projections: in_proj_qkv (q, k, v in blocks), in_proj_z, in_proj_b, in_proj_a
    "in_proj_qkv": ("lin_q", "lin_k", "lin_v"),
    "in_proj_z": ("lin_z",),
    "in_proj_b": ("lin_b",),
    "in_proj_a": ("lin_a",),
}
HF_TO_ZOO.update(LINEAR_TARGETS)
BASE_TARGETS = (*ATTENTION_TARGETS, "gate_proj", "up_proj", "down_proj")  # what "all" names: every projection
# The MoE router's Hugging Face names (Mixtral's block_sparse_moe.gate, DeepSeek's mlp.gate): it stays frozen.
ROUTER_NAMES = ("gate", "router", "mlp.gate", "block_sparse_moe.gate", "mlp.router")

# How many axes after the leading layers (and expert) axes are W's input: o contracts heads and head_dim.
_CONTRACT = {"o": 2}
_CONTRACT["global_o"] = 2  # Gemma 4's full layers' o (zoo.model.layer_layout)
_CONTRACT["lin_out"] = 2  # Qwen3-Next's linear layers' out_proj [value heads, v_dim, embed]
_ALL = ("all", "all-linear")
# Weights a LoRA run trains whole beside the adapters, stored in the adapter tree under their own path: peft's
# ``modules_to_save``, which its SEQ_CLS task type fills with the classification head. A reward model's score head
# (``num_labels``) is new or task-specific, so no frozen copy of it could serve; it is [hidden, num_labels], small.
WHOLE_WEIGHTS = ("score",)


def whole_weights(cfg: ModelConfig) -> tuple[str, ...]:
    """The weights of ``cfg`` that a LoRA run trains whole (:data:`WHOLE_WEIGHTS`): a reward model's score head."""
    return WHOLE_WEIGHTS if cfg.num_labels else ()


@dataclass(frozen=True)
class LoraConfig:
    """LoRA hyper-parameters.

    ``targets``: a list of Hugging Face module names (keys of :data:`HF_TO_ZOO`:
    ``gate_proj`` names the dense MLP's, every expert's and the shared experts'
    gate, ``experts.gate_proj`` only the routed experts'), ``"all"`` (every
    attention and MLP projection, experts included), or a regex, matched in
    full against each module name or its peft-style path
    (``model.layers.0.self_attn.q_proj``, ``model.layers.0.mlp.experts.gate_proj``; a vision-language model's
    language model also as ``model.text_model.layers.0...`` and ``model.language_model.layers.0...``).
    A vision-language model's tower and connector are named apart (:data:`VISION_TARGETS`,
    :data:`VISION_ALIASES`; in a list ``all`` stands for the language model's projections beside them); a regex
    reaches them by their peft paths only, those of the model's family (:data:`zoo.lora.vision_targets.VISION_PATHS`:
    SmolVLM's ``model.vision_model.encoder.layers.0.self_attn.out_proj``, Qwen2.5-VL's
    ``model.visual.blocks.0.attn.qkv``, ...), as peft matches them.
    The router is not a target: naming it is a UserError.
    ``rslora`` scales by alpha/sqrt(rank) instead of alpha/rank. ``dropout`` is
    peft's ``lora_dropout``: in training each adapter reads its input with that
    fraction of elements zeroed (the rest scaled by 1/(1 - dropout)), while the
    base weight reads it whole (:func:`zoo.model.decoder.forward`'s ``lora_dropout``);
    evaluation, inference and merged weights apply none.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] | tuple[str, ...] | str = "all"
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.targets, str):  # a tuple keeps the frozen config hashable (a jit static arg)
            object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1:
            raise UserError(f"lora: rank must be at least 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"lora: dropout must be in [0, 1), got {self.dropout}")
        target_modules(self)  # unknown names fail at construction, not mid-training


def lora_scale(lora_cfg: LoraConfig) -> float:
    """The factor on the adapter's output: alpha/rank, or alpha/sqrt(rank) with rslora."""
    return lora_cfg.alpha / (math.sqrt(lora_cfg.rank) if lora_cfg.rslora else lora_cfg.rank)


# Where transformers keeps a model's decoder layers: a text model's, and a vision-language model's language model
# (SmolVLM / Idefics3, Gemma 3), so a regex written for either picks the language model's projections.
_LM_PREFIXES = ("model.layers.0", "model.text_model.layers.0", "model.language_model.layers.0")


def _kind(cfg: ModelConfig | None) -> str | None:
    """The tower kind whose module paths a regex is matched against (:func:`zoo.lora.vision_targets.vision_paths`):
    the model's; a text model's SmolVLM's (what it records stays what it always was: its tower names adapt
    nothing); None, every tower's, without a model."""
    if cfg is None:
        return None
    return "smolvlm" if cfg.vision is None else tower_kind(cfg.vision.tower, cfg.vision.connector)


def _peft_paths(name: str, towers: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The module paths a regex target is matched against (besides the name itself, for the language model);
    a vision target's from ``towers`` (:func:`zoo.lora.vision_targets.vision_paths`)."""
    if name in VISION_TARGETS:
        return towers.get(name, ())
    group = "self_attn" if name in ATTENTION_TARGETS else "linear_attn" if name in LINEAR_TARGETS else "mlp"
    tail = name if name.startswith("mlp.") else f"{group}.{name}"
    return tuple(f"{prefix}.{tail}" for prefix in _LM_PREFIXES)


def _matches(pattern: re.Pattern[str], name: str, towers: dict[str, tuple[str, ...]]) -> bool:
    """Whether a regex target picks ``name``: its peft paths, or for the language model the name itself."""
    return any(pattern.fullmatch(p) for p in _peft_paths(name, towers)) or (
        name in HF_TO_ZOO and pattern.fullmatch(name) is not None)


def _fewest(names: list[str]) -> tuple[str, ...]:
    """``names`` less those whose weights the names before them (in :data:`HF_TO_ZOO` order) already cover: a
    regex that picks ``gate_proj`` also picks ``experts.gate_proj``, and the record keeps ``gate_proj``."""
    kept: list[str] = []
    covered: set[str] = set()
    for n, weights in (*HF_TO_ZOO.items(), *VISION_TARGETS.items()):
        if n in names and not set(weights) <= covered:
            kept.append(n)
            covered.update(weights)
    return tuple(kept)


def _refuse_router(names: list[str] | tuple[str, ...]) -> None:
    """A UserError when ``names`` name the MoE router: it routes, it is not adapted."""
    router = [n for n in names if n in ROUTER_NAMES]
    if router:
        raise UserError(f"lora: targets name the MoE router ({', '.join(router)}), which stays frozen; name the "
                        "expert projections instead (experts.gate_proj, experts.up_proj, experts.down_proj)")


def _named(names: list[str] | tuple[str, ...]) -> list[str]:
    """A list of targets as :data:`HF_TO_ZOO` / :data:`VISION_TARGETS` names: ``all`` as the language model's
    projections, the tower's transformers spellings as the names they stand for."""
    out: list[str] = []
    for n in names:
        out += BASE_TARGETS if n in _ALL else [VISION_ALIASES.get(n, n)]
    return out


def target_modules(lora_cfg: LoraConfig, cfg: ModelConfig | None = None) -> tuple[str, ...]:
    """The module names ``lora_cfg.targets`` selects: the language model's in :data:`HF_TO_ZOO` order, then the
    image tower's and connector's in :data:`VISION_TARGETS` order. A regex is matched against the tower's module
    paths of the model ``cfg`` (without one, every tower's: a config checked on its own)."""
    valid = ", ".join([*HF_TO_ZOO, *VISION_TARGETS])
    known = {**HF_TO_ZOO, **VISION_TARGETS}
    t = lora_cfg.targets
    if isinstance(t, str):
        if t in _ALL:
            return BASE_TARGETS
        _refuse_router([t])
        if VISION_ALIASES.get(t, t) in VISION_TARGETS:  # one vision name (the command line's lora.targets=vision.q_proj)
            return (VISION_ALIASES.get(t, t),)
        try:
            pattern = re.compile(t)
        except re.error as e:
            raise UserError(f"lora: targets {t!r} is not a valid regex ({e}); or list names from {valid}") from e
        towers = vision_paths(_kind(cfg))
        picked = _fewest([n for n in known if _matches(pattern, n, towers)])
        if not picked:
            raise UserError(f"lora: targets regex {t!r} matches none of {valid}")
        return picked
    _refuse_router(t)
    names = _named(t)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"lora: unknown target modules {unknown}; valid: {valid} (or \"all\", or a regex)")
    if not t:
        raise UserError(f"lora: targets is empty; list names from {valid}, or \"all\"")
    return tuple(n for n in known if n in names)


def vision_targets(lora_cfg: LoraConfig, named: bool = False, cfg: ModelConfig | None = None) -> tuple[str, ...]:
    """The targets of ``lora_cfg`` on a vision-language model's image tower or connector (:data:`VISION_TARGETS`);
    with ``named``, only those named as such (a regex picks them where they are, as peft's does, so a text model's
    ``.*`` is no request for a tower); a regex matched on the model ``cfg``'s tower (:func:`target_modules`)."""
    t = lora_cfg.targets
    if named and isinstance(t, str) and VISION_ALIASES.get(t, t) not in VISION_TARGETS:
        return ()
    return tuple(n for n in target_modules(lora_cfg, cfg) if n in VISION_TARGETS)


def _target_suffixes(cfg: ModelConfig, lora_cfg: LoraConfig) -> set[str]:
    names = tuple(n for n in target_modules(lora_cfg) if n in HF_TO_ZOO)
    if "linear" in cfg.kinds and lora_cfg.targets in _ALL:  # "all": the linear layers' projections too
        names += tuple(LINEAR_TARGETS)
    if cfg.mla:  # MLA's projections have no adapters (see the module docstring)
        names = tuple(n for n in names if n not in ATTENTION_TARGETS)
    suffixes = {s for n in names for s in HF_TO_ZOO[n]}
    fused = suffixes & {"expert_gate", "expert_up"}
    if cfg.parallel_moe and fused:  # Gemma 4's experts: gate and up one stack, adapted whole (module docstring)
        if len(fused) == 1:
            raise UserError(f"lora: targets {lora_cfg.targets!r} adapt the routed experts' {fused.pop()[7:]} "
                            "alone, but Gemma 4 fuses gate and up in one weight; name both (or "
                            "experts.gate_up_proj), or narrow the MLP's names to mlp.gate_proj, mlp.up_proj")
        suffixes = (suffixes - fused) | {"expert_gate_up"}
    if cfg.global_head_dim:  # Gemma 4: full layers' attention weights are stacked apart (zoo.model.layer_layout)
        from zoo.model.layer_layout import ATTENTION_WEIGHTS, GLOBAL

        suffixes |= {GLOBAL + s for s in suffixes if s in ATTENTION_WEIGHTS}
    return suffixes


def _lead(spec: ParamSpec) -> int:
    """How many leading axes the adapters share with W unchanged: layers, and expert for routed experts (none for
    a weight outside the layer stacks: a vision-language model's connector)."""
    if spec.axes[:1] != ("layers",):
        return 0
    return 2 if "expert" in spec.axes[:2] else 1


def adapter_lead(cfg: ModelConfig, path: str) -> int:
    """How many leading axes the adapters of the weight at ``path`` share with it unchanged (layers, experts;
    none for a connector's weight), as :func:`adapter_specs` lays them out."""
    return _lead(_specs(cfg)[path])


@cache
def _specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """:func:`param_specs` once per config (a merged read asks for one weight's at a time)."""
    return param_specs(cfg)


def adapter_specs(spec: ParamSpec, suffix: str, rank: int) -> tuple[ParamSpec, ParamSpec]:
    """(A, B) specs for base weight ``spec``: A is [*lead, *in, rank], B is [*lead, rank, *out].

    A is initialized random ("lora_a") and B "zeros", so a fresh adapter changes nothing.
    """
    lead = _lead(spec)
    split = lead + _CONTRACT.get(suffix, 1)
    shape, axes = spec.shape, spec.axes
    a = ParamSpec(shape[:split] + (rank,), axes[:split] + (None,), "lora_a")
    b = ParamSpec(shape[:lead] + (rank,) + shape[split:], axes[:lead] + (None,) + axes[split:], "zeros")
    return a, b


def lora_specs(cfg: ModelConfig, lora_cfg: LoraConfig) -> dict[str, ParamSpec]:
    """Every adapter parameter, by dotted path: ``<base path>.a`` and ``<base path>.b``; and the weights trained
    whole (:func:`whole_weights`) under their own path, with their own spec.

    A UserError when the targets name no weight of this model (e.g. only
    attention targets on an MLA model).
    """
    suffixes = _target_suffixes(cfg, lora_cfg)
    # A text model has no tower: its targets there adapt nothing, as MLA's attention targets (the run's set-up
    # refuses them where named: pretrain/setup.py).
    tower = {w for n in vision_targets(lora_cfg, cfg=cfg) for w in VISION_TARGETS[n]}
    out: dict[str, ParamSpec] = {}
    for path, spec in param_specs(cfg).items():
        prefix, _, suffix = path.rpartition(".")
        # The bare names are the language model's; the tower's and connector's weights are named whole (tower).
        lm = prefix and suffix in suffixes and not path.startswith(("vision.", "projector."))
        if lm or path in tower:
            out[f"{path}.a"], out[f"{path}.b"] = adapter_specs(spec, suffix, lora_cfg.rank)
    if not out:
        raise UserError(f"lora: targets {lora_cfg.targets!r} name no weight of this {cfg.family} model"
                        + (" (MLA attention has no adapters)" if cfg.mla else ""))
    specs = param_specs(cfg)
    out.update({p: specs[p] for p in whole_weights(cfg)})
    return out


def init_lora(cfg: ModelConfig, lora_cfg: LoraConfig, key: Any, dtype: Any = "float32",
              base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Fresh adapters (nested dict keyed like the params): A ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), B = 0; the
    weights trained whole (:func:`whole_weights`) start as ``base``'s, in ``dtype``.

    That A is peft's default (kaiming-uniform with a=sqrt(5)); B = 0 makes the
    model at step 0 exactly the base. Pure, so it can be jitted with out_shardings.
    """
    import jax
    import jax.numpy as jnp

    specs = sorted(lora_specs(cfg, lora_cfg).items())
    a_specs = [(path, spec) for path, spec in specs if spec.init == "lora_a"]
    # One random draw for every A, cut into pieces: each separate draw would compile its own
    # random-bits kernel (seconds each on CPU), and the adapters are small.
    u = jax.random.uniform(key, (sum(math.prod(s.shape) for _, s in a_specs),), jnp.float32, -1.0, 1.0)
    flat, offset = {}, 0
    for path, spec in a_specs:
        n = math.prod(spec.shape)
        bound = 1.0 / math.sqrt(math.prod(spec.shape[_lead(spec):-1]))  # 1/sqrt(fan_in)
        flat[path] = (bound * u[offset:offset + n].reshape(spec.shape)).astype(dtype)
        offset += n
    whole = whole_weights(cfg)
    if whole and base is None:
        raise ValueError(f"init_lora: {cfg.family} with num_labels trains {whole} whole; pass the base params")
    base_flat = flatten(base or {})
    for path, spec in specs:
        if path in whole:
            flat[path] = jnp.asarray(base_flat[path]).astype(dtype)
        elif spec.init != "lora_a":
            flat[path] = jnp.zeros(spec.shape, dtype)
    return nest(flat)


def lora_delta(a: Any, b: Any, scale: float, lead: int) -> Any:
    """scale * A @ B in W's stored shape (float32): contract A's rank axis with B's, keep ``lead`` axes.

    One compiled program per shape (loading and export merge outside any traced program: eagerly, its casts,
    reshapes, matmul and scaling compiled a program each); the scale is traced, so any scale shares it."""
    return _delta_program()(a, b, scale, lead)


@cache
def _delta_program() -> Any:
    """:func:`_delta` jitted (made at first use: this module is read without JAX, by the configs)."""
    import jax

    return jax.jit(_delta, static_argnums=3)


@cache
def _add_program() -> Any:
    """W + delta in float32, cast back to W's dtype, jitted: one program per shape (eagerly, three)."""
    import jax

    return jax.jit(lambda w, delta: (w.astype("float32") + delta).astype(w.dtype))


def _delta(a: Any, b: Any, scale: Any, lead: int) -> Any:
    import jax.numpy as jnp

    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    in_shape, out_shape = a32.shape[lead:-1], b32.shape[lead + 1:]
    lead_shape = a32.shape[:lead]
    a2 = a32.reshape(lead_shape + (math.prod(in_shape), a32.shape[-1]))
    b2 = b32.reshape(lead_shape + (b32.shape[lead], math.prod(out_shape)))
    return (scale * jnp.matmul(a2, b2)).reshape(lead_shape + in_shape + out_shape)


def merge_lora(cfg: ModelConfig, params: dict[str, Any], lora: dict[str, Any],
               lora_cfg: LoraConfig) -> dict[str, Any]:
    """Base params with each targeted W replaced by W + scale * A @ B, in W's dtype (for load/export); the weights
    trained whole replace the base's (a reward model's score head, in the dtype of the base's final norm where
    the base is a causal LM: its LM head is dropped then, as the run dropped it).

    Only for inference or export: training must keep A and B separate (the
    gradient of a merged weight costs a full weight gradient).
    """
    scale = lora_scale(lora_cfg)
    specs = param_specs(cfg)
    flat, adapters = flatten(params), flatten(lora)
    out = dict(flat)
    whole = whole_weights(cfg)
    if whole:
        out.pop("lm_head", None)
    for path in whole:
        out[path] = adapters[path].astype(flat.get(path, flat["final_norm"]).dtype)
    for path in {p.rpartition(".")[0] for p in adapters if p not in whole}:
        if path not in flat:
            raise UserError(f"lora: adapter for {path!r}, which this {cfg.family} model does not have")
        w = flat[path]
        delta = lora_delta(adapters[f"{path}.a"], adapters[f"{path}.b"], scale, _lead(specs[path]))
        out[path] = _add_program()(w, delta)
    return nest(out)
