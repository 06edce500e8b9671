"""`zoo convert`, `zoo init`, `zoo quantize` and `zoo export`: the bodies of the `zoo` commands that convert/ drives.

Each command's flags are here beside its body; zoo/cli.py builds its parser from them and calls the bodies,
which import the converter inside, so building the parser (`zoo list`, `zoo --help`) never loads it or JAX.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from zoo.console import human_bytes, print_table
from zoo.errors import UserError
from zoo.storage import is_remote


def add_convert_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo convert`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "convert", help="convert a Hugging Face model or GGUF file into a zoo checkpoint",
        description="Convert SOURCE into a sharded Orbax zoo checkpoint, streaming one tensor at a time. "
                    "FP8 block-scaled checkpoints (DeepSeek-V3/R1's Hub weights) and quantized GGUF files are "
                    "dequantized on the way.",
    )
    p.add_argument("source", metavar="SOURCE",
                   help="a registry name (see `zoo list`), a Hugging Face repo id, a local HF folder "
                        "(config.json + *.safetensors, FP8 block-scaled included) or a .gguf file (dequantized)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output folder, or a gs:// or s3:// prefix the arrays are written into straight (must not "
                        "exist or be empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="store parameters in this dtype (default: keep the source's dtype; float32 for GGUF, "
                        "bfloat16 for FP8 weights)")
    p.add_argument("--keep-mtp", action="store_true",
                   help="keep a DeepSeek checkpoint's multi-token-prediction layer (layer 61 of V3/R1; dropped by "
                        "default, since the model does not run it): its tensors are stored beside the model and "
                        "`zoo export` writes them back")
    p.add_argument("--text-only", action="store_true",
                   help="convert a multimodal Gemma 3, Gemma 4, Llama 4 or Qwen3.5 (*ForConditionalGeneration) "
                        "without its vision tower: its language model alone, exported as the family's *ForCausalLM")
    return p


def convert_command(args: argparse.Namespace) -> None:
    """`zoo convert SOURCE --out DIR`: convert a Hugging Face / GGUF model into a zoo checkpoint."""
    from convert.convert import convert

    # a gs:// or s3:// --out: the arrays go straight into the bucket, model.json last (zoo.checkpoints.writer)
    out = convert(args.source, args.out, dtype=args.dtype, keep_mtp=args.keep_mtp, text_only=args.text_only)
    print(f"wrote {out}")


def add_init_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo init`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser("init", help="create a random-weight checkpoint (tiny registry entries, or a config.json)")
    p.add_argument("source", metavar="SOURCE",
                   help="a registry entry with a built-in config (e.g. deepseek-v3-tiny) or a Hugging Face config.json")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameter dtype (default float32)")
    p.add_argument("--language-model", metavar="CKPT",
                   help="a vision-language model from a text checkpoint: SOURCE is a SmolVLM config.json "
                        "(vision_config, scale_factor) whose new random image tower and connector sit before "
                        "CKPT's language model, tokenizer and chat template (which gain the image tokens)")
    return p


def init_command(args: argparse.Namespace) -> None:
    """`zoo init SOURCE --out DIR`: a random-weight checkpoint from a built-in or given config."""
    if args.language_model:
        from convert.vision_init import init_vision_from_text

        print(f"wrote {init_vision_from_text(args.source, args.language_model, args.out, args.seed, args.dtype)}")
        return
    from convert.init import init_random

    print(f"wrote {init_random(args.source, args.out, args.seed, args.dtype)}")


def add_quantize_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo quantize`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "quantize", help="store a checkpoint's projections quantized (NF4 or int8): a QLoRA base made once",
        description="Write CKPT with every layer's linear projections (attention, MLP, experts) quantized as "
                    "bitsandbytes stores them (NF4: 64-value blocks, a float32 absmax each, bit-compatible; int8: one "
                    "absmax per output row); embeddings, head and norms stay as they are. The output is a zoo "
                    "checkpoint: zoo.load, zoo generate/eval and zoo export read it dequantized, and a LoRA run with "
                    "it as model.path trains on the stored quantized base (QLoRA) without quantizing at load.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="a zoo checkpoint (converted, a training run's final, or a run folder)")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    p.add_argument("--quant", choices=["nf4", "int8"], default="nf4",
                   help="nf4: 4-bit NormalFloat, as QLoRA (default); int8: 8-bit, as LLM.int8() stores weights")
    p.add_argument("--double-quant", action="store_true",
                   help="NF4 only: quantize the block absmax values too (8-bit, blocks of 256), 4.127 instead of "
                        "4.5 bits per parameter (lora.base_quant_double)")
    return p


def quantize_command(args: argparse.Namespace) -> None:
    """`zoo quantize CKPT --out DIR`: the checkpoint with its projections stored quantized (convert/quantize.py)."""
    from convert.quantize import quantize_checkpoint
    from zoo.checkpoints.paths import checkpoint_dir

    if is_remote(args.out):
        raise UserError(f"--out {args.out}: zoo quantize writes a local folder only; give a local --out")
    out, bits = quantize_checkpoint(checkpoint_dir(args.ckpt), args.out, args.quant, args.double_quant)
    print(f"wrote {out}  ({bits:.3f} bits per quantized parameter)")


def add_export_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo export`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "export", help="write a zoo checkpoint as a Hugging Face safetensors folder, and/or push it to the Hub",
        description="Stream a zoo checkpoint (converted or trained) back into a folder that "
                    "transformers.AutoModelForCausalLM.from_pretrained loads, optionally uploading it. "
                    "With --adapter, write a LoRA adapter checkpoint as a PEFT adapter folder instead.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="a zoo checkpoint folder (from `zoo convert` or a training run)")
    p.add_argument("--out", metavar="DIR", help="output folder (refused if it exists and is not empty, unless --overwrite)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="write tensors in this dtype (default: the checkpoint's own dtype)")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB; one model.safetensors when it fits)")
    p.add_argument("--adapter", action="store_true",
                   help="CKPT is a LoRA adapter checkpoint (from a training run with lora.rank > 0): write only the "
                        "adapter, as a PEFT folder (adapter_config.json + adapter_model.safetensors) that "
                        "peft.PeftModel.from_pretrained loads onto the base model. Without it, an adapter checkpoint "
                        "exports as the merged model")
    p.add_argument("--base-out", metavar="DIR",
                   help="with --adapter: also export the adapter's base model here (dequantized when `zoo quantize` "
                        "stored it quantized, merged when it is an adapter checkpoint) and name this folder as the "
                        "adapter's base_model_name_or_path. Default: OUT-base beside --out for a base stored "
                        "quantized (QLoRA), none otherwise")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (and --base-out) folder")
    p.add_argument("--push-to-hub", metavar="USER/REPO",
                   help="upload to this Hub repo (created if needed); the token comes from HF_TOKEN or `hf auth login`")
    p.add_argument("--private", action="store_true", help="create the Hub repo as private")
    p.add_argument("--revision", metavar="BRANCH", help="upload to this branch (created if needed; default main)")
    p.add_argument("--dry-run", action="store_true", help="list the files that would be written/uploaded and where; write nothing")
    p.add_argument("--eval-results", metavar="FILE",
                   help="a `zoo eval --out` results JSON (lmzoo's tasks or --harness): the model card (README.md, which "
                        "--push-to-hub uploads too) lists its scores as a task / metric / value table")
    return p


def export_command(args: argparse.Namespace) -> None:
    """`zoo export CKPT`: write a checkpoint as a Hugging Face folder (or, with --adapter, a PEFT adapter) and/or
    push it to the Hub."""
    import tempfile

    from convert.hub import check_repo_id, destination, push_folder

    if not args.out and not args.push_to_hub:
        raise UserError("zoo export needs --out DIR, --push-to-hub USER/REPO, or both")
    if (args.private or args.revision) and not args.push_to_hub:
        raise UserError("--private and --revision only apply with --push-to-hub USER/REPO")
    from zoo.checkpoints.paths import checkpoint_dir

    args.ckpt = str(checkpoint_dir(args.ckpt))
    if args.eval_results:
        from convert.model_card import read_eval_results

        read_eval_results(args.eval_results)  # a bad results file is said before anything is planned or written
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)
    if args.base_out and not args.adapter:
        raise UserError("--base-out applies to --adapter only: without it the whole model is exported")
    base_out = _adapter_base_out(args) if args.adapter else None
    write, planned = _export_writer(args, base_out)
    if args.dry_run:
        files = planned()
        where = [args.out if is_remote(args.out) else str(Path(args.out).absolute())] if args.out else []
        if args.push_to_hub:
            where.append(destination(args.push_to_hub, args.revision) + (" (private)" if args.private else ""))
        print(f"dry run: would write {len(files)} files to {' and '.join(where)}")
        print_table([("file", "size")] + [(n, human_bytes(s) if s else "small") for n, s in files])
        return
    hint = args.push_to_hub or args.out.rstrip("/").rsplit("/", 1)[-1]
    if args.out:
        def push(folder: Path) -> None:
            if args.push_to_hub:
                print(f"pushed: {push_folder(folder, args.push_to_hub, args.private, args.revision)}")

        marker = "adapter_config.json" if args.adapter else "config.json"  # what a reader of the folder opens first
        out = _written(args.out, args.overwrite, marker, lambda folder, overwrite: write(folder, overwrite, hint),
                       push)
        print(f"wrote {out}")
        if base_out:
            print(f"wrote {base_out}  (the adapter's base model)")
        return
    with tempfile.TemporaryDirectory(prefix="lmzoo-export-") as tmp:
        out = write(Path(tmp) / "export", False, hint)
        print(f"pushed: {push_folder(out, args.push_to_hub, args.private, args.revision)}")


def _written(out: str, overwrite: bool | None, marker: str, write: Callable[[str | Path, bool], Path],
             then: Callable[[Path], None] | None = None) -> str | Path:
    """``write(folder, overwrite)`` of a command whose output folder is ``out`` (its ``--out``), and the folder
    written; ``then(folder)`` runs on it after (a push to the Hub). A local ``out`` is written in place. On
    object storage (``gs://``, ``s3://``) the folder (an export's Hugging Face folder; a zoo checkpoint is
    written into the bucket straight, :func:`zoo.checkpoints.writer.checkpoint_output`) is written on the local
    disk first (in the temporary folder, ``TMPDIR``), then uploaded one file at a time, ``marker`` last (a reader
    that waits for it sees a whole folder); the prefix is checked first, as a local folder is: writable, and
    empty unless ``overwrite`` (None: the command has no ``--overwrite``)."""
    import tempfile

    from zoo.storage import check_writable, remove_tree, run_path, upload_tree

    if not is_remote(out):
        folder = write(out, bool(overwrite))
        if then is not None:
            then(folder)
        return folder
    remote = run_path(out, "--out")
    check_writable(remote, "--out")
    if remote.is_dir() and any(remote.iterdir()) and not overwrite:
        fix = "add --overwrite to replace it" if overwrite is not None else "remove it"
        raise UserError(f"--out {out} exists and is not empty; choose a new prefix or {fix}")
    with tempfile.TemporaryDirectory(prefix="lmzoo-upload-") as tmp:
        folder = write(Path(tmp) / out.rstrip("/").rsplit("/", 1)[-1], False)
        if overwrite:
            remove_tree(remote)
        upload_tree(folder, remote, last=(marker,))
        if then is not None:
            then(folder)
    return out


def _adapter_base_out(args: argparse.Namespace) -> Path | None:
    """Where `zoo export --adapter` exports the adapter's base: --base-out, else beside --out when the adapter
    needs it (a base stored quantized, convert/peft.py); a note when it needs one and there is nowhere to put it."""
    import sys

    from convert.peft import adapter_meta_of, default_base_out, quantized_base

    if args.base_out and is_remote(args.base_out):
        raise UserError(f"--base-out {args.base_out}: a local folder only (the adapter names it as its base); "
                        "export the base to a bucket on its own with `zoo export BASE --out URL`")
    if args.base_out:
        return Path(args.base_out).absolute()
    if args.out and is_remote(args.out):
        if quantized_base(args.ckpt, adapter_meta_of(args.ckpt)) is not None:
            raise UserError(f"--out {args.out}: the adapter's base is stored quantized, which transformers does "
                            "not read; add --base-out DIR (a local folder) to export it dequantized beside it")
        return None
    if args.out:
        return default_base_out(args.ckpt, args.out)
    base = quantized_base(args.ckpt, adapter_meta_of(args.ckpt))
    if base is not None:
        print(f"note: the adapter's base {base} is stored quantized, which transformers does not read; add "
              "--base-out DIR to export it dequantized and name that folder as the adapter's base", file=sys.stderr)
    return None


def _export_writer(args: argparse.Namespace, base_out: Path | None
                   ) -> tuple[Callable[[str | Path, bool, str], Path], Callable[[], list[tuple[str, int]]]]:
    """(write(out, overwrite, repo_hint) -> folder, planned() -> [(file, size)]) for the kind of export asked;
    ``base_out``: where an adapter export writes its base (:func:`_adapter_base_out`). The card lists the
    scores of --eval-results, when given."""
    eval_results = args.eval_results
    if args.adapter:
        from convert.peft import export_adapter, planned_adapter_files

        if args.max_shard_size is not None:
            raise UserError("--max-shard-size does not apply to --adapter: the adapter is one small safetensors file")
        return (lambda out, overwrite, hint: export_adapter(args.ckpt, out, overwrite, args.dtype, hint, base_out,
                                                            eval_results),
                lambda: planned_adapter_files(args.ckpt, args.dtype, base_out))
    from convert.export import DEFAULT_MAX_SHARD, export, planned_files

    size = args.max_shard_size or DEFAULT_MAX_SHARD
    return (lambda out, overwrite, hint: export(args.ckpt, out, args.dtype, size, overwrite, repo_hint=hint,
                                                eval_results=eval_results),
            lambda: planned_files(args.ckpt, args.dtype, size))
