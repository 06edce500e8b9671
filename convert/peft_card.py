"""The PEFT adapter's model card and the base model it names (peft's ``base_model_name_or_path``): a Hub repo,
the folder the base was exported to beside the adapter, or the lmzoo checkpoint transformers cannot read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from convert.card_origin import meta_at, origin_of
from convert.card_training import trained_with, training_of
from convert.model_card import EvalResults, card_data, eval_lines, render, training_lines
from zoo.checkpoints import quantized as quant_checkpoint
from zoo.checkpoints.adapter import base_location
from zoo.checkpoints.provenance import hub_id, hub_weights
from zoo.lora.params import WHOLE_WEIGHTS


def base_model_ref(ckpt: str | os.PathLike, meta: dict[str, Any], base_out: str | os.PathLike | None = None) -> str:
    """peft's ``base_model_name_or_path``: the folder ``base_out`` when the base is exported there beside the
    adapter, else the Hub repo id whose model the base is, else the base checkpoint's path.

    The repo comes from the adapter checkpoint's own record (``base_hub_id``), so a run exported without its
    base still names it; for checkpoints written before that record, from the base's model.json (found as
    zoo.checkpoints.adapter finds it: beside a moved run too). A base converted from a multimodal Gemma 3 repo gets its
    path: the adapter's module names are those of the text-only model that `zoo export` writes, not of the
    repo's multimodal one.
    """
    if base_out is not None:
        return str(Path(base_out).absolute())
    if meta["lora"].get("base_hub_id"):
        return str(meta["lora"]["base_hub_id"])
    base = base_location(ckpt, meta)  # a base moved together with the run: its model.json there
    base_meta = meta_at(base)
    return (hub_weights(base_meta) if base_meta else None) or str(base)


def _base_story(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, base_out: str | os.PathLike | None
                ) -> tuple[str, bool]:
    """(what the card says the base is, whether transformers loads ``base_ref`` as it is)."""
    base = base_location(ckpt, meta)
    base_meta = meta_at(base) or {}
    origin = hub_id(base_meta) or meta["lora"].get("base_hub_id")
    came = f" It comes from the Hub's `{origin}`." if origin else ""
    stored = quant_checkpoint.settings(base_meta)
    if base_out is not None:
        if stored:
            how = (f", dequantized: `{base}` stores its projections quantized ({quant_checkpoint.describe(*stored)}, "
                   "`zoo quantize`), and the adapters were trained beside those weights (QLoRA)")
        else:
            how = ", merged with its own adapters" if "lora" in base_meta else ""
        text = (f"The base model is `{base_ref}`, which `zoo export --adapter` wrote beside this adapter from the "
                f"lmzoo checkpoint `{base}`{how}.{came}")
        loads = True
    elif base_ref == str(base):
        text = (f"The base model is the lmzoo checkpoint `{base}`, which transformers does not read: export it with "
                f"`zoo export {base} --out BASE` and load the adapter onto BASE.{came}")
        loads = False
    else:
        text = (f"The base model is the Hub's `{base_ref}`: the adapters were trained on lmzoo's conversion of it "
                "(`zoo convert`).")
        loads = True
    asked = meta["lora"].get("base_quant")
    if asked and not stored:  # QLoRA on a float base: quantized at load, as the run quantized it
        text += (f" The adapters were trained beside its projections quantized "
                 f"({quant_checkpoint.describe(asked['kind'], bool(asked.get('double')))}, QLoRA): on the float "
                 f"base they give nearly the model they were trained in, and `zoo export {ckpt}` writes that "
                 "model exactly, merged.")
    return text, loads


def adapter_card(ckpt: str | os.PathLike, meta: dict[str, Any], base_ref: str, targets: list[str], repo_hint: str,
                 base_out: str | os.PathLike | None = None, eval_results: EvalResults | None = None) -> str:
    """README.md of the adapter folder: its metadata (base model where it is a Hub repo, the base's license,
    tags, datasets), the base model (what it is, and where), LoRA settings, how it was trained (method,
    hyperparameters, data, final metrics: convert/model_card.py), the `zoo eval` results when given, and how
    to load it."""
    info, training = meta["lora"], meta.get("training") or {}
    story, loads = _base_story(ckpt, meta, base_ref, base_out)
    trained = training_of(ckpt, meta)
    data = card_data("peft", origin_of(ckpt, meta), trained, tags=["lora"], pipeline_tag="text-generation",
                     # a Hub repo: the Hub links the adapter to it
                     base_model=base_ref if loads and base_out is None else None)
    how = f"{trained_with(training)}."
    # A reward model's adapter (its score head saved whole) loads onto the base read as a sequence classifier.
    kind = "SequenceClassification" if set(WHOLE_WEIGHTS) & set(info.get("params", {})) else "CausalLM"
    if kind == "SequenceClassification":
        data.pipeline_tag = "text-classification"
    if loads:  # peft loads the base itself, from the Hub or the exported folder
        load = [f"from peft import AutoPeftModelFor{kind}",
                f'model = AutoPeftModelFor{kind}.from_pretrained("{repo_hint}")']
    else:  # the base is a zoo checkpoint: transformers reads its export
        load = ["from peft import PeftModel", f"from transformers import AutoModelFor{kind}",
                f'base = AutoModelFor{kind}.from_pretrained("BASE")  # zoo export {base_ref} --out BASE',
                f'model = PeftModel.from_pretrained(base, "{repo_hint}")']
    return render(data, [
        f"# {repo_hint}", "",
        f"A LoRA adapter for `{base_ref}`: rank {info['rank']}, alpha {info['alpha']}"
        f"{' (rsLoRA)' if info['rslora'] else ''}, on {', '.join(targets)}. {how}", "",
        "## Base model", "", story, "",
        *(["## Training", "", *training_lines(trained)] if trained is not None else []),
        *eval_lines(eval_results),
        "## How to load", "", "```python", *load, "```", "",
    ])
