"""Tokenizer checks, the streamed RL / SFT parquet and its doc-disjoint eval split.

An RL parquet holds one row per sampled (document, position): `prompt`, a list of chat
messages ({"role", "content"}) whose contents hold the placeholder `<INJECT>` exactly
once; `activation_vector`, D floats (fixed_size_list<float32>[D] as upstream's datagen and
`nla datagen` write it, or any list of floats); `doc_id`, a string. An AR-SFT parquet's
`prompt` is instead the filled AR template, a string. The sidecar (nla_shell.io.sidecars)
says D, the layer, the prompt templates and the injection token with the ids of its
neighbours. Every problem raises `DataError` naming the field and the fix, before the
trainer writes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from nla_core import (
    INJECT_PLACEHOLDER, HeldoutDocs, NLAConfig, canonical_neighbors, doc_disjoint_rows, marker_well_formed, spread_rows,
)

__all__ = [
    "INJECT_PLACEHOLDER",
    "REQUIRED_COLUMNS",
    "DataError",
    "RLRow",
    "av_prompt_messages",
    "build_prompt_ids",
    "chat_prompt_ids",
    "chat_prompt_text",
    "check_tokenizer",
    "RowWindows",
    "load_eval_rows",
    "load_heldout_rows",
    "load_rows",
    "parquet_num_rows",
    "row_windows",
    "stream_rows",
    "validate_parquet_schema",
]

REQUIRED_COLUMNS = ("prompt", "activation_vector", "doc_id")
COLUMN_HINTS = {
    "response": "nla sft --mode av reads the AV's target text from datagen's av_sft.parquet (--mode ar reads "
                "ar_sft.parquet, whose text is in `prompt`): point parquet at av_sft.parquet",
}
"""The fix for a missing column that only some of datagen's splits hold; the others are in every split."""
_DRIFT_FIX = "regenerate the sidecar with this tokenizer or point av_ckpt at the tokenizer the data was made with"


class DataError(ValueError):
    """A dataset, sidecar or tokenizer problem; the message names the field and the fix."""


# ---------------------------------------------------------------- prompts and the tokenizer


def av_prompt_messages(template: str) -> list[dict[str, str]]:
    """The AV prompt for a template holding `<INJECT>`: one user message."""
    return [{"role": "user", "content": template}]


def chat_prompt_text(messages: Sequence[Mapping[str, Any]], injection_char: str, tokenizer: Any) -> str:
    """The chat-templated prompt (generation prompt added) with `<INJECT>` replaced by `injection_char`.

    Non-string contents pass through untouched, as in the reference.
    """
    msgs = [
        {**m, "content": m["content"].replace(INJECT_PLACEHOLDER, injection_char)}
        if isinstance(m.get("content"), str)
        else dict(m)
        for m in messages
    ]
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)


def chat_prompt_ids(messages: Sequence[Mapping[str, Any]], injection_char: str, tokenizer: Any) -> list[int]:
    """Token ids of `chat_prompt_text`, encoded without special tokens: the template already
    writes them, and a second pass would add a BOS on tokenizers that have one."""
    return list(tokenizer.encode(chat_prompt_text(messages, injection_char, tokenizer), add_special_tokens=False))


def _row_label(row: int | None, doc_id: str | None = None) -> str:
    if row is None:
        return "the prompt"
    return f"row {row}" + (f" (doc_id {doc_id!r})" if doc_id is not None else "")


def _check_placeholders(messages: Sequence[Mapping[str, Any]], label: str) -> None:
    n = sum(m["content"].count(INJECT_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if n != 1:
        raise DataError(
            f"prompt: {label} holds {n} {INJECT_PLACEHOLDER} placeholders; each prompt needs exactly one "
            "(fix the dataset's prompt column)"
        )


def check_tokenizer(
    cfg: NLAConfig, tokenizer: Any, prompt_messages: Sequence[Mapping[str, Any]] | None = None
) -> None:
    """Check the live tokenizer against the sidecar.

    The injection char must encode to exactly `tokens.injection_token_id`, and in the
    chat-templated AV prompt (`prompt_messages`, default the sidecar's AV template) the
    marker's neighbours must be the sidecar's. Raises DataError on any drift.
    """
    char, marker = cfg.injection_char, cfg.injection_token_id
    ids = list(tokenizer.encode(char, add_special_tokens=False))
    if len(ids) != 1:
        raise DataError(
            f"tokens.injection_char: {char!r} encodes to {len(ids)} tokens {ids} with this tokenizer, "
            f"the sidecar expects the single token {marker}; {_DRIFT_FIX}"
        )
    if ids[0] != marker:
        raise DataError(
            f"tokens.injection_token_id: sidecar says {marker}, the tokenizer gives {ids[0]} for {char!r}; {_DRIFT_FIX}"
        )

    messages = av_prompt_messages(cfg.actor_prompt_template) if prompt_messages is None else prompt_messages
    _check_placeholders(messages, "the AV prompt")
    prompt_ids = chat_prompt_ids(messages, char, tokenizer)
    try:
        left, right = canonical_neighbors(prompt_ids, marker)
    except ValueError as err:
        raise DataError(f"tokens.injection_token_id: in the chat-templated AV prompt, {err}; {_DRIFT_FIX}") from None
    for name, expected, live in (
        ("tokens.injection_left_neighbor_id", cfg.injection_left_neighbor_id, left),
        ("tokens.injection_right_neighbor_id", cfg.injection_right_neighbor_id, right),
    ):
        if live != expected:
            raise DataError(
                f"{name}: sidecar says {expected}, the tokenizer gives {live} "
                f"({tokenizer.convert_ids_to_tokens(live)!r}) next to the marker in the chat-templated AV prompt; "
                f"{_DRIFT_FIX}"
            )


def build_prompt_ids(
    messages: Sequence[Mapping[str, Any]], cfg: NLAConfig, tokenizer: Any, *, row: int | None = None
) -> list[int]:
    """Prompt token ids for one row, with exactly one well-formed injection marker.

    `row` only labels error messages. Raises DataError when the messages hold zero or
    several `<INJECT>`, or when the marker ends up with other neighbours than the
    sidecar's (the prompt text differs around `<INJECT>`, or contains the injection char).
    """
    label = _row_label(row)
    _check_placeholders(messages, label)
    ids = chat_prompt_ids(messages, cfg.injection_char, tokenizer)
    marker = cfg.injection_token_id
    if not marker_well_formed(
        ids, marker_id=marker, left_id=cfg.injection_left_neighbor_id, right_id=cfg.injection_right_neighbor_id
    ):
        count = ids.count(marker)
        if count != 1:
            why = (
                f"the injection char {cfg.injection_char!r} occurs {count} times after templating "
                "(the prompt text itself holds it)"
            )
        else:
            p = ids.index(marker)
            got = (ids[p - 1] if p > 0 else None, ids[p + 1] if p + 1 < len(ids) else None)
            why = (
                f"the marker's neighbours are {got}, the sidecar's tokens.injection_left_neighbor_id/"
                f"right_neighbor_id are {(cfg.injection_left_neighbor_id, cfg.injection_right_neighbor_id)}"
            )
        raise DataError(
            f"prompt: {label}: injection marker not well-formed: {why}. Write {INJECT_PLACEHOLDER} in the same "
            "surrounding text as the sidecar's AV template, or regenerate the sidecar for these prompts"
        )
    return ids


# ---------------------------------------------------------------- the parquet


@dataclass(frozen=True)
class RLRow:
    """One RL example."""

    prompt: list[dict[str, Any]] | str
    """Chat messages whose string contents hold `<INJECT>` exactly once in all; an AR-SFT row's filled AR template."""
    activation: torch.Tensor
    """[D] float32, finite, non-zero."""
    doc_id: str
    """Source document; eval rows never share one with training rows."""
    index: int
    """Row number in the parquet file (0-based)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Values of the `extra_columns` asked for (e.g. position, context)."""


def validate_parquet_schema(
    path: str | Path, *, d_model: int, text_prompt: bool = False, key: str = "rl_parquet"
) -> pq.ParquetFile:
    """Check the required columns and the activation width D; return the open file.

    `prompt` holds chat messages, or with text_prompt a string (an AR-SFT parquet: the
    filled AR template, as upstream nla/datagen/stage3_build.py writes it). `key` is the
    config key that named the file, for the messages.
    Fixed-size activation lists are checked from the schema alone; variable-length lists
    by the lengths in the first row group (stream_rows checks every row).
    """
    pf = open_parquet(path, key=key)
    schema = pf.schema_arrow
    for name in REQUIRED_COLUMNS:
        if name not in schema.names:
            raise DataError(
                f"{key}: {path} has no column {name!r} (columns present: {schema.names}); every nla parquet "
                f"(rl, av_sft, ar_sft, eval) needs {list(REQUIRED_COLUMNS)}: give a parquet written by nla datagen"
            )
    prompt_type = schema.field("prompt").type
    is_text = pa.types.is_string(prompt_type) or pa.types.is_large_string(prompt_type)
    if text_prompt and not is_text:
        raise DataError(
            f"prompt: column type is {prompt_type} in {path}, expected string (an AR-SFT parquet's prompt is the "
            "filled AR template); point parquet at the ar_sft split"
        )
    if not text_prompt and not (
        (pa.types.is_list(prompt_type) or pa.types.is_large_list(prompt_type))
        and pa.types.is_struct(prompt_type.value_type)
        and {"role", "content"} <= {f.name for f in prompt_type.value_type}
    ):
        raise DataError(
            f"prompt: column type is {prompt_type}, expected chat messages, list<struct<role: string, content: string>>"
            + (" (a string prompt is an AR-SFT parquet: use it with `nla sft mode=ar`)" if is_text else "")
        )
    act_type = schema.field("activation_vector").type
    is_list = pa.types.is_list(act_type) or pa.types.is_large_list(act_type) or pa.types.is_fixed_size_list(act_type)
    if not (is_list and pa.types.is_floating(act_type.value_type)):
        raise DataError(
            f"activation_vector: column type is {act_type}, expected a list of floats (fixed_size_list<float32>[D])"
        )
    if pa.types.is_fixed_size_list(act_type):
        widths = {act_type.list_size}
    elif pf.num_row_groups:
        lengths = pc.list_value_length(pf.read_row_group(0, columns=["activation_vector"]).column(0))
        widths = set(pc.unique(lengths.drop_null()).to_pylist())
    else:
        widths = set()
    if widths - {d_model}:
        raise DataError(
            f"activation_vector: length {sorted(widths)} in {path}, but the sidecar's d_model is {d_model}; "
            "use the sidecar written with this parquet (or regenerate the data)"
        )
    return pf


def _activation_matrix(column: pa.ChunkedArray, d_model: int, labels: list[str]) -> np.ndarray:
    """[n, D] float32 from a list column, via numpy on the flattened values.

    Converting 4096-float lists row by row with to_pylist dominates load time on real
    data (minutes for a full file), so the values go through numpy in one piece.
    `labels` name the n rows in error messages.
    """
    arr = column.combine_chunks()
    if arr.null_count:
        i = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"activation_vector: {labels[i]} is null; every row needs an activation")
    if not pa.types.is_fixed_size_list(arr.type):
        lengths = pc.list_value_length(arr).to_numpy()
        bad = np.flatnonzero(lengths != d_model)
        if bad.size:
            i = int(bad[0])
            raise DataError(
                f"activation_vector: {labels[i]} has length {lengths[i]}, the sidecar's d_model is {d_model}; "
                "regenerate the row or use the matching sidecar"
            )
    # flatten() (not .values) honours the slice offset; nulls inside a list become NaN.
    values = arr.flatten().to_numpy(zero_copy_only=False)
    acts = values.astype(np.float32).reshape(len(arr), d_model)
    problems = (
        (~np.isfinite(acts).all(axis=1), "holds NaN or inf"),
        (~acts.any(axis=1), "is all zeros, which cannot be norm-matched at injection"),
    )
    for bad, what in problems:
        rows = np.flatnonzero(bad)
        if rows.size:
            raise DataError(
                f"activation_vector: {labels[int(rows[0])]} {what} ({rows.size} such rows in this row group); "
                "drop or regenerate those rows"
            )
    return acts


def _stream(
    pf: pq.ParquetFile,
    cfg: NLAConfig,
    start: int,
    stop: int | None,
    keep: set[int] | None,
    extra_columns: Sequence[str],
) -> Iterator[RLRow]:
    """Validated rows [start, stop) (only those in `keep`, when given), row group by row group."""
    missing = [c for c in extra_columns if c not in pf.schema_arrow.names]
    if missing:
        raise DataError(
            f"{missing[0]}: column missing (columns present: {pf.schema_arrow.names}); "
            + (COLUMN_HINTS.get(missing[0]) or "give a parquet written by nla datagen, which writes it in every split")
        )
    stop = pf.metadata.num_rows if stop is None else min(stop, pf.metadata.num_rows)
    columns = [*REQUIRED_COLUMNS, *extra_columns]
    group_start = 0
    for g in range(pf.num_row_groups):
        if group_start >= stop:
            break
        n = pf.metadata.row_group(g).num_rows
        lo, hi = max(start - group_start, 0), min(stop - group_start, n)
        indices = [group_start + i for i in range(lo, hi) if keep is None or group_start + i in keep]
        group_start += n
        if not indices:
            continue
        # Select rows before converting anything: only they pay for to_pylist / numpy.
        table = pf.read_row_group(g, columns=columns)
        table = table.slice(lo, hi - lo) if keep is None else table.take([i - (group_start - n) for i in indices])
        doc_ids = table.column("doc_id").to_pylist()
        for index, doc_id in zip(indices, doc_ids):
            if doc_id is None:
                raise DataError(f"doc_id: {_row_label(index)} is null; every row needs its document id")
        labels = [_row_label(index, str(doc_id)) for index, doc_id in zip(indices, doc_ids)]
        acts = torch.from_numpy(_activation_matrix(table.column("activation_vector"), cfg.d_model, labels))
        prompts = table.column("prompt").to_pylist()
        extras = {c: table.column(c).to_pylist() for c in extra_columns}
        for j, (index, prompt) in enumerate(zip(indices, prompts)):
            if not prompt:
                raise DataError(f"prompt: {labels[j]} is empty; each prompt is a list of chat messages (or AR text)")
            if not isinstance(prompt, str):
                _check_placeholders(prompt, labels[j])
            yield RLRow(prompt, acts[j], str(doc_ids[j]), index, {c: v[j] for c, v in extras.items()})


def stream_rows(
    path: str | Path,
    cfg: NLAConfig,
    *,
    start: int = 0,
    stop: int | None = None,
    extra_columns: Sequence[str] = (),
    text_prompt: bool = False,
    key: str = "rl_parquet",
) -> Iterator[RLRow]:
    """Validated rows [start, stop) of an RL/SFT parquet, read one row group at a time.

    Reads only `prompt`, `activation_vector`, `doc_id` and the `extra_columns` asked for
    (their values land in RLRow.extras). Each activation must have length cfg.d_model, be
    finite and be non-zero; each prompt must hold one `<INJECT>` (with text_prompt: be a
    non-empty string, the filled AR template). Raises DataError naming the row and its
    doc_id otherwise; `key` names the config key of the file in messages.
    """
    pf = validate_parquet_schema(path, d_model=cfg.d_model, text_prompt=text_prompt, key=key)
    return _stream(pf, cfg, start, stop, None, extra_columns)


def load_rows(path: str | Path, cfg: NLAConfig, *, max_rows: int | None = None, min_rows: int = 1) -> list[RLRow]:
    """The first max_rows validated rows (all when None); DataError when fewer than min_rows."""
    rows = list(stream_rows(path, cfg, stop=max_rows))
    if len(rows) < min_rows:
        raise DataError(
            f"rl_parquet: {path} yields {len(rows)} rows (max_rows={max_rows}), fewer than the {min_rows} needed "
            "(batch_prompts); use a larger dataset, raise max_rows or lower batch_prompts"
        )
    return rows


def open_parquet(path: str | Path, *, key: str) -> pq.ParquetFile:
    """The parquet file at `path` (its footer read), or DataError naming the config `key`."""
    try:
        return pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as err:
        raise DataError(f"{key}: cannot open {path} as parquet: {err}") from None


def parquet_num_rows(path: str | Path, *, key: str = "rl_parquet") -> int:
    """Rows in a parquet file, from its footer."""
    return open_parquet(path, key=key).metadata.num_rows


@dataclass(frozen=True)
class RowWindows:
    """Which rows of one parquet train and which are held out."""

    train_stop: int | None
    """Training reads rows [0, train_stop); None reads them all."""
    eval_start: int | None
    """Held-out rows come from [eval_start, end) (documents unseen in training only); None: no eval here."""


def row_windows(n_rows: int, *, max_rows: int | None, eval_skip_rows: int | None, n_eval: int) -> RowWindows:
    """The training and held-out windows of an n_rows parquet.

    n_eval = 0 (eval off, or held-out rows from another file): train on the first max_rows.
    eval_skip_rows given (the reference's window): eval from that row on; training stops at
    max_rows, or at eval_skip_rows when max_rows is None. Neither given: the last tenth of
    the rows (at least n_eval, at most half) is held out, so the defaults work on any size.
    """
    if n_eval == 0:
        return RowWindows(max_rows, None)
    if eval_skip_rows is not None:
        if eval_skip_rows >= n_rows:
            raise DataError(
                f"eval_skip_rows: {eval_skip_rows} is past the parquet's last row ({n_rows} rows); lower it, "
                "leave it unset (the last tenth is held out), or pass eval_parquet="
            )
        stop = eval_skip_rows if max_rows is None else max_rows
        if stop > eval_skip_rows:
            raise DataError(
                f"eval_skip_rows: eval rows overlap the training window (training reads rows [0, {stop}), "
                f"eval starts at row {eval_skip_rows}); set max_rows <= eval_skip_rows"
            )
        return RowWindows(stop, eval_skip_rows)
    start = n_rows - min(max(n_eval, -(-n_rows // 10)), n_rows // 2)
    if max_rows is not None and max_rows > start:
        raise DataError(
            f"max_rows: {max_rows} overlaps the held-out last rows [{start}, {n_rows}) of the parquet; lower "
            "max_rows, pass eval_parquet= (e.g. datagen's eval.parquet), or set eval_every=0"
        )
    return RowWindows(start if max_rows is None else max_rows, start)


def load_eval_rows(
    path: str | Path, cfg: NLAConfig, *, skip_rows: int, n: int, train_doc_ids: Sequence[str],
    docs: HeldoutDocs | None = None, key: str = "eval_skip_rows",
) -> list[RLRow]:
    """Up to n held-out rows from [skip_rows, end) whose documents are not in `train_doc_ids`.

    Rows of a shuffled dataset share documents (in the reference's data about half the
    rows past the training window do), so eval takes only unseen documents. `path` is
    the training parquet past its window (docs None: the first such rows, as the reference
    takes them), or a separate held-out file (skip_rows=0) with docs one of
    nla_core.HELDOUT_DOCS: the rows spread over its documents (nla_core.spread_rows).
    DataError, naming `key`, when no such row exists.
    """
    pf = validate_parquet_schema(path, d_model=cfg.d_model, key=key)
    doc_ids = _doc_ids(pf)
    candidates = doc_ids[skip_rows:]
    if docs is None:
        picked = [skip_rows + i for i in doc_disjoint_rows(train_doc_ids, candidates, n)]
    else:
        unseen = doc_disjoint_rows(train_doc_ids, candidates, len(candidates))
        picked = [skip_rows + unseen[j] for j in spread_rows([candidates[i] for i in unseen], n, docs=docs)]
    if not picked:
        if n == 0:
            return []
        raise DataError(
            f"{key}: no row past row {skip_rows} of {path} ({len(doc_ids)} rows) comes from a document "
            "outside the training rows; pass eval_parquet= a held-out file, lower max_rows, or add documents"
        )
    return _picked_rows(pf, cfg, picked, ())


def load_heldout_rows(path: str | Path, cfg: NLAConfig, *, n: int, docs: HeldoutDocs,
                      extra_columns: Sequence[str] = (), key: str) -> list[RLRow]:
    """Up to n validated rows of a held-out file, spread over its documents (nla_core.spread_rows; `docs` one of
    nla_core.HELDOUT_DOCS), in file order; `key` names the config key of the file in messages."""
    pf = validate_parquet_schema(path, d_model=cfg.d_model, key=key)
    return _picked_rows(pf, cfg, spread_rows(_doc_ids(pf), n, docs=docs), extra_columns)


def _doc_ids(pf: pq.ParquetFile) -> list[str]:
    """Every row's doc_id: the column alone is small next to the activations, so it is read whole, once."""
    return [str(d) for d in pf.read(columns=["doc_id"]).column("doc_id").to_pylist()]


def _picked_rows(pf: pq.ParquetFile, cfg: NLAConfig, picked: list[int], extra_columns: Sequence[str]) -> list[RLRow]:
    """The validated rows at the ascending indices `picked` (none: an empty list), read from the row groups that
    hold them."""
    if not picked:
        return []
    return list(_stream(pf, cfg, picked[0], picked[-1] + 1, set(picked), extra_columns))
