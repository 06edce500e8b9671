"""`zoo generate`: the body of the command (streamed text for one prompt, or a JSONL file of prompts in batches).

Its flags are here too (:func:`add_generate_parser`): zoo/cli.py imports this module to build its parser, so its
top-level imports stay light, and calls :func:`generate_command`; the decoding itself is eval/generate.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zoo.console import add_dtype_flag, add_topology_flags
from zoo.errors import UserError

if TYPE_CHECKING:  # annotations only: JAX and the model load inside the command
    from eval.generate import GenerationConfig
    from zoo.model.config import ModelConfig
    from zoo.model.decoder import Decoder

# (tokenizer folder, tokenizer) -> the image expander of the model's processor files (chat/images.py's
# ImageExpander.from_folder, which the dispatcher passes in: chat/ is a floor above this one).
ExpanderOf = Callable[[Path, Any], Any]


def add_generate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`zoo generate`: its subparser of ``sub``, with its flags (zoo/cli.py sets what runs it)."""
    p = sub.add_parser(
        "generate", help="generate text with a zoo checkpoint (KV-cache decoding, streamed)",
        description="Continue a prompt with a zoo checkpoint (converted, or a training run's final/ folder: LoRA "
                    "adapters are merged on load), printing tokens as they come. Greedy unless --temperature > 0. "
                    "With --prompts-file, complete every line of a JSONL file in batches instead.")
    p.add_argument("ckpt", metavar="CKPT", help="path of a zoo checkpoint folder (with tokenizer/); with "
                                               "--compile-only also a registry name (llama3.1-8b) or a config.json")
    p.add_argument("--prompt", metavar="TEXT",
                   help="the text to continue (with --chat: the user message answered under the chat template)")
    p.add_argument("--chat", action="store_true",
                   help="apply the checkpoint's chat template: --prompt (and \"prompt\" lines) become a user turn "
                        "and generation starts the assistant's reply")
    p.add_argument("--system", metavar="TEXT", help="with --chat (or \"messages\" lines), a system turn put first")
    p.add_argument("--image", action="append", metavar="PATH",
                   help="an image file for a vision-language model (the flag may repeat): --prompt becomes a user "
                        "turn under the chat template (as --chat) with an image part per image before its text, "
                        "as TRL places them, each expanded as the model's processor expands it (its processor "
                        "files, which zoo convert copies into the checkpoint's tokenizer/ folder)")
    p.add_argument("--prompts-file", metavar="IN.jsonl",
                   help='instead of --prompt: one JSON object a line, {"prompt": TEXT} or {"messages": [...]} '
                        '(chat messages, always under the chat template)')
    p.add_argument("--out", metavar="OUT.jsonl",
                   help='with --prompts-file: where to write each input line with a "completion" added')
    p.add_argument("--batch-size", type=int, default=8, metavar="N",
                   help="prompts generated together with --prompts-file (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=48, metavar="N",
                   help="most tokens to generate per prompt (default 48)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 (the default) is greedy decoding")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only among the K most likely tokens (0: all; default 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only among the most likely tokens whose probabilities sum to P (default 1.0: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S",
                   help="random seed for sampling: same seed, same text (default 0)")
    add_dtype_flag(p)
    p.add_argument("--stop", nargs="+", action="extend", metavar="STR",
                   help="stop once the text contains any of these strings (the output ends before it; the flag may "
                        "repeat); generation also stops at the tokenizer's end-of-sequence token")
    g = p.add_argument_group("compile for a TPU slice from this machine, without TPUs, weights or a tokenizer")
    g.add_argument("--compile-only", action="store_true",
                   help="compile the inference engine's programs (the prefill of a batch of prompts and the "
                        "decoding step) for --max-seqs sequences at once of --prompt-length + --max-new-tokens "
                        "tokens for --topology, and report bytes per chip (weights, paged KV cache, temporaries); "
                        "nothing is generated (exit 0: fits, 3: does not fit, 2: an error). Needs the tpu extra "
                        "(libtpu)")
    add_topology_flags(g)
    g.add_argument("--prompt-length", type=int, default=None, metavar="N",
                   help="with --compile-only: tokens of the longest prompt (default 512)")
    g.add_argument("--max-seqs", type=int, default=None, metavar="N",
                   help="with --compile-only: sequences decoding at once (default: --batch-size, the prompts "
                        "--prompts-file runs together)")
    g.add_argument("--page-size", type=int, default=None, metavar="N",
                   help="with --compile-only: tokens a page of the KV cache (default 16, the engine's)")
    return p


def generate_command(args: argparse.Namespace, expander_of: ExpanderOf | None = None) -> int | None:
    """`zoo generate CKPT`: continue a prompt (or answer it as a chat turn with --chat, with --image about images),
    streaming; or complete a JSONL file of prompts (`zoo generate --compile-only`:
    :func:`eval.generate_compile.generate_compile_command`). ``expander_of`` makes the image expander (--image)."""
    if (getattr(args, "topology", None) or getattr(args, "report", None)
            or any(getattr(args, k, None) is not None for k in ("prompt_length", "max_seqs", "page_size"))):
        # --compile-only goes to eval.generate_compile
        raise UserError("--topology, --report, --prompt-length, --max-seqs and --page-size go with --compile-only")
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
    images = getattr(args, "image", None) or []
    if images and args.prompt is None:
        raise UserError("--image goes with --prompt (one prompt and its images), not with --prompts-file")
    for path in images:
        if not Path(path).expanduser().is_file():
            raise UserError(f"--image {path}: no such file")
    from eval.harness_run import check_out
    from zoo.checkpoints.paths import checkpoint_dir

    check_out(args.out)  # before anything loads: the completions are never lost for want of a place to write them
    args.ckpt = str(checkpoint_dir(args.ckpt))
    rows = _read_prompt_rows(Path(args.prompts_file)) if args.prompts_file else None
    import jax.numpy as jnp

    import zoo

    cfg = zoo.read_config(args.ckpt) if images else None
    if cfg is not None and cfg.vision is None:  # before the weights load
        raise UserError(f"--image: {args.ckpt} has no vision tower (a text model); leave out --image or give a "
                        "vision-language model's checkpoint")
    from eval.generate import GenerationConfig
    from zoo.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.ckpt)
    if cfg is not None:  # every image read and expanded before the weights load: a bad one is its error first
        assert expander_of is not None, "the dispatcher passes the image expander"
        ids, frames = _image_prompt(cfg, tok, args, expander_of)
    model = zoo.load(args.ckpt, dtype=jnp.dtype(args.dtype))
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()),
                           eos_ids=eos_ids_of(args.ckpt, tok))
    if images:
        _stream_one(model, tok, ids, gen, frames)
    elif rows is None:
        _stream_one(model, tok, _prompt_ids(tok, {"prompt": args.prompt}, args), gen)
    else:
        _generate_file(model, tok, rows, args, gen)
    return None


def eos_ids_of(ckpt: str, tok: Any) -> tuple[int, ...]:
    """End-of-sequence ids: the tokenizer's, plus the source config's (Llama 3 chat models end turns with another);
    `zoo serve` ends every request on them too."""
    import json

    from zoo.checkpoints.format import HF_CONFIG_FILE

    ids = {tok.eos_token_id} - {None}
    path = Path(ckpt) / HF_CONFIG_FILE
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return tuple(sorted(ids))


def _read_prompt_rows(path: Path) -> list[dict[str, Any]]:
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


def _prompt_ids(tok: Any, row: dict[str, Any], args: argparse.Namespace) -> list[int]:
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


def _image_prompt(cfg: ModelConfig, tok: Any, args: argparse.Namespace, expander_of: ExpanderOf,
                  ) -> tuple[list[int], list[dict[str, Any]]]:
    """(token ids, the images' frames as per-patch arrays) of --prompt with its --image files: a user turn (after --system's turn) of
    one image part per image and then the text, as TRL's ``prepare_multimodal_messages`` places them; the chat
    template's placeholders replaced by each image's expansion, and the text tokenized whole, as the processor
    does. A prompt longer than the model's context with its images is refused (its image tokens cannot be cut)."""
    from zoo.data.tokenizer import tokenizer_dir

    if not getattr(tok, "chat_template", None):
        raise UserError(f"{args.ckpt}: the tokenizer has no chat template, which --image needs to place the images")
    expander = expander_of(tokenizer_dir(args.ckpt), tok)
    try:
        ids, processed = expander.prompt_ids(tok, args.prompt, args.system, args.image, Path.cwd(), "--image")
    except ValueError as e:  # chat.formats.BadRow: an unreadable image, a template without one placeholder an image
        raise UserError(str(e)) from None
    if len(ids) > cfg.max_position_embeddings:
        raise UserError(f"--image: the prompt with its image(s) is {len(ids)} tokens, more than the model's context "
                        f"of {cfg.max_position_embeddings}; give fewer or smaller images or a shorter prompt")
    return ids, [f for p in processed for f in p.patches(cfg.vision)]  # per-patch arrays of every frame


def _stream_one(model: Decoder, tok: Any, ids: list[int], gen: GenerationConfig,
                frames: list[dict[str, Any]] | None = None) -> None:
    """Generate for one prompt (with its images), printing the text as it grows (held back where a stop string
    may begin)."""
    from eval.generate import generate
    from eval.text_stream import TextStream

    text = TextStream(tok, gen.stop, gen.eos_ids)  # held back where a stop string may begin

    def on_token(_row: int, token: int) -> None:
        print(text.add([token]), end="", flush=True)

    generate(model.cfg, model.param_dict(), [ids], gen, on_token, tok, None if frames is None else [frames])
    print(text.finish(), flush=True)


def _generate_file(model: Decoder, tok: Any, rows: list[dict[str, Any]], args: argparse.Namespace,
                   gen: GenerationConfig) -> None:
    """Complete every row of a prompts file in batches; write each row back with its "completion"."""
    import json

    from tqdm import tqdm

    from eval.answers import cut_at_stop
    from eval.generate import generate
    from eval.harness_run import out_path

    ids = [_prompt_ids(tok, r, args) for r in rows]
    out = out_path(args.out)  # a bucket URL: the object is uploaded whole when the file closes
    assert out is not None  # --prompts-file needs --out (generate_command)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f, tqdm(total=len(rows), desc="generate", unit="prompt", disable=None) as bar:
        for i in range(0, len(rows), args.batch_size):
            new = generate(model.cfg, model.param_dict(), ids[i:i + args.batch_size], gen, tokenizer=tok)
            for row, toks in zip(rows[i:i + args.batch_size], new):
                text = cut_at_stop(tok.decode(toks, skip_special_tokens=True), gen.stop)
                f.write(json.dumps({**row, "completion": text}, ensure_ascii=False) + "\n")
            bar.update(len(new))
    print(f"wrote {out}", file=sys.stderr)
