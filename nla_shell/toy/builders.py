"""Hub-free tiny artefacts: a locally trained tokenizer, a random tiny Qwen3 and an RL
parquet with its sidecar. Test fixtures use them, and so does `nla demo`, which must run on a
machine that cannot reach the model hub.

The tokenizer mimics what the real pipeline relies on in Qwen's: byte-level BPE, no BOS,
`<|im_end|>` as EOS, `<|endoftext|>` as padding, a ChatML chat template, and an
injection character that is always exactly one token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from nla_core import marker_char
from nla_shell.io.data import av_prompt_messages
from nla_shell.io.sidecars import DEFAULT_AR_TEMPLATE, DEFAULT_AV_TEMPLATE, dataset_sidecar, write_sidecar

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_AR_TEMPLATE",
    "DEFAULT_AV_TEMPLATE",
    "DEFAULT_INJECTION_CHAR",
    "EXPLANATION_TOKENS",
    "SPECIAL_TOKENS",
    "av_prompt_messages",
    "build_tiny_qwen3",
    "make_toy_rl_dataset",
    "save_av_checkpoint",
    "train_tokenizer",
    "write_rl_parquet",
]

DEFAULT_INJECTION_CHAR = "§"

PAD_TOKEN, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
"""Special tokens, ids 0, 1, 2 in this order."""
EXPLANATION_TOKENS = ("<explanation>", "</explanation>")
"""Added as single, non-special tokens: a tiny AV learns the tags in one step each, and
decoding with skip_special_tokens keeps them, so extraction still finds them."""

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen writes it, without the tool-call and thinking branches."""


def _byte_level_symbols(char: str) -> str:
    """The byte-level alphabet spelling of `char`: one symbol per UTF-8 byte ("§" -> "Â§")."""
    ((symbols, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(char)
    return symbols


def _force_single_token(tokenizer: Tokenizer, char: str) -> Tokenizer:
    """Give `char` its own BPE token by prepending the merges that assemble its bytes.

    An added token cannot do this for characters such as "§": its content collides with the
    byte-level symbol for byte 0xA7, so it would encode to that byte's id and decode to
    invalid UTF-8. Merges ranked first always fire before anything else, and `char` was kept
    out of training, so no learned merge can absorb the finished token into a neighbour.
    """
    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    symbols = _byte_level_symbols(char)
    forced = []
    for k in range(1, len(symbols)):
        forced.append((symbols[:k], symbols[k]))
        if symbols[: k + 1] not in vocab:
            vocab[symbols[: k + 1]] = max(vocab.values()) + 1
    state["model"]["merges"] = [list(m) for m in forced] + [list(m) for m in merges if m not in forced]
    return Tokenizer.from_str(json.dumps(state))


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 512, injection_char: str = DEFAULT_INJECTION_CHAR
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts` and wrap it as a Qwen-style HF tokenizer.

    Deterministic for the same texts. Ids: the special tokens 0-2, the 256 byte symbols,
    the learned merges (up to vocab_size in all), then the injection char's token and the
    `<explanation>` / `</explanation>` tags, so len(tokenizer) is vocab_size + 3 at most.
    `injection_char` is removed from the training texts and then made a single token that
    never merges with its neighbours and decodes back to itself; given as a space and one
    character (" X"), both "X" and " X" become single tokens, as in a byte-level BPE whose
    vocabulary fuses the space with the character (GPT-2's 'Ġ' + X). The tags are single
    added tokens, not special ones.
    Raises ValueError when the injection char still fails to round-trip as one token.
    """
    char = marker_char(injection_char)
    if char is None:
        raise ValueError(f"injection_char must be one non-space character, or a space and one, got {injection_char!r}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator((t.replace(char, "") for t in texts), trainer=trainer)
    for text in dict.fromkeys((char, injection_char)):  # the spaced token's merges rank first
        backend = _force_single_token(backend, text)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXPLANATION_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    _verify_single_token(tokenizer, injection_char)
    return tokenizer


def _verify_single_token(tokenizer: PreTrainedTokenizerFast, char: str) -> None:
    ids = tokenizer.encode(char, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"injection_char {char!r} encodes to {len(ids)} tokens {ids}")
    marker = ids[0]
    for context in (f"a{char}b", f" {char}.", f"at {char}{char}"):
        ids = tokenizer.encode(context, add_special_tokens=False)
        if ids.count(marker) != context.count(char):
            raise ValueError(f"injection_char {char!r} does not stay one token in {context!r}: {ids}")
    if tokenizer.decode([marker]) != char:
        raise ValueError(f"injection_char {char!r} decodes to {tokenizer.decode([marker])!r}")


def build_tiny_qwen3(
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Qwen3ForCausalLM:
    """A randomly initialised Qwen3 sized to `tokenizer` (vocab V = len(tokenizer), D = hidden_size).

    Its generation_config samples from the full distribution (top_k 0, top_p 1,
    temperature 1, no repetition penalty): transformers fills an unset top_k with 50 at
    generate time, which would silently truncate the behaviour policy.
    """
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        repetition_penalty=1.0,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def save_av_checkpoint(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> Path:
    """Save model and tokenizer side by side, as an SFT'd AV checkpoint is laid out."""
    directory = Path(directory)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
_OPTIONAL_COLUMNS = {"position": pa.int64(), "context": pa.string()}


def write_rl_parquet(path: str | Path, rows: Sequence[Mapping[str, Any]], *, row_group_size: int = 1024) -> Path:
    """Write RL rows to parquet.

    Each row maps `prompt` (list of {"role", "content"} messages), `activation_vector`
    ([D] floats, the same D for every row), `doc_id` (str), and optionally `position` (int)
    and `context` (str), present in every row or in none. The activation column is a
    fixed_size_list<float32>[D], so readers learn D from the schema alone.
    """
    if not rows:
        raise ValueError("write_rl_parquet needs at least one row")
    acts = np.stack([np.asarray(r["activation_vector"], dtype=np.float32) for r in rows])
    if acts.ndim != 2:
        raise ValueError(f"activation_vector must be 1-D per row; stacked shape is {acts.shape}")
    columns = {
        "prompt": pa.array([[dict(m) for m in r["prompt"]] for r in rows], type=pa.list_(_MESSAGE)),
        "activation_vector": pa.FixedSizeListArray.from_arrays(pa.array(acts.reshape(-1)), acts.shape[1]),
        "doc_id": pa.array([r["doc_id"] for r in rows], type=pa.string()),
    }
    for name, kind in _OPTIONAL_COLUMNS.items():
        if name in rows[0]:
            columns[name] = pa.array([r[name] for r in rows], type=kind)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return Path(path)


def make_toy_rl_dataset(
    directory: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    d_model: int,
    n_rows: int,
    n_docs: int,
    seed: int,
    layer_index: int = 1,
    av_template: str = DEFAULT_AV_TEMPLATE,
    ar_template: str = DEFAULT_AR_TEMPLATE,
    injection_char: str = DEFAULT_INJECTION_CHAR,
    row_group_size: int = 8,
) -> Path:
    """Write `rl.parquet` and `rl.parquet.nla_meta.yaml` into `directory`; return the parquet path.

    Rows hold the AV template as a single user message, a seeded N(0, 1) activation [D],
    and a document drawn at random from n_docs, so rows of one document are spread
    through the file as in a shuffled real dataset. Small row groups by default, so
    readers cross row-group boundaries in tests.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n_rows, d_model), dtype=np.float32)
    docs = rng.integers(0, n_docs, size=n_rows)
    rows = [
        {
            "prompt": av_prompt_messages(av_template),
            "activation_vector": acts[i],
            "doc_id": f"doc{docs[i]:04d}",
            "position": i,
            "context": f"toy context {i}",
        }
        for i in range(n_rows)
    ]
    parquet = write_rl_parquet(directory / "rl.parquet", rows, row_group_size=row_group_size)
    mapping = dataset_sidecar(
        tokenizer,
        stage="rl",
        row_count=n_rows,
        base_model="toy",
        d_model=d_model,
        layer_index=layer_index,
        corpus="toy",
        positions_per_doc=1,
        av_content=av_template,
        ar_template=ar_template,
        injection_char=injection_char,
        provenance={"generator": "nla_shell.toy.builders.make_toy_rl_dataset", "seed": seed, "rows": n_rows, "docs": n_docs},
    )
    write_sidecar(mapping, directory / "rl.parquet.nla_meta.yaml")
    return parquet
