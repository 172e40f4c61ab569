"""Builders of the hub-free artefacts the shell tests share: tokenizer, tiny AV, RL data.

Plain functions, so any test (or a script) can call them; tests/conftest.py wraps them
as pytest fixtures with a session-wide cache. Everything is built from nla_shell.toy.builders,
the same code `nla demo` uses.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerFast

from nla_shell.toy import builders as toy

D_MODEL = 64
"""Hidden size of the tiny AV (and width of the toy activations)."""
LAYER_INDEX = 1
"""Injection / extraction layer of the toy data (the reference's block 1)."""
NUM_LAYERS = 3
"""Blocks of the tiny AV: at least one after the injection block, or a later token's logits
could never see the injected vector (steering would be invisible to generation)."""

TINY_CORPUS: tuple[str, ...] = (
    "The cat sat on the mat and looked at the door.",
    "A dog ran across the green field after a red ball.",
    "The river flows past the old stone bridge into the sea.",
    "She wrote the numbers 1, 2, 3 and 42 on the board.",
    "He said: the weather today is cold, wet and dark.",
    "Explain the activation at the marked token.",
    "Text: the token is part of a sentence about animals.",
    "<explanation>The text is about a cat sitting on a mat.</explanation>",
    "<explanation>A sentence about water, rivers and bridges.</explanation>",
    "<explanation>Numbers and counting on a school board.</explanation>",
    "user assistant system: a short conversation between two people.",
    "The model reads the context and predicts the next word in the story.",
    "Paris is the capital of France; Rome is the capital of Italy.",
    "def add(a, b):\n    return a + b\n",
) * 4
"""A small, fixed corpus: enough merges for readable tokens, trained in milliseconds."""


@functools.lru_cache(maxsize=None)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The shared toy tokenizer (built once per process; treat it as read-only)."""
    return toy.train_tokenizer(TINY_CORPUS, vocab_size=512)


def build_av_dir(directory: Path, tokenizer: PreTrainedTokenizerFast | None = None) -> Path:
    """A saved tiny Qwen3 AV (D_MODEL wide, NUM_LAYERS blocks) with its tokenizer; reused if already there."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        tokenizer = tokenizer or tiny_tokenizer()
        toy.save_av_checkpoint(toy.build_tiny_qwen3(tokenizer, hidden_size=D_MODEL, num_layers=NUM_LAYERS, seed=0), tokenizer, directory)
    return directory


def build_toy_rl(
    directory: Path,
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    n_rows: int = 48,
    n_docs: int = 40,
    seed: int = 0,
    row_group_size: int = 8,
    **kwargs: Any,
) -> Path:
    """`rl.parquet` + its sidecar in `directory` (fresh each call); returns the parquet path."""
    return toy.make_toy_rl_dataset(
        directory,
        tokenizer or tiny_tokenizer(),
        d_model=D_MODEL,
        n_rows=n_rows,
        n_docs=n_docs,
        seed=seed,
        layer_index=LAYER_INDEX,
        row_group_size=row_group_size,
        **kwargs,
    )


def read_rows(parquet: Path) -> list[dict[str, Any]]:
    """All rows of a parquet as Python dicts (the slow, obvious reading, for comparisons)."""
    return pq.read_table(parquet).to_pylist()


def write_list_parquet(path: Path, rows: Sequence[Mapping[str, Any]], *, row_group_size: int = 8) -> Path:
    """Like toy.write_rl_parquet but with a variable-length list<float32> activation column,
    so rows may have different lengths (the other layout readers must accept)."""
    schema = pa.schema(
        [
            ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("activation_vector", pa.list_(pa.float32())),
            ("doc_id", pa.string()),
        ]
    )
    table = pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in rows], schema=schema)
    pq.write_table(table, path, row_group_size=row_group_size)
    return Path(path)


# --------------------------------------------------------------------------- trainer inputs


def teach_explanation_format(
    model, tokenizer: PreTrainedTokenizerFast, prompt_ids: Sequence[int], *, steps: int = 60, seed: int = 0
) -> None:
    """A few full-parameter steps so the random AV answers `<explanation> … </explanation>`.

    The trainer's tests need rollouts that sometimes extract; a random model almost never
    writes both tags within a few tokens. No injection: this only teaches the format.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    words = ["cat", "dog", "river", "numbers", "weather", "story", "bridge", "board"]
    answers = [
        f"<explanation>{words[i % 8]} {words[(3 * i + 1) % 8]}</explanation>" for i in range(8)
    ]
    sequences = [
        list(prompt_ids) + tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in answers
    ]
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), width), -100)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, len(prompt_ids) : len(seq)] = torch.tensor(seq[len(prompt_ids) :])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(sequences), (4,), generator=generator)
        loss = model(input_ids=ids[pick], attention_mask=(ids[pick] != tokenizer.pad_token_id), labels=labels[pick]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def lora_actor(av_dir: Path, sidecar, *, seed: int = 0, dtype=None):
    """(actor, injector): the trainer's CPU actor (LoRA r4; base in `dtype`, default float32, the
    LoRA float32) with a non-zero LoRA B, so the adapted policy and the reference differ, and its
    injector at the sidecar's marker."""
    import torch

    from nla_shell.models import Injector, load_actor

    torch.manual_seed(seed)
    actor = load_actor(av_dir, lora_r=4, lora_alpha=8, use_rslora=True, resume_adapter=None,
                       dtype=dtype or torch.float32, device=torch.device("cpu"))
    for name, p in actor.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    injector = Injector(actor, marker_id=sidecar.injection_token_id, left_id=sidecar.injection_left_neighbor_id,
                        right_id=sidecar.injection_right_neighbor_id)
    return actor, injector


def build_trainer_inputs(directory: Path, tokenizer: PreTrainedTokenizerFast | None = None) -> tuple[Path, Path, Path]:
    """(av_dir, ar_dir, rl.parquet) for trainer tests, built once into `directory`.

    The AV writes the explanation format; the AR is that model truncated after the
    extraction layer with an identity value head; the data is the toy RL set (48 rows).
    """
    from nla_core import resolve_target_scale
    from nla_shell.io.data import build_prompt_ids
    from nla_shell.io.sidecars import load_sidecar
    from nla_shell.models import ARModel

    directory = Path(directory)
    av, ar = directory / "av", directory / "ar"
    parquet = directory / "data" / "rl.parquet"
    if (ar / "value_head.safetensors").exists():
        return av, ar, parquet
    tokenizer = tokenizer or tiny_tokenizer()
    build_toy_rl(parquet.parent, tokenizer)
    cfg = load_sidecar(Path(str(parquet) + ".nla_meta.yaml"))
    prompt = build_prompt_ids(toy.av_prompt_messages(cfg.actor_prompt_template), cfg, tokenizer)
    model = toy.build_tiny_qwen3(tokenizer, hidden_size=D_MODEL, num_layers=NUM_LAYERS, seed=0)
    teach_explanation_format(model, tokenizer, prompt)
    toy.save_av_checkpoint(model, tokenizer, av)
    scale = resolve_target_scale(cfg.mse_scale, cfg.d_model)
    ARModel.from_pretrained(av, mse_scale=scale, extraction_layer_index=LAYER_INDEX, create_head=True).save_pretrained(ar)
    return av, ar, parquet


def train_argv(inputs: tuple[Path, Path, Path], save_dir: Path, **overrides: Any) -> list[str]:
    """`nla train` argv for a tiny CPU run on (av, ar, parquet): 3 steps of 2 prompts x 3, eval every 2."""
    av, ar, parquet = inputs
    settings = dict(
        av_ckpt=av, ar_ckpt=ar, rl_parquet=parquet, save_dir=save_dir, num_steps=3, batch_prompts=2,
        group_size=3, max_new_tokens=10, lora_r=4, lora_alpha=8, lr=1e-3, logp_micro_batch=2,
        eval_every=2, eval_n_prompts=3, eval_skip_rows=32, max_rows=32, save_every=2, device="cpu",
        logger="jsonl",
    )
    settings.update(overrides)
    return ["train", *(f"{k}={v}" for k, v in settings.items())]


def read_metrics(save_dir: Path) -> list[dict[str, Any]]:
    """A run's metrics.jsonl, one dict per step (NaN was written as null)."""
    import json

    return [json.loads(line) for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- pipeline (datagen, sft)


def write_toy_corpus(path: Path, *, n_docs: int = 24, seed: int = 0, extra: Sequence[str] = ()) -> Path:
    """A JSONL corpus of toy-language documents ("id", "text"), plus `extra` texts at the end."""
    import json

    from nla_shell.toy.corpus import generate_documents

    texts = [*generate_documents(n_docs, seed), *extra]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"d{i:03d}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def datagen_config(model: Path, corpus: Path, out_dir: Path, **overrides: Any):
    """A small DatagenConfig on CPU (layer LAYER_INDEX, rule explainer, no progress bar)."""
    from nla_shell.pipeline.datagen_config import DatagenConfig

    settings = dict(model=str(model), corpus=str(corpus), layer=LAYER_INDEX, out_dir=str(out_dir),
                    explainer="rule", positions_per_doc=3, min_context=4, batch_size=5, row_group_size=8, device="cpu",
                    progress=False, av_sft_fraction=0.3, ar_sft_fraction=0.3, eval_fraction=0.2)
    settings.update(overrides)
    return DatagenConfig(**settings)


def build_toy_datasets(directory: Path, av_dir: Path) -> Path:
    """rl/av_sft/ar_sft/eval parquets of the tiny AV over 24 toy documents, built once into `directory`."""
    from nla_shell.pipeline.datagen import datagen

    directory = Path(directory)
    if not (directory / "eval.parquet").exists():
        corpus = write_toy_corpus(directory / "corpus.jsonl")
        datagen(datagen_config(av_dir, corpus, directory))
    return directory


def sft_config(mode: str, model: Path, data_dir: Path, save_dir: Path, **overrides: Any):
    """A tiny SFTConfig on CPU: a few constant-lr steps, logs to JSONL only."""
    from nla_shell.pipeline.sft_config import SFTConfig

    settings = dict(mode=mode, model=str(model), parquet=str(Path(data_dir) / f"{mode}_sft.parquet"),
                    save_dir=str(save_dir), num_steps=2, batch_size=4, micro_batch=2, lr=1e-3,
                    lr_schedule="constant", lora_r=4, lora_alpha=4, save_every=2, logger=("jsonl",), device="cpu",
                    dtype="float32")
    settings.update(overrides)
    return SFTConfig(**settings)


def ar_predictions(ar, tokenizer, device: str = "cpu"):
    """[3, D] predictions of an ARModel for three fixed texts (no grad): to compare two ARs."""
    import torch

    from nla_shell.models import pad_right

    texts = ["the cat sat on the mat", "a dog ran", "explanation: birds fly south"]
    ids, mask = pad_right([tokenizer.encode(t, add_special_tokens=False) for t in texts], tokenizer.pad_token_id,
                          torch.device(device))
    with torch.no_grad():
        return ar(ids, mask)


def build_sft_checkpoints(directory: Path, av_dir: Path, data_dir: Path) -> tuple[Path, Path]:
    """(AV adapter checkpoint, AR checkpoint) after two SFT steps each, built once into `directory`."""
    from nla_shell.pipeline.sft import sft

    directory = Path(directory)
    av, ar = directory / "av" / "step_000002", directory / "ar" / "step_000002"
    if not (ar / "COMPLETE").exists():
        sft(sft_config("av", av_dir, data_dir, directory / "av"))
        sft(sft_config("ar", av_dir, data_dir, directory / "ar"))
    return av, ar


# --------------------------------------------------------------------------- a toy NLA that learns in seconds

TWO_CONCEPTS = ("cat", "river")
"""The explanations of the two-concept toy: one short word per concept."""


def write_two_concept_split(path: Path, split: str, *, n_rows: int, seed: int, tokenizer=None) -> Path:
    """A split in datagen's layout (nla_shell.pipeline.dataset_writer.split_schema) whose activations are one
    of two concepts, +-3 along a fixed unit direction plus N(0, 0.3^2) noise per dim, each explained
    by its concept's word. The direction is the same for every seed, so all splits share the concepts.
    """
    import numpy as np

    from nla_shell.io.sidecars import dataset_sidecar, write_sidecar
    from nla_shell.pipeline.dataset_writer import split_schema

    tokenizer = tokenizer or tiny_tokenizer()
    direction = np.random.default_rng(12345).standard_normal(D_MODEL).astype(np.float32)
    direction /= np.linalg.norm(direction)
    rng = np.random.default_rng(seed)
    concepts = np.arange(n_rows) % 2
    acts = (np.where(concepts[:, None] == 0, 3.0, -3.0) * direction
            + 0.3 * rng.standard_normal((n_rows, D_MODEL))).astype(np.float32)
    rows = []
    for i, concept in enumerate(concepts):
        word = TWO_CONCEPTS[concept]
        rows.append({
            "prompt": toy.DEFAULT_AR_TEMPLATE.format(explanation=word) if split == "ar_sft"
            else toy.av_prompt_messages(toy.DEFAULT_AV_TEMPLATE),
            "activation_vector": acts[i].tolist(), "doc_id": f"{split}{i:04d}", "n_raw_tokens": 1,
            "activation_layer": LAYER_INDEX, "position": 0, "context": "", "explanation": word,
            # The layout build_trainer_inputs' AV already writes, so SFT only has to teach the word.
            "response": f"<explanation>{word}</explanation>",
        })
    schema = split_schema(split, D_MODEL)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in schema.names} for r in rows], schema=schema), path)
    mapping = dataset_sidecar(
        tokenizer, stage="av_sft" if split == "eval" else split, row_count=n_rows, base_model="toy", d_model=D_MODEL,
        layer_index=LAYER_INDEX, corpus="two_concepts", positions_per_doc=1, av_content=toy.DEFAULT_AV_TEMPLATE,
        ar_template=toy.DEFAULT_AR_TEMPLATE, injection_char=toy.DEFAULT_INJECTION_CHAR,
        provenance={"generator": "tests/fixtures.py two-concept toy", "seed": seed},
    )
    write_sidecar(mapping, Path(str(path) + ".nla_meta.yaml"))
    return Path(path)


def build_two_concept_nla(directory: Path, av_dir: Path) -> tuple[Path, Path, Path]:
    """(AV adapter, AR dir, eval.parquet) of the two-concept toy after 30 SFT steps each, built once.

    av_dir should already write the <explanation> format (build_trainer_inputs' AV), so the
    LoRA only has to learn which word.
    The AV learns to name the concept of the injected vector and the AR to map the name back,
    so the pair explains held-out rows well, and an AV reading the wrong row's vector does not.
    """
    from nla_shell.pipeline.sft import sft

    directory = Path(directory)
    av, ar = directory / "av" / "step_000030", directory / "ar" / "step_000030"
    if not (ar / "COMPLETE").exists():
        for split, n_rows, seed in (("av_sft", 64, 1), ("ar_sft", 64, 2), ("eval", 32, 3)):
            write_two_concept_split(directory / "data" / f"{split}.parquet", split, n_rows=n_rows, seed=seed)
        settings = dict(num_steps=30, batch_size=16, micro_batch=16, save_every=30, lora_r=8, lora_alpha=8)
        sft(sft_config("av", av_dir, directory / "data", directory / "av", lr=1e-2, **settings))
        sft(sft_config("ar", av_dir, directory / "data", directory / "ar", lr=3e-3, **settings))
    return av, ar, directory / "data" / "eval.parquet"


_LOCK_HOLDER = """
import sys, time
from nla_shell.training.runlock import RunDirLock
with RunDirLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(300)
"""


def hold_run_dir_lock(save_dir: Path) -> subprocess.Popen:
    """Another process that holds `save_dir`'s run lock (as a running `nla train` would) until killed."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", _LOCK_HOLDER, str(save_dir)], stdout=subprocess.PIPE, text=True,
                            env=env)
    if proc.stdout.readline().strip() != "held":
        proc.kill()
        raise RuntimeError(f"the lock holder for {save_dir} did not start")
    return proc


def tiny_lora_qwen3(dtype=None):
    """A 2-layer Qwen3 (D 64, V 128) with a LoRA r4 on q, k, v, o whose B factors are non-zero (seed 0)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    base = Qwen3ForCausalLM(config).to(dtype or torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0)
    model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    return model
