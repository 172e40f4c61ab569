"""The FastAPI app of `nla serve`: request and response schemas, limits, errors, timeouts.

Every refusal is JSON, `{"error": {"field": "vectors[2]", "message": "..."}}`, naming the field
(in the request body's terms, `positions[0]`, or `body` when it is not a JSON object; null
when no field is at fault): 400 malformed JSON (an empty body, or nesting past the parser's
depth, included), 401 a missing or wrong bearer token, 404 no such path, 405 a method the path
does not take, 413 a body past max_body_mb, 422 a bad or out-of-limit field, 500 a failure
while explaining, 503 (with Retry-After) more than max_queue requests waiting, 504 no answer
within request_timeout_s. The server keeps serving after each. The token and the body's size
are checked before the body is parsed (nla_shell.serving.guard).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from typing import Annotated, Any, Literal, Sequence

import numpy as np
import pydantic_core
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from nla_shell.serving.batcher import Batcher, QueueFull
from nla_shell.serving.jobs import Decoding, Job
from nla_shell.serving.config import ServeConfig
from nla_shell.serving.guard import Guard, busy_response, error_response
from nla_shell.serving.reader import NLAReader, SiteExplanation

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Decode(_Strict):
    samples: int = Field(1, description="Explanations sampled per site; the best by AR reconstruction is kept.")
    greedy: bool = Field(False, description="Argmax decoding (deterministic; then samples must be 1).")
    max_new_tokens: int | None = Field(None, description="Longest explanation in tokens; null: the server's default.")


class ExplainRequest(Decode):
    text: str = Field(description="The text whose activations are read with the target LM.")
    positions: list[int] | None = Field(None, description="Token indices to explain (negative from the end); "
                                                          "null (and all false): the last token only.")
    all: bool = Field(False, description="Explain every position (positions must then be null).")


EncodingFormat = Literal["float", "base64"]
ENCODING_DOC = ('"float" (the default): vectors and reconstructions are lists of numbers; "base64": each is '
                'one base64 string of d_model little-endian float32 (4 x d_model bytes), as OpenAI\'s '
                'embeddings API encoding_format="base64"')


class VectorsRequest(Decode):
    vectors: list[list[FiniteFloat]] = Field(description="n activation vectors of d_model finite numbers each.")
    encoding_format: EncodingFormat = Field("float", description=ENCODING_DOC)


class Base64VectorsRequest(Decode):
    vectors: list[str] = Field(description="n activation vectors, each base64 of d_model little-endian float32.")
    encoding_format: Literal["base64"] = Field(description=ENCODING_DOC)


class SiteResult(BaseModel):
    explanation: str | None = Field(description="The kept explanation (best of `samples` by reconstruction MSE).")
    explanations: list[str | None] = Field(description="All sampled explanations (null: none could be extracted).")
    mses: list[float | None] = Field(description="Normalised reconstruction MSE of each explanation.")
    mse: float | None = Field(description="MSE of the kept explanation.")
    fve: float | None = Field(description="Its FVE against the AR's predict-the-mean baseline.")


class PositionResult(SiteResult):
    position: int
    token: str
    short_context: bool = Field(description="Fewer tokens before it than the AV's training data had.")


class VectorResult(SiteResult):
    reconstruction: list[float] | str | None = Field(
        description="The AR's reconstruction from the kept explanation: d_model numbers, or with "
                    "encoding_format=\"base64\" base64 of d_model little-endian float32.")


class ExplainResponse(BaseModel):
    text_tokens: int
    results: list[PositionResult]


class VectorsResponse(BaseModel):
    results: list[VectorResult]


class RequestError(Exception):
    """A refused request: its HTTP status, the field at fault and what to do."""

    def __init__(self, status: int, field: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.field, self.message, self.headers = status, field, message, headers


def field_path(loc: Sequence[Any]) -> str:
    """('vectors', 0, 3) -> 'vectors[0][3]'; the body itself (an empty loc) -> 'body'."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body"


def refusal(errors: Sequence[dict[str, Any]]) -> RequestError:
    """Pydantic's validation errors as one refusal naming the first field at fault."""
    first = errors[0]
    field = field_path(first["loc"])
    if first["type"] == "extra_forbidden":
        return RequestError(422, field, "unknown field; see GET /openapi.json for the fields each endpoint takes")
    return RequestError(422, field, first["msg"])


def decoding(request: Decode, cfg: ServeConfig) -> Decoding:
    """The request's decoding settings, within the server's limits."""
    max_new = cfg.max_new_tokens if request.max_new_tokens is None else request.max_new_tokens
    if not 1 <= max_new <= cfg.max_new_tokens_limit:
        raise RequestError(422, "max_new_tokens", f"{max_new} is outside 1..{cfg.max_new_tokens_limit} (the limit)")
    if not 1 <= request.samples <= cfg.max_samples:
        raise RequestError(422, "samples", f"{request.samples} is outside 1..{cfg.max_samples} (the limit)")
    if request.greedy and request.samples > 1:
        raise RequestError(422, "samples", "greedy decoding writes one explanation; use samples=1 or greedy=false")
    return Decoding(samples=request.samples, greedy=request.greedy, max_new_tokens=max_new)


def text_job(request: ExplainRequest, reader: NLAReader, cfg: ServeConfig) -> Job:
    """The sites of a text, checked against the limits."""
    if len(request.text) > cfg.max_text_chars:
        raise RequestError(422, "text", f"{len(request.text)} characters; the limit is {cfg.max_text_chars}")
    ids = reader.target_tokenizer.encode(request.text, add_special_tokens=False)
    if not ids:
        raise RequestError(422, "text", "encodes to no tokens; give some text")
    if len(ids) > cfg.max_text_tokens:
        raise RequestError(422, "text", f"{len(ids)} tokens; the limit is {cfg.max_text_tokens}")
    if request.all and request.positions is not None:
        raise RequestError(422, "all", "all and positions exclude each other; give one")
    positions = list(range(len(ids))) if request.all else (request.positions or [-1])
    for i, p in enumerate(positions):
        if not -len(ids) <= p < len(ids):
            raise RequestError(422, f"positions[{i}]", f"{p} is outside the text's {len(ids)} tokens")
    if len(positions) > cfg.max_sites:
        raise RequestError(422, "all" if request.all else "positions",
                           f"{len(positions)} sites; the limit is {cfg.max_sites} per request")
    return Job(decoding(request, cfg), token_ids=ids, positions=[p % len(ids) for p in positions])


def parse_json(body: bytes) -> Any:
    """A request body parsed by pydantic-core (in Rust, not json.loads, with a nesting limit); 400 when it is not
    JSON (an empty body included)."""
    try:
        return pydantic_core.from_json(body)
    except ValueError as err:
        raise RequestError(400, "body", f"malformed JSON: {err}") from None


def validated(model: type[BaseModel], data: Any) -> Any:
    """`data` as a `model`; a RequestError naming the first field at fault when it is not one."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise refusal(err.errors(include_url=False)) from None


def parse_vectors_request(body: bytes) -> VectorsRequest | Base64VectorsRequest:
    """The /v1/explain_vectors body, validated as the float or the base64 form by its encoding_format."""
    data = parse_json(body)
    model = Base64VectorsRequest if isinstance(data, dict) and data.get("encoding_format") == "base64" else VectorsRequest
    return validated(model, data)


def decode_base64_vector(text: str, index: int, d_model: int) -> np.ndarray:
    """vectors[index] in the base64 form: [d_model] float32 from 4 x d_model little-endian bytes."""
    field = f"vectors[{index}]"
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise RequestError(422, field, f"is not base64 ({err}); give base64 of {d_model} little-endian float32")
    if len(raw) != 4 * d_model:
        raise RequestError(422, field, f"decodes to {len(raw)} bytes ({len(raw) / 4:g} float32); d_model is "
                                       f"{d_model}: give {4 * d_model} bytes")
    return np.frombuffer(raw, dtype="<f4")


def vectors_job(request: VectorsRequest | Base64VectorsRequest, reader: NLAReader, cfg: ServeConfig) -> Job:
    """The vectors, checked for width, count and finiteness (either encoding)."""
    if not request.vectors:
        raise RequestError(422, "vectors", "no vectors; give n lists of d_model numbers")
    if len(request.vectors) > cfg.max_sites:
        raise RequestError(422, "vectors", f"{len(request.vectors)} vectors; the limit is {cfg.max_sites} per request")
    if isinstance(request, Base64VectorsRequest):
        rows = [decode_base64_vector(text, i, reader.d_model) for i, text in enumerate(request.vectors)]
        vectors = torch.from_numpy(np.stack(rows).astype(np.float32))  # native-endian, writable
        bad = ~torch.isfinite(vectors)
        if bad.any():
            i, j = torch.nonzero(bad)[0].tolist()
            raise RequestError(422, f"vectors[{i}][{j}]", "Input should be a finite number (the float32 is NaN or "
                                                          "infinite)")
        return Job(decoding(request, cfg), vectors=vectors)
    for i, vector in enumerate(request.vectors):
        if len(vector) != reader.d_model:
            raise RequestError(422, f"vectors[{i}]", f"has {len(vector)} numbers; d_model is {reader.d_model}")
    vectors = torch.tensor(request.vectors, dtype=torch.float32)
    for i in torch.nonzero(~torch.isfinite(vectors).all(dim=1)).flatten().tolist():
        raise RequestError(422, f"vectors[{i}]", "overflows float32 (a number beyond ±3.4e38)")
    return Job(decoding(request, cfg), vectors=vectors)


def encode_reconstruction(reconstruction: torch.Tensor | None, encoding: EncodingFormat) -> list[float] | str | None:
    if reconstruction is None:
        return None
    if encoding == "base64":
        return base64.b64encode(reconstruction.float().numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return reconstruction.tolist()


def vectors_response(sites: Sequence[SiteExplanation], encoding: EncodingFormat) -> Response:
    """The answer serialised by pydantic-core (not json.dumps, ~10x slower on 1M floats); NaN/inf become null."""
    results = [{**site_fields(s), "reconstruction": encode_reconstruction(s.reconstruction, encoding)} for s in sites]
    return Response(pydantic_core.to_json({"results": results}, inf_nan_mode="null"), media_type="application/json")


VECTORS_BODY_SCHEMA = {"oneOf": [VectorsRequest.model_json_schema(), Base64VectorsRequest.model_json_schema()]}


def site_fields(site: SiteExplanation) -> dict[str, Any]:
    return {"explanation": site.explanation, "explanations": site.explanations, "mses": site.mses, "mse": site.mse,
            "fve": site.fve}


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is already read: the server's next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def run_job(app: FastAPI, job: Job, request: Request, *, timeout_s: float) -> list[SiteExplanation]:
    """The job's results, waited for until they come, the client leaves or timeout_s passes; in the last two cases
    the job is cancelled, which drops its sites if the worker has not started it (and touches no other job)."""
    # QueueFull (a 503, answered by build_app's handler): the room the guard saw before the body was read has gone
    answer = asyncio.wrap_future(app.state.batcher.submit(job))
    gone = asyncio.ensure_future(client_gone(request))
    try:
        done, _ = await asyncio.wait({answer, gone}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            # the job's own future at once (dropped unless started): cancelling `answer` alone would reach it only
            # on the loop's next turn, after the answer below may have been written and the worker moved on
            job.future.cancel()
            answer.cancel()
    if answer in done:
        try:
            return answer.result()
        except Exception as err:  # noqa: BLE001 - reported as a 500, the server goes on
            raise RequestError(500, None, f"explaining failed: {type(err).__name__}: {err}") from None
    if gone in done:
        raise RequestError(499, None, "the client disconnected")  # nobody reads it; the access log may
    raise RequestError(504, None, f"not answered within {timeout_s:g} s (request_timeout_s); the server is busy or "
                                  "the request too large: retry later or ask for fewer sites")


def body_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI requestBody of an endpoint that parses its own body (FastAPI does not see the model)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def build_app(reader: NLAReader, cfg: ServeConfig) -> FastAPI:
    """The app, with its batcher (app.state.batcher: close it when done) and its guard (the token and the body's
    size, checked before any endpoint runs)."""
    app = FastAPI(title="nla serve", version="1", description="Natural Language Autoencoder: explain activations.")
    app.state.batcher = Batcher(reader, max_sites=cfg.max_batch, wait_s=cfg.batch_wait_ms / 1000,
                                max_wait_s=cfg.batch_max_wait_ms / 1000, max_queue=cfg.max_queue,
                                continuous=cfg.continuous_batching, max_new_tokens=cfg.max_new_tokens_limit)
    app.add_middleware(Guard, api_key=cfg.resolved_api_key(), max_body_bytes=int(cfg.max_body_mb * 1_000_000),
                       busy=app.state.batcher.refusal)

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return error_response(err.status, err.field, err.message, err.headers)

    @app.exception_handler(QueueFull)
    async def busy(request: Request, err: QueueFull) -> JSONResponse:
        return busy_response(str(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        path = request.url.path
        message = {404: f"no endpoint {path}; see GET /openapi.json for the endpoints",
                   405: f"{request.method} is not allowed on {path}"}.get(err.status_code, str(err.detail))
        return error_response(err.status_code, None, message, err.headers)

    @app.exception_handler(Exception)
    async def crashed(request: Request, err: Exception) -> JSONResponse:
        return error_response(500, None, f"internal error: {type(err).__name__}: {err}")

    @app.get("/v1/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/info")
    async def info() -> dict[str, Any]:
        limits = {key: getattr(cfg, key) for key in (
            "max_batch", "max_sites", "max_text_chars", "max_text_tokens", "max_new_tokens", "max_new_tokens_limit",
            "max_samples", "max_body_mb", "max_queue", "request_timeout_s")}
        batching = {**app.state.batcher.counters(), "waiting": app.state.batcher.waiting,
                    "continuous": cfg.continuous_batching}
        return {**reader.info(), "limits": limits, "batching": batching}

    @app.post("/v1/explain", response_model=ExplainResponse, openapi_extra=body_schema(ExplainRequest.model_json_schema()))
    async def explain(request: Request) -> ExplainResponse:
        job = text_job(validated(ExplainRequest, parse_json(await request.body())), reader, cfg)
        sites = await run_job(app, job, request, timeout_s=cfg.request_timeout_s)
        tokenizer = reader.target_tokenizer
        return ExplainResponse(text_tokens=len(job.token_ids), results=[
            PositionResult(position=p, token=tokenizer.decode([job.token_ids[p]]),
                           short_context=p < reader.min_context, **site_fields(site))
            for p, site in zip(job.positions, sites)])

    @app.post("/v1/explain_vectors", response_model=VectorsResponse, openapi_extra=body_schema(VECTORS_BODY_SCHEMA))
    async def explain_vectors(request: Request) -> Response:
        # parsed here rather than by FastAPI: json.loads + re-encoding by json.dumps cost ~1 s of event-loop
        # (and GIL) time per 256 x 4096 floats; pydantic-core's parser and serialiser take a fraction of it
        body = parse_vectors_request(await request.body())
        sites = await run_job(app, vectors_job(body, reader, cfg), request, timeout_s=cfg.request_timeout_s)
        return vectors_response(sites, body.encoding_format)

    return app
