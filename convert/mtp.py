"""DeepSeek's multi-token-prediction (MTP) layers: the layers past ``num_hidden_layers`` that DeepSeek-V3/R1
checkpoints carry for speculative decoding (layer 61 of V3).

lmzoo's model does not run them (neither does transformers' DeepseekV3ForCausalLM). A conversion drops them
and says so; with ``--keep-mtp`` it keeps their tensors, under their Hugging Face names, in the checkpoint's
:data:`EXTRA_FILE`, and ``zoo export`` writes them back beside the model's.
"""

from __future__ import annotations

from typing import Any

EXTRA_FILE = "extra.safetensors"


def mtp_layer_count(hf_config: dict[str, Any]) -> int:
    """How many MTP layers the config declares (``num_nextn_predict_layers``)."""
    return int(hf_config.get("num_nextn_predict_layers") or 0)


def mtp_tensors(names: list[str], hf_config: dict[str, Any]) -> list[str]:
    """The tensors of the config's MTP layers (``model.layers.{num_hidden_layers + k}.*``), in file order."""
    first = int(hf_config.get("num_hidden_layers") or 0)
    prefixes = tuple(f"model.layers.{first + k}." for k in range(mtp_layer_count(hf_config)))
    return [n for n in names if prefixes and n.startswith(prefixes)]
