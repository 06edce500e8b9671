"""What `zoo serve` serves: a checkpoint (a run's final model, or an adapter checkpoint read merged over its base,
as `zoo generate` reads it), its tokenizer, chat template and end-of-sequence ids, the LoRA adapters a request may
name, and the engine over them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chat.tool_calls import PARSERS, Parser, detect
from zoo.errors import UserError


@dataclass
class Served:
    """The engine and what the routes need beside it: the base's ``name``, the ``adapters`` a request's ``model``
    may name, the tokenizer, the EOS ids every request ends on, the context (``max_len``), the chat template's
    source (None: the tokenizer has none) and its family's tool-call parser (None: it renders no calls); a
    vision-language model's image expander (:class:`chat.images.ImageExpander`, from its processor files; None for
    a text model)."""

    name: str
    engine: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    max_len: int
    vocab_size: int
    template: str | None
    parser: Parser | None
    expander: Any = None

    @property
    def adapters(self) -> tuple[str, ...]:
        """The names of the adapters a request may pick by its ``model``."""
        return tuple(self.engine.adapter_names)


def served_name(ckpt: str | Path) -> str:
    """The default name of the base model: its folder's name (a run's, for its ``final/`` folder)."""
    path = Path(ckpt).resolve()
    return path.parent.name if path.name == "final" else path.name


def parse_adapters(specs: list[str] | None) -> list[tuple[str, str]]:
    """``--adapter NAME=PATH`` flags as (name, path) pairs; one-line UserErrors for a malformed or repeated one."""
    out: list[tuple[str, str]] = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--adapter {spec!r}: write it as NAME=PATH (a name for requests' \"model\" and an "
                            "adapter checkpoint)")
        if name in {n for n, _ in out}:
            raise UserError(f"--adapter {name}: the name is given twice; give each adapter its own name")
        out.append((name, path))
    return out


def load_adapter(name: str, path: str, base: Path, base_meta: dict[str, Any]) -> tuple[dict, float]:
    """An adapter checkpoint trained on ``base``: (its adapter tree, its scale), as the engine takes them."""
    from zoo.checkpoints.adapter import base_checkpoint, base_digest, is_adapter, load_adapters
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.lora.params import whole_weights
    from zoo.model.config import ModelConfig

    ckpt = checkpoint_dir(path, f"--adapter {name}")
    meta = read_meta(ckpt)
    if not is_adapter(meta):
        raise UserError(f"--adapter {name}: {ckpt} is not an adapter checkpoint (a LoRA run's final/ folder); "
                        "serve a full model on its own: zoo serve " + str(ckpt))
    info = meta["lora"]
    same = (info["base_digest"] == base_digest(base_meta) if "base_digest" in info
            else base_checkpoint(ckpt, meta).resolve() == base.resolve())
    if not same:
        raise UserError(f"--adapter {name}: {ckpt} was trained on another base than {base}; serve it over its own "
                        "base (zoo serve BASE --adapter ...)")
    if info.get("base_quant"):
        raise UserError(f"--adapter {name}: {ckpt} was trained on a quantized base (QLoRA); serve its merged model "
                        f"instead: zoo serve {ckpt}")
    if whole_weights(ModelConfig.from_dict(meta["config"])):
        raise UserError(f"--adapter {name}: {ckpt} trains weights whole beside its adapters (a reward model's "
                        "head), not a causal LM's adapters")
    return load_adapters(ckpt, meta), float(info["scale"])


def load_served(ckpt: str, *, name: str | None, adapters: list[tuple[str, str]], max_seqs: int,
                max_len: int | None, page_size: int, dtype: str = "float32") -> Served:
    """Load ``ckpt`` (merged over its base where it is an adapter checkpoint), its tokenizer and the ``adapters``,
    and build the engine (weights and KV cache in ``dtype``: float32 or bfloat16, as `zoo generate --dtype`)."""
    import jax.numpy as jnp

    import zoo
    from eval.engine.engine import Engine
    from eval.generate_cli import eos_ids_of
    from zoo.checkpoints.format import read_meta
    from zoo.checkpoints.paths import checkpoint_dir
    from zoo.data.tokenizer import load_tokenizer

    path = checkpoint_dir(ckpt)
    name = name or served_name(path)
    if name in {n for n, _ in adapters}:
        raise UserError(f"--adapter {name}: the base model is served as {name!r} already; name the adapter "
                        "otherwise or set --served-model-name")
    cfg = zoo.read_config(path)
    context = max_len or min(cfg.max_position_embeddings, 4096)
    if context > cfg.max_position_embeddings:
        raise UserError(f"--max-len {context} is more than the model's context ({cfg.max_position_embeddings})")
    tok = load_tokenizer(path)
    base_meta = read_meta(path)
    trees = {n: load_adapter(n, p, path, base_meta) for n, p in adapters}
    model = zoo.load(path, dtype=jnp.dtype(dtype))
    engine = Engine(model.cfg, model.param_dict(), tokenizer=tok, max_seqs=max_seqs, max_len=context,
                    page_size=page_size, adapters=trees)
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    family = detect(template) if template else None
    expander = None
    if cfg.vision is not None:  # images in chat requests, expanded as the model's processor does
        from chat.images import ImageExpander
        from zoo.data.tokenizer import tokenizer_dir

        try:
            expander = ImageExpander.from_folder(tokenizer_dir(str(path)), tok)
        except UserError as e:  # no processor files: the text is still served
            print(f"note: zoo serve answers text only for this model: {e}", flush=True)
    return Served(name=name, engine=engine, tokenizer=tok, eos_ids=eos_ids_of(str(path), tok), max_len=context,
                  vocab_size=cfg.vocab_size, template=template, parser=PARSERS[family] if family else None,
                  expander=expander)
