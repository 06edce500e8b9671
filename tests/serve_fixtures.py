"""`zoo serve`'s tests' model and server: the session's tiny model (tests/tiny_lm.py) as a checkpoint with its
tokenizer and Qwen 2.5's chat template (tools rendered, hermes tool calls), a LoRA adapter checkpoint over it,
and the server run in-process on a free loopback port (uvicorn in a thread)."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

from tests.lora_fixtures import write_adapter_checkpoint

TEMPLATES = Path(__file__).resolve().parent / "data" / "chat_templates"


def serve_checkpoints(tiny_lm: Path, root: Path) -> tuple[Path, Path]:
    """(the base checkpoint, an adapter checkpoint over it) under ``root``: the tiny model with its tokenizer in
    ``tokenizer/`` (as `zoo convert` lays it out) under Qwen 2.5's template, its context 1024 tokens (the
    template's tool instructions take ~440 of the small vocabulary's tokens; rotary positions have no end), and
    random LoRA adapters (B random too, so every adapter changes the answer)."""
    import json

    from zoo.checkpoints.format import MODEL_FILE
    from zoo.lora.params import LoraConfig

    base = root / "tiny"
    shutil.copytree(tiny_lm / "zoo", base)
    meta = json.loads((base / MODEL_FILE).read_text())
    meta["config"]["max_position_embeddings"] = 1024
    (base / MODEL_FILE).write_text(json.dumps(meta))
    shutil.copytree(tiny_lm / "tok", base / "tokenizer", dirs_exist_ok=True)
    shutil.copy(TEMPLATES / "qwen2.5.jinja", base / "tokenizer" / "chat_template.jinja")
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
