"""`zoo init CONFIG --language-model CKPT`: a vision-language model assembled from a text checkpoint.

The language model (weights, tokenizer, chat template's turns) is CKPT's; the image tower and its connector are new
(random, as ``zoo init`` draws them), sized by CONFIG, a SmolVLM-style config.json (``vision_config``,
``scale_factor``; its ``text_config``, if any, is replaced by CKPT's). What the image processor and the chat data
need beside the weights is written too, so the folder trains with images at once (``sft train``, chat/images.py):

- the tokenizer gains SmolVLM's image tokens (``<fake_token_around_image>``, ``<image>``, ``<global-img>``) and the
  embedding table their rows (the mean of the existing rows: a new token starts as an average word, not as noise
  the tied head would predict at random);
- the chat template renders ``{"type": "image"}`` parts as ``<image>`` (TRL's content parts) around CKPT's own
  turns (ChatML for SmolLM2);
- ``preprocessor_config.json`` (SmolVLM's image processor at the tower's ``image_size``, one frame an image: no
  splitting) and ``processor_config.json`` (``image_seq_len``).

The result is an ordinary ``SmolVLMForConditionalGeneration`` checkpoint: ``zoo export`` writes a folder that
transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from convert.convert import DTYPES
from convert.init import write_params
from zoo.checkpoints.format import HF_CONFIG_FILE, TOKENIZER_DIR, folder_of, read_meta
from zoo.checkpoints.readers import load_param_numpy
from zoo.errors import UserError
from zoo.model.from_hf import model_config_from_hf
from zoo.model.params import param_specs
from zoo.registry import catalogue as registry
from zoo.storage import RunPath

IMAGE_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>")  # SmolVLM's processor's defaults
# CKPT's chat template with each content part written out: text as itself, an image part as SmolVLM's
# placeholder; a plain string content is left as it was. Applied to the template as a prelude that rewrites
# ``messages`` (so every template that reads message['content'] as a string keeps working).
PARTS_PRELUDE = (
    "{%- set ns = namespace(msgs=[]) -%}"
    "{%- for m in messages -%}"
    "{%- if m['content'] is string -%}{%- set ns.msgs = ns.msgs + [m] -%}"
    "{%- else -%}{%- set text = namespace(s='') -%}"
    "{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}{%- set text.s = text.s + '<image>' -%}"
    "{%- else -%}{%- set text.s = text.s + p['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set ns.msgs = ns.msgs + [{'role': m['role'], 'content': text.s}] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- set messages = ns.msgs -%}"
)


def vlm_hf_config(vision: dict[str, Any], text: dict[str, Any], vocab_size: int, image_token_id: int
                  ) -> dict[str, Any]:
    """The SmolVLM config.json of a tower config ``vision`` (CONFIG's ``vision_config``, ``scale_factor``) over the
    language model ``text`` (CKPT's Hugging Face config) with its vocabulary grown to ``vocab_size``."""
    text = {**text, "vocab_size": vocab_size, "model_type": text.get("model_type") or "llama"}
    text.pop("architectures", None)
    return {**{k: v for k, v in vision.items() if k != "text_config"}, "model_type": "smolvlm",
            "architectures": ["SmolVLMForConditionalGeneration"], "text_config": text,
            "vision_config": {"model_type": "smolvlm_vision", **vision["vision_config"]},
            "image_token_id": image_token_id, "tie_word_embeddings": bool(text.get("tie_word_embeddings", False))}


def init_vision_from_text(source: str, language_model: str | Path, out: str | Path, seed: int = 0,
                          dtype: str = "float32", std: float = 0.02) -> Path | RunPath:
    """Write at ``out`` a SmolVLM checkpoint: ``language_model``'s weights and tokenizer (grown by the image
    tokens), and a new random image tower and connector sized by ``source`` (a config.json: see the module)."""
    from zoo.data.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    vision = registry.hf_config_of(source, "zoo init")
    if not isinstance(vision.get("vision_config"), dict):  # before anything is read
        raise UserError(f"zoo init --language-model: {source} has no vision_config (the tower: hidden_size, "
                        "num_hidden_layers, num_attention_heads, intermediate_size, image_size, patch_size)")
    lm = folder_of(language_model)
    meta = read_meta(lm)
    if meta["config"].get("vision") is not None:
        raise UserError(f"--language-model {language_model}: it has an image tower already; give a text model")
    tok = load_tokenizer(language_model)
    if tok.chat_template is None:
        raise UserError(f"--language-model {language_model}: its tokenizer has no chat template, which image "
                        "parts are written into; give an instruction-tuned model")
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS)})
    tok.chat_template = PARTS_PRELUDE + tok.chat_template
    text_hf = json.loads((lm / HF_CONFIG_FILE).read_text())
    old_vocab = int(text_hf["vocab_size"])
    vocab = max(len(tok), old_vocab)
    hf = vlm_hf_config(vision, text_hf, vocab,
                       int(tok.convert_tokens_to_ids("<image>")))
    cfg = model_config_from_hf(hf, source)
    assert cfg.vision is not None
    params = _lm_params(lm, meta, old_vocab, vocab, DTYPES[dtype])
    rng = np.random.default_rng(seed)
    for path, spec in sorted(param_specs(cfg).items()):
        if path.startswith(("vision.", "projector.")):  # the new parts, drawn as `zoo init` draws them
            draw = std * rng.standard_normal(spec.shape) if spec.init == "normal" else \
                np.full(spec.shape, 1.0 if spec.init == "ones" else 0.0)
            params[path] = draw.astype(DTYPES[dtype])
    missing = sorted(set(param_specs(cfg)) - set(params))
    if missing:
        raise UserError(f"--language-model {language_model}: its weights lack {', '.join(missing[:3])}; convert it "
                        "again")
    size, seq = cfg.vision.image_size, cfg.vision.tokens_per_image
    write_params(out, hf, cfg, params, f"{language_model} with a random image tower (seed {seed})",
                 lambda files: _write_processor_files(files / TOKENIZER_DIR, tok, size, seq))
    return folder_of(out)


def _lm_params(lm: Path | RunPath, meta: dict[str, Any], old_vocab: int, vocab: int, dtype: Any
               ) -> dict[str, np.ndarray]:
    """The language model's stored weights (flat path -> array in ``dtype``), the embedding table (and an untied
    head) grown from ``old_vocab`` to ``vocab`` rows by the mean of the existing ones."""
    params = {}
    for path, info in meta["params"].items():
        a = np.asarray(load_param_numpy(lm, path, info), np.float32)
        if path == "embed" and vocab > old_vocab:
            a = np.concatenate([a, np.repeat(a.mean(0, keepdims=True), vocab - old_vocab, 0)])
        elif path == "lm_head" and vocab > old_vocab:  # [embed, vocab]
            a = np.concatenate([a, np.repeat(a.mean(1, keepdims=True), vocab - old_vocab, 1)], 1)
        params[path] = a.astype(dtype)
    return params


def _write_processor_files(folder: Path, tok: Any, image_size: int, image_seq_len: int) -> None:
    """The tokenizer (with its image tokens and template) and SmolVLM's processor files in ``folder``: images
    resized to one ``image_size`` frame (no splitting), ``image_seq_len`` tokens each."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    tok.save_pretrained(str(folder))
    SmolVLMImageProcessorPil(size={"longest_edge": image_size}, max_image_size={"longest_edge": image_size},
                             do_image_splitting=False).save_pretrained(str(folder))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": image_seq_len, "processor_class": "SmolVLMProcessor"}, indent=2) + "\n")
