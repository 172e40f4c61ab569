"""What the `nla serve` tests share: a uvicorn server on a free loopback port, and a stand-in reader.

The stand-in answers at once (or when its gate opens, or by raising what it is told to), so the
server's own behaviour under hostile and heavy traffic (limits, queue, timeouts, cancellation,
a dying worker) is tested in seconds; test_serve.py runs the same app on the toy NLA's models.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from nla_shell.serving.reader import SiteExplanation
from nla_shell.serving.server import bind, uvicorn_server

LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def running(app):
    """The app served by uvicorn in a thread on a free loopback port; yields its base URL."""
    sock = bind(LOOPBACK, 0)
    server = uvicorn_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://{LOOPBACK}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        app.state.batcher.close()
        sock.close()


class WordTokenizer:
    """A text's words as token ids (their index in the text), for /v1/explain on the stand-in."""

    def __init__(self) -> None:
        self.words: dict[int, str] = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for word in text.split():
            self.words[len(self.words)] = word
            ids.append(len(self.words) - 1)
        return ids

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


@dataclass
class StandInReader:
    """NLAReader's surface as the server uses it; site i's explanation names its vector's first number.

    `gate`: explain waits for it (bounded); `entered` is set once explain is running; `fault`: explain raises it
    once. `seen` records the first number of every vector that reached the engine, `pad_to` each call's padding.
    """

    d_model: int = 4
    min_context: int = 0
    fault: BaseException | None = None
    engine: object = None
    """What the batcher asks about the engine (cuda_graphs); None: an engine without CUDA graphs."""

    def __post_init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.seen: list[float] = []
        self.pad_to: list[int | None] = []
        self.target_tokenizer = WordTokenizer()

    def explain(self, vectors: torch.Tensor, *, samples: int, greedy: bool, max_new_tokens: int,
                pad_to: int | None = None):
        self.entered.set()
        self.pad_to.append(pad_to)
        assert self.gate.wait(timeout=30), "the test never opened the gate"
        if self.fault is not None:
            fault, self.fault = self.fault, None
            raise fault
        self.seen += [float(v[0]) for v in vectors]
        return [SiteExplanation(explanations=[f"site {float(v[0]):g}"], raw=[""], mses=[0.0], best=0, fve=None,
                                reconstruction=v.clone(), generated_tokens=1) for v in vectors]

    def capture(self, token_lists, positions):
        return [torch.tensor([[float(p)] * self.d_model for p in ps]) for ps in positions]

    def info(self) -> dict:
        return {"model": "stand-in", "d_model": self.d_model, "engine": "stand-in"}


class Crash(BaseException):
    """Escapes the batcher's `except Exception`, as a fault that kills its worker thread would."""


def vector(first: float, d_model: int = 4) -> list[float]:
    return [first] + [0.0] * (d_model - 1)
