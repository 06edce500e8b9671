"""`zoo serve`'s tests' model and server: a tiny random Llama of SmolLM2's tokenizer under Qwen 2.5's chat template
(tools rendered, hermes tool calls), a LoRA adapter checkpoint over it, and the server run in-process on a free
loopback port (uvicorn in a thread)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

from tests.lora_fixtures import write_adapter_checkpoint

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"


def serve_checkpoints(tokenizer: Path, root: Path) -> tuple[Path, Path]:
    """(the base checkpoint, an adapter checkpoint over it) under ``root``: a tiny random Llama (tests/tiny_lm.py's
    shape, tied embeddings) of the real tokenizer at ``tokenizer`` (SmolLM2's: its vocabulary keeps Qwen 2.5's
    prompt with tools under 256 tokens, so every program the engine compiles is one page-table width), converted
    with that tokenizer under Qwen 2.5's chat template, and random LoRA adapters (B random too, so the adapter
    changes the answer)."""
    from tests.hf_models import make_llama
    from tests.tiny_lm import TINY_LM
    from zoo.cli import main
    from zoo.lora.params import LoraConfig

    hf = root / "hf"
    make_llama(hf, vocab_size=49152, tie_word_embeddings=True, **TINY_LM)
    for f in tokenizer.iterdir():
        shutil.copy(f, hf / f.name)
    shutil.copy(TEMPLATES / "qwen2.5.jinja", hf / "chat_template.jinja")
    base = root / "tiny"
    assert main(["convert", str(hf), "--out", str(base)]) == 0
    adapter = write_adapter_checkpoint(base, root / "adapter", LoraConfig(rank=2, alpha=8.0,
                                                                           targets=["q_proj", "v_proj", "down_proj"]))
    shutil.copytree(base / "tokenizer", adapter / "tokenizer")  # as pretrain/final.py copies it
    return base, adapter


class ServerThread:
    """A uvicorn server of ``app`` on a free 127.0.0.1 port, in a daemon thread; ``url`` is its /v1 base."""

    def __init__(self, app: object):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the test server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
