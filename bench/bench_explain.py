"""Explanation throughput of `nla explain` and `nla serve`, per engine (hf, native, vllm).

What is timed, for every engine of --engines on the same N vectors (--sites):
  offline   `NLAReader.explain` batch by batch (--batch sites a call, samples=1, sampled at
            temperature 1, --new-tokens), the AR's scoring of every explanation (its
            reconstruction and MSE) inside the timed region; one warm-up batch before, untimed.
            sites/s, generated tokens/s, mean generated tokens (random weights rarely draw EOS,
            so a sample usually runs the full length), peak GPU memory, and the split of the
            time: `generate_s` (the engine's calls) and `score_s` (the rest: the AR's scoring).
            `explained` counts the sites with an explanation the AR scored: random weights never
            close the <explanation> tag, so without --close-explanations their AR scores none.
  --close-explanations  (bench-side) every rollout without a closed tag gets its text closed at
            max tokens (`<explanation>` + the generated text, filled with " the" to as many tokens
            as were generated, + `</explanation>`), so the AR scores every site, reading an
            explanation as long as a trained AV's that stopped there: the rate with the AR at work.
            `closed_by_bench` counts the rollouts closed, `mean_explanation_tokens` what the AR read.
  server    (--server-engine E) the `nla serve` app (`build_app` + uvicorn, as `nla serve` runs
            them) on a free 127.0.0.1 port in this process, on E's reader; for each of --clients
            (a comma list: one server case each) that many threads of a separate process POST
            /v1/explain_vectors with --vectors-per-request vectors each (as JSON number lists, or
            base64 float32 with --server-encoding base64) until the N sites are
            done: sites/s, p50/p99 request latency, the sites answered (per request, beside the
            batcher's counters), and `server_over_corpus`:
            its rate over the corpus leg's (same engine, batch size and vectors). The server
            batches per engine call, so a closed loop of clients fills the engine's batches only
            with about twice --batch sites in flight (clients x vectors per request). The clients'
            HTTP and JSON work runs in their own process (`clients_process: "separate"`; the runs of
            2026-12-01 and run AN's of 2026-12-04 had the client threads in the server's process,
            sharing its interpreter lock).
  --continuous  (--server-engine native or vllm) the server leg with `continuous_batching=true`: --batch
            decode slots kept busy, sites admitted between steps as others end (nla_shell.serving.continuous;
            with vllm, handed to vLLM's scheduler: not yet run on vLLM); the case records
            `continuous: true`, and under `batcher` the worker's seconds waiting with nothing in flight,
            admitting, decoding and answering (`idle_s`, `admit_s`, `step_s`, `answer_s`: beside the
            corpus leg's generate_s and score_s they say where a server round's extra time goes). The AR
            then scores the requests completed at each decode step together, and --close-explanations closes
            the texts before that scoring, since the stream decoders do not go through the engine's
            generate.
  corpus    (with server, timed before it) `nla explain --parquet` mode (`explain_corpus`) on the
            same reader over a parquet of the same N vectors: sites/s and generated tokens/s.
  --repeats R  R rounds of the corpus leg and the server legs, alternated; each server case records its
            `round` and is set against that round's corpus rate (which varied by ±6 % between runs).

Inputs: --make-8b DIR (builds bench/make_8b_run.py's random Qwen3-8B-shape AV, AR and data there,
unless DIR/av exists), --run DIR (one already built), or --av/--ar [--sidecar] of a trained NLA.
Vectors: --parquet's activation_vector rows (cycled when fewer than --sites), else Gaussian
vectors of the sidecar's d_model scaled to the mean norm of the run's data (sqrt(d_model)
without one). hf and native run in this process one after the other, freeing the GPU between
them; vLLM (only when it imports; else recorded as skipped) runs this script again in a
subprocess after them, since a vLLM engine is created cleanly once per process, with
--vllm-gpu-mem (0.5: the actor and the AR are on the GPU beside it; KV for 256 x ~100
tokens at 8B is ~4 GB). The JSON is rewritten after every case; a failed case goes
under `errors` and the run goes on. The table is printed last.

On one H200 without vLLM (native engine; the 8B shape with the AR at work, and the server under
load beside the corpus rate; about 3-4 minutes with the random 8B run built in /tmp/nla8b):

    PYTHONUNBUFFERED=1 python3 bench/bench_explain.py --make-8b /tmp/nla8b --label qwen3-8b-random-closed \
        --engines native --server-engine native --close-explanations --sites 1024 --batch 256 \
        --clients 16,32 --out $OUT/explain_8b_native_closed.json

The same with the server's continuous batching (server_over_corpus is the number to read):

    PYTHONUNBUFFERED=1 python3 bench/bench_explain.py --make-8b /tmp/nla8b --label qwen3-8b-random-closed \
        --engines native --server-engine native --continuous --close-explanations --sites 1024 --batch 256 \
        --clients 16,32 --out $OUT/explain_8b_native_closed_continuous.json

With vLLM installed (bench/README.md; without it the vllm rows are skipped):

    source /tmp/vllm_env.sh && PYTHONUNBUFFERED=1 python3 bench/bench_explain.py --make-8b /tmp/nla8b \\
        --label qwen3-8b-random --server-engine vllm --out $OUT/explain_8b.json
    source /tmp/vllm_env.sh && PYTHONUNBUFFERED=1 python3 bench/bench_explain.py --label smollm2-real \\
        --av RUN/rl/step_000200/adapter --ar RUN/ar_sft/step_000300 --parquet RUN/data/eval.parquet \\
        --server-engine vllm --out $OUT/explain_smollm2.json

CPU smoke run (tiny random run in a temp dir, hf and native, server leg with hf; ~30 s):

    .venv/bin/python bench/bench_explain.py --tiny --out /tmp/explain.json
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import importlib.util
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402

import synthetic as syn  # noqa: E402

VLLM_HINT = "vllm does not import here: pip install 'nla[vllm]' (bench/README.md: install it on the H200)"
RUN_SIDECAR = "data/rl.parquet.nla_meta.yaml"
"""make_8b_run.py's dataset sidecar: it names the extraction layer that the AV and AR dirs do not."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/explain.json", help="JSON written after every case")
    parser.add_argument("--label", default=None, help="names the NLA in the table (default: random / tiny-random)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: a tiny random run in a temp dir (unless inputs are given), few sites")
    inputs = parser.add_argument_group("inputs")
    inputs.add_argument("--make-8b", metavar="DIR", help="build make_8b_run.py's run in DIR (kept if DIR/av exists)")
    inputs.add_argument("--run", metavar="DIR", help="a run make_8b_run.py wrote: DIR/av, DIR/ar, DIR/data")
    inputs.add_argument("--av", help="a trained AV (adapter dir or full checkpoint)")
    inputs.add_argument("--ar", help="a trained AR dir")
    inputs.add_argument("--sidecar", help="sidecar naming the extraction layer (default: the AV's or AR's)")
    inputs.add_argument("--parquet", help="take the vectors from this parquet's activation_vector column")
    parser.add_argument("--engines", default=None,
                        help="offline engines in order (default hf,native,vllm; tiny hf,native)")
    parser.add_argument("--sites", type=int, default=None, help="vectors explained per engine (default 1024; tiny 12)")
    parser.add_argument("--batch", type=int, default=None, help="sites per engine call (default 256; tiny 4)")
    parser.add_argument("--new-tokens", type=int, default=None, help="explanation length (default 64; tiny 8)")
    parser.add_argument("--server-engine", choices=("hf", "native", "vllm"), default=None,
                        help="also time `nla serve` and the corpus mode with this engine (off by default; tiny hf)")
    parser.add_argument("--clients", default=None,
                        help="concurrent HTTP clients, a comma list: one server case each (default 16; tiny 3)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds of the corpus leg and the server legs, alternated; each server case is set "
                             "against its own round's corpus rate (the corpus rate varies between runs)")
    parser.add_argument("--batch-max-wait-ms", type=float, default=50.0,
                        help="server leg: nla serve's --batch-max-wait-ms (0: a batch gathers for --batch-wait-ms only)")
    parser.add_argument("--continuous", action="store_true",
                        help="server leg: nla serve's continuous_batching (needs --server-engine native or vllm)")
    parser.add_argument("--close-explanations", action="store_true",
                        help="close the <explanation> tag at max tokens where a rollout has none (see above)")
    parser.add_argument("--vectors-per-request", type=int, default=None, help="vectors per POST (default 16; tiny 2)")
    parser.add_argument("--server-encoding", choices=("json", "base64"), default="json",
                        help="server leg: vectors and reconstructions as JSON number lists or base64 float32")
    parser.add_argument("--vllm-gpu-mem", type=float, default=0.5, help="vLLM's share of the GPU (see above)")
    parser.add_argument("--vllm-timeout", type=int, default=420, help="seconds allowed for the vLLM subprocess")
    parser.add_argument("--device", default="auto", help="ReaderSettings.device: auto, cpu, cuda")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # the vLLM subprocess
    args = parser.parse_args(argv)
    tiny = args.tiny
    args.engines = [e for e in (args.engines or ("hf,native" if tiny else "hf,native,vllm")).split(",") if e]
    args.sites = args.sites or (12 if tiny else 1024)
    args.batch = args.batch or (4 if tiny else 256)
    args.new_tokens = args.new_tokens or (8 if tiny else 64)
    args.server_engine = args.server_engine or ("hf" if tiny else None)
    args.clients = [int(c) for c in str(args.clients or (3 if tiny else 16)).split(",") if c]
    args.vectors_per_request = args.vectors_per_request or (2 if tiny else 16)
    if args.server_engine and args.server_engine not in args.engines:
        args.engines.append(args.server_engine)  # the server leg runs on that engine's offline reader
    if args.continuous and args.server_engine not in ("native", "vllm"):
        parser.error("--continuous: nla serve's continuous batching runs on engine=native or vllm; add "
                     "--server-engine native (or vllm)")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: use 1 or more")
    if bad := [e for e in args.engines if e not in ("hf", "native", "vllm")]:
        parser.error(f"--engines: unknown {bad}; use hf, native, vllm")
    if sum(x is not None for x in (args.make_8b, args.run, args.av)) > 1:
        parser.error("give one of --make-8b, --run, --av/--ar")
    if (args.av is None) != (args.ar is None):
        parser.error("--av and --ar go together")
    return args


# --------------------------------------------------------------------------- inputs


def resolve_inputs(args: argparse.Namespace) -> None:
    """Fill args.av, args.ar, args.sidecar (building the run first when asked) and args.label."""
    run = args.make_8b or args.run
    if run is None and args.av is None:
        if not args.tiny:
            raise SystemExit("give --make-8b DIR, --run DIR or --av/--ar (or --tiny)")
        run = args.make_8b = tempfile.mkdtemp(prefix="bench_explain_tiny_")
    if args.make_8b and not (Path(args.make_8b) / "av").is_dir():
        import make_8b_run

        make_8b_run.main(Path(args.make_8b), tiny=args.tiny)
    if run is not None:
        args.av, args.ar = str(Path(run) / "av"), str(Path(run) / "ar")
        args.sidecar = args.sidecar or str(Path(run) / RUN_SIDECAR)
        args.norm_parquet = str(Path(run) / "data" / "rl.parquet")
    else:
        args.norm_parquet = None
    args.label = args.label or ("tiny-random" if args.tiny else "random" if run else Path(args.av).name)


def bench_vectors(args: argparse.Namespace, d_model: int) -> tuple[torch.Tensor, str]:
    """[sites, D] float32 and where they came from: --parquet's rows (cycled), else scaled Gaussians."""
    from nla_shell.serving.corpus import parquet_sites

    if args.parquet:
        rows = [s.vector for s in itertools.islice(parquet_sites(args.parquet, d_model, chunk=1024), args.sites)]
        vectors = torch.stack([rows[i % len(rows)] for i in range(args.sites)])
        return vectors, f"{args.parquet} ({len(rows)} distinct rows)"
    norm, source = math.sqrt(d_model), "sqrt(d_model)"
    if args.norm_parquet and Path(args.norm_parquet).is_file():
        stored = [s.vector for s in itertools.islice(parquet_sites(args.norm_parquet, d_model, chunk=1024), 1024)]
        norm, source = float(torch.stack(stored).norm(dim=1).mean()), f"mean norm of {args.norm_parquet}"
    vectors = torch.randn(args.sites, d_model, generator=torch.Generator().manual_seed(0))
    return vectors * (norm / vectors.norm(dim=1, keepdim=True)), f"gaussian, norm {norm:.1f} ({source})"


def write_vectors(vectors: torch.Tensor, path: Path) -> Path:
    """The vectors as a parquet of activation_vector rows: the corpus mode's input and the vLLM subprocess's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"activation_vector": pa.array(vectors.tolist(), type=pa.list_(pa.float32()))}), path)
    return path


# --------------------------------------------------------------------------- the legs


def reader_settings(args: argparse.Namespace, engine: str):
    from nla_shell.serving.reader import ReaderSettings

    return ReaderSettings(av=args.av, ar=args.ar, sidecar=args.sidecar, engine=engine,
                          vllm_gpu_mem=args.vllm_gpu_mem, device=args.device)


FILLER = " the"
"""One token of the toy tokenizer (make_8b_run's), appended where a closed explanation would be shorter than the
tokens generated: at the 8B shape most sampled ids lie beyond the toy tokenizer and decode to nothing."""


def closed_explanation(text: str, n_tokens: int, tokenizer) -> str:
    """The text as it is when it holds a closed <explanation> tag; else what follows any opening tag, filled to the
    n_tokens generated and closed: what the AR reads from an AV that stopped at max tokens."""
    import nla_core

    if nla_core.extract_explanation(text) is not None:
        return text
    body = text.split("<explanation>", 1)[-1]
    missing = n_tokens - len(tokenizer.encode(body, add_special_tokens=False))
    return f"<explanation>{body}{FILLER * max(missing, 0)}</explanation>"


class TimedEngine:
    """The reader's engine, its generate calls timed (`seconds`, device drained) and, with a `close_with` tokenizer,
    each rollout's text passed through closed_explanation (bench-side only: what the AR then scores); `closed`
    counts the rollouts so closed."""

    def __init__(self, engine, device: torch.device, *, close_with=None) -> None:
        self.engine, self.device, self.close_with = engine, device, close_with
        self.seconds, self.closed = 0.0, 0

    @property
    def greedy(self) -> bool:
        return self.engine.greedy

    @greedy.setter
    def greedy(self, value: bool) -> None:  # the reader sets it on its engine before every call
        self.engine.greedy = value

    def generate(self, requests, **kwargs):
        seconds, rollouts = syn.timed(lambda: self.engine.generate(requests, **kwargs), self.device)
        self.seconds += seconds
        return rollouts if self.close_with is None else self.closed_rollouts(rollouts)

    def closed_rollouts(self, rollouts):
        """The rollouts with their texts through closed_explanation (counted in `closed`)."""
        import dataclasses

        closed = [closed_explanation(r.text, r.response_len, self.close_with) for r in rollouts]
        self.closed += sum(text != r.text for text, r in zip(closed, rollouts))
        return [dataclasses.replace(r, text=text) for r, text in zip(rollouts, closed)]

    def __getattr__(self, name: str):  # shares_actor_weights, last_stats, close, ...
        return getattr(self.engine, name)


def time_offline(reader, vectors: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """NLAReader.explain over the vectors batch by batch, after one untimed warm-up batch."""
    def explain(index: int, batch: torch.Tensor):
        torch.manual_seed(index)  # sampled, seeded per batch as the corpus mode seeds its batches
        return reader.explain(batch, samples=1, greedy=False, max_new_tokens=args.new_tokens)

    warm_s, _ = syn.timed(lambda: explain(-1, vectors[: args.batch]), device)
    reader.engine.seconds = reader.engine.closed = 0
    seconds, results, memory = syn.measured(
        lambda: [site for i, start in enumerate(range(0, len(vectors), args.batch))
                 for site in explain(i, vectors[start : start + args.batch])], device)
    tokens = sum(r.generated_tokens for r in results)
    generate_s = reader.engine.seconds
    return {"seconds": seconds, "warmup_s": warm_s, "sites_per_s": len(results) / seconds,
            "tokens_per_s": tokens / seconds, "mean_generated_tokens": tokens / len(results),
            "generate_s": generate_s, "score_s": seconds - generate_s, "closed_by_bench": reader.engine.closed,
            "mean_explanation_tokens": statistics.mean(
                len(reader.tokenizer.encode(r.explanation, add_special_tokens=False)) if r.explanation else 0
                for r in results),
            "explained": sum(r.explanation is not None for r in results),
            "scored": sum(r.mse is not None for r in results), **memory}


def time_server(reader, vectors: torch.Tensor, args: argparse.Namespace, engine: str, device: torch.device,
                clients: int) -> dict:
    """The `nla serve` app on a free loopback port in this process, driven by `clients` threads of another process
    (outside_load) until every site is answered."""
    import httpx

    from nla_shell.serving.app import build_app
    from nla_shell.serving.server import ServeConfig, bind, uvicorn_server

    k = args.vectors_per_request
    # model= is required by ServeConfig but only /v1/explain reads it; the reader was loaded without a target LM
    cfg = ServeConfig(av=args.av, ar=args.ar, sidecar=args.sidecar, engine=engine, model=args.av, port=0,
                      max_batch=args.batch, max_sites=k, max_new_tokens=args.new_tokens,
                      max_new_tokens_limit=max(args.new_tokens, 256), device=args.device,
                      batch_max_wait_ms=args.batch_max_wait_ms, max_samples=1, continuous_batching=args.continuous)
    app = build_app(reader, cfg)
    sock = bind("127.0.0.1", 0)
    server = uvicorn_server(app)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    # bodies serialised before the clock starts: the clients' JSON encoding is not the server's cost
    starts = list(range(0, len(vectors), k))
    def body(chunk: torch.Tensor) -> bytes:
        common = {"samples": 1, "greedy": False, "max_new_tokens": args.new_tokens}
        if args.server_encoding == "base64":
            packed = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in chunk]
            return json.dumps({"vectors": packed, "encoding_format": "base64", **common}).encode()
        return json.dumps({"vectors": chunk.tolist(), **common}).encode()

    bodies = [body(vectors[s : s + k]) for s in starts]
    sizes = [min(k, len(vectors) - s) for s in starts]
    width = vectors.shape[1]

    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        warm = httpx.post(f"{url}/v1/explain_vectors", content=bodies[0], timeout=600,
                          headers={"Content-Type": "application/json"})
        warm.raise_for_status()
        syn.reset_peak(device)
        load = outside_load(url, bodies, sizes, clients, args.server_encoding, width)
        peak = syn.peak_gib(device)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        app.state.batcher.close()
        sock.close()
    latencies, seconds, (before, after) = sorted(load["latencies"]), load["seconds"], load["batching"]
    batcher = {key: after[key] - before[key] for key in ("batches", "sites", "jobs", "decode_steps", "idle_s",
                                                          "admit_s", "step_s", "answer_s") if key in after}
    return {"seconds": seconds, "sites_per_s": sum(load["answered"]) / seconds, "requests": len(bodies),
            "encoding": args.server_encoding, "continuous": args.continuous, "clients_process": "separate",
            "clients": clients, "vectors_per_request": k, "sites_in_flight": clients * k,
            "batch_max_wait_ms": args.batch_max_wait_ms, "peak_gib": peak, "failed_requests": load["failures"],
            "sites_answered": sum(load["answered"]),
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * percentile(latencies, 0.99),
            "batcher": {**batcher, "largest_batch_sites": after["largest_batch_sites"],
                        "mean_batch_sites": batcher["sites"] / max(batcher["batches"], 1)}}


def outside_load(url: str, bodies: list[bytes], sizes: list[int], clients: int, encoding: str, width: int) -> dict:
    """client_load in a process of its own (spawned, so it holds no CUDA state): the clients' HTTP and JSON work then
    holds that process's interpreter lock, not the server's, as it does for `nla serve` under outside traffic."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_client_process, args=(send, url, bodies, sizes, clients, encoding, width))
    process.start()
    send.close()
    try:
        load = receive.recv()
    except EOFError:
        raise RuntimeError(f"the client process ended without an answer (exit code {process.exitcode})") from None
    finally:
        process.join(timeout=60)
    return load


def _client_process(send, *args) -> None:
    send.send(client_load(*args))
    send.close()


def client_load(url: str, bodies: list[bytes], sizes: list[int], clients: int, encoding: str, width: int) -> dict:
    """`clients` threads POST `bodies` to /v1/explain_vectors, each taking the next unsent one, until all are answered;
    request i holds sizes[i] vectors. Returns the seconds from the first POST to the last answer, each request's
    latency, the results each got back (0 for a failed one) and the failures. With base64 the client decodes each
    reconstruction, as one would."""
    import httpx

    latencies: list[float] = []
    answered = [0] * len(bodies)
    failures: list[str] = []
    next_request = itertools.count()
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=url, timeout=600, headers={"Content-Type": "application/json"}) as http:
            while (i := next(next_request)) < len(bodies):  # itertools.count's next() is atomic under the GIL
                t0 = time.perf_counter()
                try:
                    answer = http.post("/v1/explain_vectors", content=bodies[i])
                    results, problem = answer.json().get("results"), f"HTTP {answer.status_code} {answer.text[:200]}"
                    if results is not None and encoding == "base64":
                        for r in results:
                            if r["reconstruction"] is not None:
                                raw = base64.b64decode(r["reconstruction"])
                                if len(raw) != 4 * width:
                                    raise ValueError(f"a reconstruction of {len(raw)} bytes, not {4 * width}")
                except Exception as err:  # noqa: BLE001 - a lost request shows as unanswered sites
                    results, problem = None, f"{type(err).__name__}: {err}"
                latency = time.perf_counter() - t0
                with lock:
                    latencies.append(latency)
                    if results is None or len(results) != sizes[i]:
                        failures.append(f"request {i}: {problem}")
                    else:
                        answered[i] = len(results)

    before = httpx.get(f"{url}/v1/info").json()["batching"]  # the server's counters around exactly the timed load
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    after = httpx.get(f"{url}/v1/info").json()["batching"]
    return {"seconds": seconds, "latencies": latencies, "answered": answered, "failures": failures,
            "batching": (before, after)}


@contextlib.contextmanager
def slot_reader(reader) -> Iterator[None]:
    """The reader as the continuous server needs it, for the block: its own engine (the stream decoders do not call
    generate, so TimedEngine is set aside) and, with --close-explanations, the texts closed before the AR scores
    them (NLAReader.site_results, where the continuous server scores)."""
    timed = reader.engine
    reader.engine = timed.engine
    if timed.close_with is not None:
        score = reader.site_results
        reader.site_results = lambda vectors, rollouts, *, samples: score(vectors, timed.closed_rollouts(rollouts),
                                                                          samples=samples)
    try:
        yield
    finally:
        reader.engine = timed
        reader.__dict__.pop("site_results", None)


def served(reader, vectors: torch.Tensor, args: argparse.Namespace, engine: str, device: torch.device,
           clients: int) -> dict:
    """time_server, inside slot_reader's block with --continuous; `closed_by_bench` counts the rollouts closed for
    the AR in the leg (its warm-up request included)."""
    timed = reader.engine
    closed = timed.closed
    with slot_reader(reader) if args.continuous else contextlib.nullcontext():
        case = time_server(reader, vectors, args, engine, device, clients)
    return {**case, "closed_by_bench": timed.closed - closed}


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


def time_corpus(reader, vectors_parquet: Path, args: argparse.Namespace, engine: str, workdir: Path,
                device: torch.device) -> dict:
    """`nla explain --parquet` (explain_corpus) on the already-loaded reader over the same vectors."""
    import pyarrow.parquet as pq

    from nla_shell.serving.corpus import explain_corpus
    from nla_shell.serving.explain import ExplainConfig

    out = workdir / f"corpus_{engine}.parquet"
    cfg = ExplainConfig(av=args.av, ar=args.ar, sidecar=args.sidecar, engine=engine, parquet=str(vectors_parquet),
                        out=str(out), batch_size=args.batch, max_new_tokens=args.new_tokens, overwrite=True,
                        device=args.device, vllm_gpu_mem=args.vllm_gpu_mem, progress_every_s=3600)
    generated_before = reader.engine.seconds  # the TimedEngine's: this leg's generate_s, beside the server's phases
    seconds, _, memory = syn.measured(lambda: explain_corpus(cfg, reader), device)
    generate_s = reader.engine.seconds - generated_before
    tokens = pq.read_table(out, columns=["generated_tokens"]).column(0).to_pylist()
    return {"seconds": seconds, **memory, "sites": len(tokens), "sites_per_s": len(tokens) / seconds,
            "tokens_per_s": sum(tokens) / seconds, "mean_generated_tokens": sum(tokens) / len(tokens),
            "generate_s": generate_s, "score_s": seconds - generate_s}


def run_engine(engine: str, vectors: torch.Tensor, vectors_parquet: Path, args, record: syn.Record,
               workdir: Path) -> None:
    """Load `engine`'s reader, time it offline, and (when it is the server engine) the server and corpus legs."""
    from nla_shell.serving.reader import load_reader
    from nla_shell.training.runtime import resolve_device

    device = resolve_device(args.device, "auto")[0]
    base = {"engine": engine, "label": args.label, "sites": len(vectors), "batch": args.batch,
            "new_tokens": args.new_tokens}
    syn.free_memory(device)
    print(f"[{engine}] loading the reader", flush=True)
    try:
        load_s, reader = syn.timed(lambda: load_reader(reader_settings(args, engine), model=None,
                                                       max_batch=args.batch), device)
    except Exception as err:  # noqa: BLE001 - report and go on with the next engine
        record.error(f"{engine} load", err)
        return
    reader.engine = TimedEngine(reader.engine, device, close_with=reader.tokenizer if args.close_explanations else None)
    legs = [("offline", lambda: time_offline(reader, vectors, args, device))]
    if engine == args.server_engine:  # each round: the corpus rate first, then each server case compared with it
        for _ in range(args.repeats):
            legs += [("corpus", lambda: time_corpus(reader, vectors_parquet, args, engine, workdir, device))]
            legs += [("server", lambda c=c: served(reader, vectors, args, engine, device, c)) for c in args.clients]
    corpus_rate, rounds = math.nan, 0
    for mode, leg in legs:
        print(f"[{engine}] {mode}", flush=True)
        rounds += mode == "corpus"
        try:
            case = {"mode": mode, **base, "closed_explanations": args.close_explanations, "load_s": load_s, **leg()}
        except Exception as err:  # noqa: BLE001
            record.error(f"{engine} {mode}", err)
            if mode == "corpus":  # this round's server cases are set against no earlier round's rate
                corpus_rate = math.nan
            continue
        if mode != "offline":
            case["round"] = rounds
        if mode == "offline" and engine != "hf":
            case["engine_stats"] = getattr(reader.engine, "last_stats", None)
        if mode == "corpus":
            corpus_rate = case["sites_per_s"]
        if mode == "server":
            case["server_over_corpus"] = case["sites_per_s"] / corpus_rate
        record.add(case)
        print(f"  {case['sites_per_s']:.2f} sites/s, {case.get('tokens_per_s', math.nan):.0f} tokens/s", flush=True)
    reader.engine.close()
    del reader
    syn.free_memory(device)


def run_in_subprocess(engine: str, args, vectors_parquet: Path, record: syn.Record, workdir: Path) -> None:
    """This script with --worker --engines ENGINE in its own process (used for vllm, which is created cleanly
    once per process), on the same vectors; its cases, errors and skips merged into ours."""
    out = workdir / f"{engine}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engines", engine, "--av", args.av,
           "--ar", args.ar, "--parquet", str(vectors_parquet), "--label", args.label, "--sites", str(args.sites),
           "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--vllm-gpu-mem", str(args.vllm_gpu_mem),
           "--device", args.device, "--clients", ",".join(map(str, args.clients)), "--repeats", str(args.repeats),
           "--batch-max-wait-ms", str(args.batch_max_wait_ms),
           "--vectors-per-request", str(args.vectors_per_request), "--server-encoding", args.server_encoding,
           "--out", str(out)]
    cmd += ["--sidecar", args.sidecar] if args.sidecar else []
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--close-explanations"] if args.close_explanations else []
    cmd += ["--server-engine", engine] if args.server_engine == engine else []
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
    print(f"[{engine}] {' '.join(cmd)}", flush=True)
    try:
        subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.vllm_timeout, check=True)
    except Exception as err:  # noqa: BLE001 - keep what the worker saved before it failed
        record.error(f"{engine} subprocess", err)
    if out.is_file():
        worker = json.loads(out.read_text())
        for case in worker["cases"]:
            record.add(case)
        record.data["errors"] += worker["errors"]
        record.data["skipped"].update(worker.get("skipped", {}))
    record.save()


# --------------------------------------------------------------------------- main


def summary(cases: list[dict]) -> str:
    """The table: per case its rate, the offline split into generation and the AR's scoring (with the sites the AR
    scored), the server's rate over the corpus rate, and latency."""
    hf = {(c["mode"], c["label"]): c["sites_per_s"] for c in cases if c["engine"] == "hf"}
    lines = [f"{'mode':10} {'engine':7} {'label':18} {'sites/s':>9} {'tokens/s':>9} {'x hf':>6} {'gen s':>7} "
             f"{'AR s':>7} {'scored':>7} {'/corpus':>7} {'p50 ms':>8} {'p99 ms':>8} {'peak GiB':>8}"]
    for c in cases:
        ratio = c["sites_per_s"] / hf[(c["mode"], c["label"])] if (c["mode"], c["label"]) in hf else math.nan
        mode = f"server/{c['clients']}" if c["mode"] == "server" else c["mode"]
        lines.append(f"{mode:10} {c['engine']:7} {c['label'][:18]:18} {c['sites_per_s']:9.2f} "
                     f"{c.get('tokens_per_s', math.nan):9.0f} {ratio:6.2f} {c.get('generate_s', math.nan):7.2f} "
                     f"{c.get('score_s', math.nan):7.2f} {c.get('scored', '-'):>7} "
                     f"{c.get('server_over_corpus', math.nan):7.2f} {c.get('p50_ms', math.nan):8.0f} "
                     f"{c.get('p99_ms', math.nan):8.0f} {c.get('peak_gib', math.nan):8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.tiny:
        # two OpenMP threads on a tiny model in the main thread spin against each other (10x slower than in
        # the server's worker thread on a busy 2-core machine): one thread keeps the legs comparable
        torch.set_num_threads(1)
    resolve_inputs(args)
    from nla_shell.io.sidecars import load_sidecar
    from nla_shell.serving.reader import model_sidecar_path
    from nla_shell.training.runtime import resolve_device

    device = resolve_device(args.device, "auto")[0]
    settings = {k: v for k, v in vars(args).items() if k != "worker"}
    record = syn.Record(args.out, {**syn.environment(device), "machine": os.uname().nodename,
                                   "cpu_count": os.cpu_count(), "settings": settings, "skipped": {}})
    workdir = Path(tempfile.mkdtemp(prefix="bench_explain_"))
    d_model = load_sidecar(model_sidecar_path(args.av, args.ar, args.sidecar)).d_model
    vectors, source = bench_vectors(args, d_model)
    vectors_parquet = write_vectors(vectors, workdir / "vectors.parquet")
    record.data.update(vectors=source, d_model=d_model)
    record.save()
    print(f"[inputs] av {args.av}, ar {args.ar}, {len(vectors)} vectors: {source}", flush=True)
    for engine in args.engines:
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            record.data["skipped"]["vllm"] = VLLM_HINT
            record.save()
            print(f"[vllm] skipped: {VLLM_HINT}", flush=True)
        elif engine == "vllm" and not args.worker:
            syn.free_memory(device)
            run_in_subprocess("vllm", args, vectors_parquet, record, workdir)
        else:
            run_engine(engine, vectors, vectors_parquet, args, record, workdir)
    table = summary(record.data["cases"])
    record.data["table"] = table
    record.save()
    print(table)
    print(f"saved {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
