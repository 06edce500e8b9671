"""The set-up of a run, written once for training and ``--compile-only``: the mesh, the model the task trains
(a zoo checkpoint or a random init sharded onto the mesh; QLoRA's quantized base; the task's own change, a reward
model's score head), the task's frozen inputs and the train state with its jitted step.

Each array the set-up holds is got through an :class:`Arrays`: a run makes or reads it (:data:`RUN`), while
``--compile-only`` (:data:`LAYOUT`) keeps its layout alone, ``jax.ShapeDtypeStruct`` s with their shardings, taken
from the same description (a jitted function's ``jax.eval_shape``, or the layout a checkpoint is read into): one
description of the state, never a second one for the compiler."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar, cast

import jax

from pretrain.config import TrainConfig
from pretrain.dtypes import DTYPES
from zoo.checkpoints.format import TOKENIZER_DIR, read_config
from zoo.checkpoints.loading import load_params
from zoo.data.tokenizer import holds_tokenizer, tokenizer_dir
from zoo.errors import UserError
from zoo.lora.params import LoraConfig, init_lora, lora_specs, vision_targets, whole_weights
from zoo.lora.vision_targets import VISION_TARGETS
from zoo.lora.weights import LoraRun, Weights
from zoo.model.config import ModelConfig
from zoo.model.context import check_context
from zoo.model.params import flatten, init_params, nest, param_specs
from zoo.model.sharding import make_mesh, named_sharding
from zoo.storage import is_remote, local_copy, run_path

T = TypeVar("T")


class Arrays:
    """How the set-up gets its arrays and models: a run's made (a jitted function called) or read (a checkpoint's
    config and weights)."""

    abstract: ClassVar[bool] = False

    def made(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``: ``fn`` jitted with its ``out_shardings``, so its result's layout is its own."""
        return fn(*args)

    def read(self, layout: T, read: Callable[[], T]) -> T:
        """``read()``: arrays read into ``layout`` (``jax.ShapeDtypeStruct`` s with their shardings)."""
        return read()

    def model_config(self, cfg: TrainConfig) -> tuple[ModelConfig, Path | None]:
        """(the run's model config, the zoo checkpoint it starts from or None for ``model.init: random``)."""
        if cfg.model.init == "random":
            from zoo.model.from_hf import model_config_from_hf
            from zoo.registry import catalogue as registry

            name = cast(str, cfg.model.config)  # model.init: random needs it (TrainConfig checks)
            return model_config_from_hf(registry.hf_config_of(name, "model.config"), f"model.config {name}"), None
        return self.checkpoint_config(cast(str, cfg.model.path), "model.path")

    def checkpoint_config(self, name: str, key: str) -> tuple[ModelConfig, Path | None]:
        """(the model config, the folder) of the zoo checkpoint ``name`` (a run folder gives its checkpoint; the
        config key ``key`` names it in errors)."""
        from zoo.checkpoints.paths import checkpoint_dir

        ckpt = checkpoint_dir(name, key)
        return read_config(ckpt), ckpt


class Layouts(Arrays):
    """``--compile-only``'s arrays: each one's layout alone (nothing computed, read or allocated); a model's
    config read without weights (a zoo checkpoint, a registry name or a Hugging Face ``config.json``)."""

    abstract = True

    def made(self, fn: Callable[..., T], *args: Any) -> T:
        """``jax.eval_shape`` of the jitted ``fn``: its result's shapes, dtypes and shardings."""
        return cast(T, jax.eval_shape(fn, *args))

    def read(self, layout: T, read: Callable[[], T]) -> T:
        """``layout`` itself: nothing is read."""
        return layout

    def checkpoint_config(self, name: str, key: str) -> tuple[ModelConfig, Path | None]:
        """(the model config, the folder if a zoo checkpoint, else None) of ``name`` read without weights: a zoo
        checkpoint folder, a registry name or a Hugging Face ``config.json``."""
        if not name:
            raise UserError(f"--compile-only needs {key} (a zoo checkpoint, a registry name or a config.json)")
        src = _resolve_checkpoint(name, key) if is_remote(name) else Path(name).expanduser()
        return model_config_of(name, key), src if (src / "model.json").is_file() else None


RUN = Arrays()
LAYOUT = Layouts()


def model_config_of(name: str, key: str) -> ModelConfig:
    """The ModelConfig of ``name`` read without weights: a zoo checkpoint folder, a registry name with a released
    config or a Hugging Face ``config.json``; errors name ``key`` (the flag or config key that gave it)."""
    from zoo.model.from_hf import model_config_from_hf
    from zoo.registry import catalogue as registry

    src = _resolve_checkpoint(name, key) if is_remote(name) else Path(name).expanduser()
    if src.is_dir() and (src / "model.json").is_file():
        return read_config(src)
    return model_config_from_hf(registry.hf_config_of(name, key), f"{key} {name}")


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """The tokenizer's ids the set-up bakes into programs: its EOS (a sampler's stop) and padding (a reward model's
    pooling) ids, or None where it has none. ``--compile-only`` reads no tokenizer: :meth:`stand_in` ids fill
    the same constants, which change no shape."""

    eos: int | None
    pad: int | None

    @classmethod
    def of(cls, tokenizer: Any) -> TokenIds:
        """The ids of ``tokenizer`` (a Hugging Face tokenizer)."""
        return cls(tokenizer.eos_token_id, tokenizer.pad_token_id)

    @classmethod
    def stand_in(cls, mcfg: ModelConfig) -> TokenIds:
        """Ids for a set-up without a tokenizer (``--compile-only``): the last id as EOS, the model's padding id
        (or 0)."""
        return cls(mcfg.vocab_size - 1, mcfg.pad_token_id or 0)


@dataclasses.dataclass
class Model:
    """The model a run trains, on its mesh: its config, its starting params (LoRA's frozen base: QLoRA's
    quantized), the LoRA settings (None: full fine-tuning) and the checkpoint it starts from (None: a random
    init; under ``--compile-only`` a zoo checkpoint folder if ``model.path`` is one), on its mesh."""

    mcfg: ModelConfig
    params: dict[str, Any]
    lora: LoraConfig | None
    source: Path | None
    mesh: jax.sharding.Mesh

    @property
    def frozen(self) -> dict[str, Any] | None:
        """With LoRA only the adapters are trained; the base is a frozen, undifferentiated input of the step."""
        return self.params if self.lora else None

    def weights(self, trained: Any) -> Weights:
        """The weights whose trained params are ``trained`` (the train state's), as rollouts, evaluation and
        ``--compile-only``'s other programs compute with them (no dropout): LoRA's adapters on the frozen base, or
        the whole model."""
        return Weights.of(trained, self.frozen, LoraRun.of(self.lora))


def run_mesh(cfg: TrainConfig, devices: list[Any], where: str = "devices") -> jax.sharding.Mesh:
    """The run's device mesh (``cfg.mesh``) over ``devices`` (``where`` names them in errors), checked against
    the batch it splits."""
    sizes = dataclasses.asdict(cfg.mesh)
    try:
        mesh = make_mesh(**sizes, devices=devices)
    except ValueError as e:
        raise UserError(f"mesh {sizes}{'' if where == 'devices' else f' on {where}'}: {e}") from None
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.batch_size // cfg.grad_accum
    if micro % shards:
        raise UserError(f"batch_size/grad_accum = {micro} sequences must divide over data x fsdp = {shards} {where}")
    return mesh


def param_layout(mcfg: ModelConfig, mesh: jax.sharding.Mesh, dtype: Any) -> dict[str, Any]:
    """The params of ``mcfg`` as ``jax.ShapeDtypeStruct`` s of ``dtype`` sharded on ``mesh`` as a run places them."""
    return nest({k: jax.ShapeDtypeStruct(s.shape, dtype, sharding=named_sharding(mesh, s.axes, s.shape))
                 for k, s in param_specs(mcfg).items()})


def layout_of(tree: Any) -> Any:
    """The layout (``jax.ShapeDtypeStruct`` s with their shardings) of a tree of arrays or of layouts."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def set_up_model(cfg: TrainConfig, mesh: jax.sharding.Mesh, arrays: Arrays) -> Model:
    """The model the run starts from (:class:`Model`): loaded (or randomly initialized) onto ``mesh``, its frozen
    base quantized for QLoRA (:func:`frozen_base_quant`); the task's change comes after
    (:meth:`pretrain.task.Task.adapt_model`)."""
    check_base_quant(cfg)
    mcfg, ckpt = arrays.model_config(cfg)
    mcfg = dataclasses.replace(mcfg, attention=cfg.model.attention)  # a run's choice, never saved (zoo.kernels.choice)
    check_context(mcfg, cfg.mesh.context)
    lora = lora_settings(cfg)
    if lora is not None:
        check_vision_lora(cfg, mcfg, lora)
    pdt = DTYPES[cfg.dtype.params]
    if cfg.model.init == "random":
        shard = jax.tree.map(lambda x: x.sharding, param_layout(mcfg, mesh, pdt))
        # No host inputs: every process builds the same global arrays, each its own shards.
        init = jax.jit(lambda: init_params(mcfg, jax.random.PRNGKey(cfg.seed), pdt), out_shardings=shard)
        return Model(mcfg, arrays.made(init), lora, None, mesh)
    quantized = frozen_base_quant(cfg, ckpt) if lora else None
    layout = param_layout(mcfg, mesh, pdt)
    if quantized is None:
        return Model(mcfg, arrays.read(layout, lambda: load_params(cast(Path, ckpt), mesh, pdt)), lora, ckpt,
                     mesh)
    from zoo.checkpoints.quantized import abstract_base

    # QLoRA: the projections quantized and placed one at a time, so the float base is never whole in memory
    layout = nest({**flatten(layout), **abstract_base(mcfg, *quantized, pdt, mesh)})
    return Model(mcfg, arrays.read(layout, lambda: _quantized_base(cfg, mcfg, mesh, cast(Path, ckpt), quantized)),
                 lora, ckpt, mesh)


def _quantized_base(cfg: TrainConfig, mcfg: ModelConfig, mesh: jax.sharding.Mesh, ckpt: Path,
                    q: tuple[str, bool]) -> dict[str, Any]:
    """QLoRA's base read from ``ckpt``: every weight but the projections as stored, then each projection loaded,
    quantized (zoo/model/quant.py) and placed one at a time; the quantized fields are split over ``fsdp``
    (:func:`zoo.model.quant.place`). A checkpoint stored quantized gives its fields as they are."""
    from zoo.checkpoints.loading import quantized_param
    from zoo.model import quant

    pdt = DTYPES[cfg.dtype.params]
    skip = quant.quantized_paths(mcfg)
    flat = flatten(load_params(ckpt, mesh, pdt, paths=[p for p in param_specs(mcfg) if p not in skip]))
    for path in skip:
        flat[path] = quant.place(quantized_param(ckpt, path, *q, dtype=pdt), mesh)
    return nest(flat)


def tokenizer_folder(cfg: TrainConfig) -> Path:
    """The run's tokenizer folder: ``model.tokenizer`` (a tokenizer folder, or a zoo checkpoint: its
    ``tokenizer/``), else the model checkpoint's own.

    A folder without tokenizer files is a UserError here, naming the setting
    that gives one (zoo.data.tokenizer.load_tokenizer reads the folder afterwards).
    """
    if cfg.model.tokenizer or cfg.model.init == "random":
        folder = tokenizer_dir(_tokenizer_copy(cfg.model.tokenizer or ""))
    else:
        folder = tokenizer_dir(_resolve_checkpoint(cast(str, cfg.model.path)))
    if not holds_tokenizer(folder):
        raise UserError(f"no tokenizer in {folder}; set model.tokenizer to a tokenizer folder or a zoo checkpoint "
                        "with one")
    return folder


def _tokenizer_copy(spec: str) -> Path:
    """``model.tokenizer`` on the local disk: a URL (a tokenizer folder, or a zoo checkpoint's ``tokenizer/``
    only, not its weights) fetched into lmzoo's cache."""
    if is_remote(spec) and (run_path(spec, "model.tokenizer") / "model.json").exists():
        return local_copy(f"{spec.rstrip('/')}/{TOKENIZER_DIR}", "model.tokenizer")
    return local_copy(spec, "model.tokenizer")


def _resolve_checkpoint(path: str, key: str = "model.path") -> Path:
    """The zoo checkpoint folder of ``path`` (``key``'s; a URL: its copy in lmzoo's cache; a run folder, a missing
    path: a UserError saying what to give)."""
    from zoo.checkpoints.paths import checkpoint_dir

    return checkpoint_dir(path, key)


def lora_settings(cfg: TrainConfig) -> LoraConfig | None:
    """The run's LoRA settings (None when ``lora.rank`` is 0: full fine-tuning)."""
    if cfg.lora.rank and cfg.model.init == "random":
        raise UserError("lora needs a pretrained base checkpoint (model.path), not model.init: random")
    return lora_config(cfg)


def check_vision_lora(cfg: TrainConfig, mcfg: ModelConfig, lora: LoraConfig) -> None:
    """A UserError, before step 1, where ``lora.targets`` name an image tower or connector (``vision.*``,
    ``projector.*``) that the model lacks (no tower, or no such weight in its tower: ``vision.q_proj`` on a Qwen
    tower, whose q/k/v are one ``vision.qkv``), or that ``model.freeze`` keeps as it is: adapters on a frozen part
    would contradict the freeze (LoRA leaves every base weight as it is; the freeze is then the adapters' absence)."""
    named = vision_targets(lora, named=True)
    if named and mcfg.vision is None:
        raise UserError(f"lora.targets name an image tower or connector ({', '.join(named)}), and the model "
                        f"({mcfg.family}) has none; name the language model's projections alone")
    if named and mcfg.vision is not None:  # a name the tower has no weight for would adapt nothing there
        have = param_specs(mcfg)
        absent = [t for t in named if not any(w in have for w in VISION_TARGETS[t])]
        if absent:
            takes = [t for t in VISION_TARGETS if any(w in have for w in VISION_TARGETS[t])]
            raise UserError(f"lora.targets name {', '.join(absent)}, which this {mcfg.family} model's image tower "
                            f"and connector do not have; they take {', '.join(takes)}")
    frozen = [t for t in vision_targets(lora, cfg=mcfg) if t.partition(".")[0] in cfg.model.freeze]
    if frozen:
        parts = sorted({t.partition(".")[0] for t in frozen})
        raise UserError(f"lora.targets adapt {', '.join(frozen)}, and model.freeze keeps {', '.join(parts)} as it "
                        f"is; drop {', '.join(parts)} from model.freeze to train adapters there, or those targets "
                        "to keep it frozen")


def lora_config(cfg: TrainConfig) -> LoraConfig | None:
    """The config's LoRA settings as a :class:`zoo.lora.params.LoraConfig` (None when ``lora.rank`` is 0)."""
    lo = cfg.lora
    if lo.rank == 0:
        return None
    targets = lo.targets
    if isinstance(targets, str) and "," in targets:  # `lora.targets=q_proj,v_proj` on the command line
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, targets=targets, rslora=lo.rslora)


def frozen_base_quant(cfg: TrainConfig, ckpt: Path | None) -> tuple[str, bool] | None:
    """How the run's frozen base is quantized, (kind, double) or None: ``lora.base_quant``, or for a LoRA run on
    a checkpoint stored quantized (``zoo quantize``), the checkpoint's own quantization (a different
    ``lora.base_quant`` is an error: the float weights are not there to quantize otherwise)."""
    from zoo.checkpoints import quantized as quant_checkpoint
    from zoo.checkpoints.format import read_meta

    check_base_quant(cfg)
    lo = cfg.lora
    asked = (lo.base_quant, lo.base_quant_double) if lo.base_quant else None
    stored = quant_checkpoint.settings(read_meta(ckpt)) if ckpt is not None else None
    if stored is None or lo.rank <= 0:  # full fine-tuning reads a quantized checkpoint dequantized
        return asked
    if asked is not None and asked != stored:
        raise UserError(f"model.path {cfg.model.path} is stored quantized ({quant_checkpoint.describe(*stored)}); "
                        f"lora.base_quant {lo.base_quant} (base_quant_double {str(lo.base_quant_double).lower()}) "
                        "asks for another: leave lora.base_quant unset, or start from the float checkpoint")
    return stored


def check_base_quant(cfg: TrainConfig) -> None:
    """The QLoRA settings make sense (before anything is loaded or written)."""
    from zoo.model import quant

    lo = cfg.lora
    if lo.base_quant is None:
        if lo.base_quant_double:
            raise UserError("lora.base_quant_double needs lora.base_quant: nf4")
        return
    if lo.base_quant not in quant.KINDS:
        raise UserError(f"lora.base_quant {lo.base_quant!r}: choose one of {', '.join(quant.KINDS)} (or leave it unset)")
    if lo.base_quant_double and lo.base_quant != "nf4":
        raise UserError("lora.base_quant_double applies to lora.base_quant: nf4 only")
    if lo.rank <= 0:
        raise UserError("lora.base_quant quantizes the frozen base of a LoRA run: set lora.rank too")
    if cfg.model.init == "random":
        raise UserError("lora.base_quant needs a pretrained base checkpoint (model.path), not model.init: random")


def adapter_init(mcfg: ModelConfig, lora_cfg: LoraConfig, seed: int, mesh: jax.sharding.Mesh) -> Callable[..., Any]:
    """Fresh float32 adapters (B = 0: the model starts as the base), each sharded like its base weight, as a
    jitted function of the weights trained whole (a reward model's score head,
    :func:`zoo.lora.params.whole_weights`), which start as the params' (:func:`whole_of`)."""
    specs = lora_specs(mcfg, lora_cfg)
    shard = nest({p: named_sharding(mesh, s.axes, s.shape) for p, s in specs.items()})
    # No host inputs: every process builds the same global arrays, each its own shards.
    init: Callable[..., Any] = jax.jit(
        lambda w: init_lora(mcfg, lora_cfg, jax.random.PRNGKey(seed + 1), "float32", nest(w)), out_shardings=shard)
    return init


def whole_of(mcfg: ModelConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The weights of ``params`` a LoRA run trains whole (:func:`zoo.lora.params.whole_weights`), flat."""
    return {p: v for p, v in flatten(params).items() if p in whole_weights(mcfg)}
