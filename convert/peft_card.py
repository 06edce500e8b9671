"""The PEFT adapter's model card and the base model it names (peft's ``base_model_name_or_path``): a Hub repo,
the folder the base was exported to beside the adapter, or the lmzoo checkpoint transformers cannot read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convert.card_origin import meta_at, origin_of
from convert.card_training import trained_with, training_of
from convert.model_card import EvalResults, card_data, eval_lines, public_path, render, training_lines
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.adapter import base_location
from zoo.checkpoints.provenance import hub_id, hub_weights
from zoo.lora.params import WHOLE_WEIGHTS
from zoo.model.config import ModelConfig


def base_hub_repo(ckpt: str | os.PathLike, meta: dict[str, Any]) -> str | None:
    """The Hub repo whose model the adapter's base is, as transformers names its modules, or None.

    The repo comes from the adapter checkpoint's own record (``base_hub_id``), so a run exported without its
    base still names it; for checkpoints written before that record, from the base's model.json (found as
    zoo.checkpoints.adapter finds it: beside a moved run too). A base converted from a multimodal Gemma 3 repo has
    none: the adapter's module names are those of the text-only model that `zoo export` writes, not of the
    repo's multimodal one.
    """
    if meta["lora"].get("base_hub_id"):
        return str(meta["lora"]["base_hub_id"])
    base_meta = meta_at(base_location(ckpt, meta))  # a base moved together with the run: its model.json there
    return hub_weights(base_meta) if base_meta else None


def base_model_ref(ckpt: str | os.PathLike, meta: dict[str, Any], base_out: str | os.PathLike | None = None) -> str:
    """peft's ``base_model_name_or_path``: the folder ``base_out`` when the base is exported there beside the
    adapter, else the Hub repo the base is (:func:`base_hub_repo`), else the base checkpoint; a local folder as
    :func:`convert.model_card.public_path` writes it (no absolute path of this machine in a published file)."""
    if base_out is not None:
        return public_path(Path(base_out).absolute())
    return base_hub_repo(ckpt, meta) or public_path(base_location(ckpt, meta))


def _base_story(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, base_out: str | os.PathLike | None
                ) -> tuple[str, bool]:
    """(what the card says the base is, whether transformers loads ``base_ref`` as it is)."""
    base = base_location(ckpt, meta)
    shown = public_path(base)
    base_meta = meta_at(base) or {}
    origin = hub_id(base_meta) or meta["lora"].get("base_hub_id")
    came = f" It comes from the Hub's `{origin}`." if origin else ""
    stored = quant_checkpoint.settings(base_meta)
    if base_out is not None:
        if stored:
            how = (f", dequantized: `{shown}` stores its projections quantized ({quant_checkpoint.describe(*stored)}, "
                   "`zoo quantize`), and the adapters were trained beside those weights (QLoRA)")
        else:
            how = ", merged with its own adapters" if "lora" in base_meta else ""
        text = (f"The base model is `{base_ref}`, which `zoo export --adapter` wrote beside this adapter from the "
                f"lmzoo checkpoint `{shown}`{how}.{came}")
        loads = True
    elif base_hub_repo(ckpt, meta) is None:
        text = (f"The base model is the lmzoo checkpoint `{shown}`, which transformers does not read: export it with "
                f"`zoo export {shown} --out BASE` and load the adapter onto BASE.{came}")
        loads = False
    else:
        text = (f"The base model is the Hub's `{base_ref}`: the adapters were trained on lmzoo's conversion of it "
                "(`zoo convert`).")
        loads = True
    asked = meta["lora"].get("base_quant")
    if asked and not stored:  # QLoRA on a float base: quantized at load, as the run quantized it
        text += (f" The adapters were trained beside its projections quantized "
                 f"({quant_checkpoint.describe(asked['kind'], bool(asked.get('double')))}, QLoRA): on the float "
                 f"base they give nearly the model they were trained in, and `zoo export {public_path(ckpt)}` "
                 "writes that model exactly, merged.")
    return text, loads


def adapter_card(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, targets: list[str], repo_hint: str,
                 base_out: str | os.PathLike | None = None, eval_results: EvalResults | None = None,
                 tokenizer: bool = False) -> str:
    """README.md of the adapter folder: its metadata (``base_model``: the Hub repo the base comes from, as the
    merged export's card records it; the base's license, tags, datasets), the base model (what it is, and where),
    LoRA settings, how it was trained (method, hyperparameters, data, final metrics: convert/model_card.py), the
    `zoo eval` results when given, and how to load it (and its tokenizer, written beside it: ``tokenizer``)."""
    info, training = meta["lora"], meta.get("training") or {}
    story, loads = _base_story(ckpt, meta, base_ref, base_out)
    trained = training_of(ckpt, meta)
    origin = origin_of(ckpt, meta)
    # The Hub repo the base comes from, as the merged export of the same checkpoint records it: the Hub's lineage.
    data = card_data("peft", origin, trained, tags=["lora"], pipeline_tag="text-generation",
                     base_model=origin.hub_repo)
    how = f"{trained_with(training)}."
    # A reward model's adapter (its score head saved whole) loads onto the base read as a sequence classifier.
    kind = "SequenceClassification" if set(WHOLE_WEIGHTS) & set(info.get("params", {})) else "CausalLM"
    if kind == "SequenceClassification":
        data.pipeline_tag = "text-classification"
    vlm = "config" in meta and ModelConfig.from_dict(meta["config"]).vision is not None
    if vlm:  # a vision-language model: transformers' image-text class; peft has no Auto class of its own for it
        data.pipeline_tag = "image-text-to-text"
        where = f"{base_ref}" if loads else "BASE"
        load = ["from peft import PeftModel", "from transformers import AutoModelForImageTextToText",
                f'base = AutoModelForImageTextToText.from_pretrained("{where}")'
                + ("" if loads else f"  # zoo export {base_ref} --out BASE"),
                f'model = PeftModel.from_pretrained(base, "{repo_hint}")']
    elif loads:  # peft loads the base itself, from the Hub or the exported folder
        load = [f"from peft import AutoPeftModelFor{kind}",
                f'model = AutoPeftModelFor{kind}.from_pretrained("{repo_hint}")']
    else:  # the base is a zoo checkpoint: transformers reads its export
        load = ["from peft import PeftModel", f"from transformers import AutoModelFor{kind}",
                f'base = AutoModelFor{kind}.from_pretrained("BASE")  # zoo export {base_ref} --out BASE',
                f'model = PeftModel.from_pretrained(base, "{repo_hint}")']
    if tokenizer:  # the run's tokenizer files sit beside the adapter, as a trainer's save_model leaves them
        load += ["from transformers import AutoTokenizer", f'tokenizer = AutoTokenizer.from_pretrained("{repo_hint}")']
    return render(data, [
        f"# {repo_hint}", "",
        f"A LoRA adapter for `{base_ref}`: rank {info['rank']}, alpha {info['alpha']}"
        f"{' (rsLoRA)' if info['rslora'] else ''}, on {', '.join(targets)}. {how}", "",
        "## Base model", "", story, "",
        *(["## Training", "", *training_lines(trained)] if trained is not None else []),
        *eval_lines(eval_results),
        "## How to load", "", "```python", *load, "```", "",
    ])
