"""An analytical estimate of one GRPO step's GPU memory per Qwen3 shape, part by part, on one GPU.

Pure arithmetic (no torch, no GPU): what `bench/bench_step.py --engine vllm` and `nla train
engine=vllm train_critic=true` hold, from the shape's geometry (`synthetic.QWEN3_SHAPES`) and the
settings. Parts:

  resident (the whole step): the AV's frozen bf16 base (quant=8bit/4bit: its block matrices in 1 or
    0.5 bytes), the LoRA (float32, PEFT's) with its AdamW moments, the AR (embeddings, the blocks up to
    the extraction layer, the unused LM head unless tied, a float32 value head) and, co-trained, its
    AdamW moments over the whole backbone (ARModel.requires_grad_: a full fine-tune; torch AdamW's
    moments take the bf16 parameter's dtype, 2 x 2 bytes, AdamW8bit's 2 x 1), the step's rollouts, and
    vLLM's share when it never sleeps (vllm_sleep=0).
  rollout: vLLM's share of the GPU (vllm_gpu_mem x the GPU) while it is awake (vllm_sleep 1, 2), or its
    need (its bf16 weights + the KV cache of min(N, vllm_max_seqs) sequences) when larger; and, measured,
    one more bf16 copy of the AV's weights plus 1 GiB: blocks in torch's cache, which vLLM cannot map its KV
    cache into (what holds them is not known; see run AC below). Run AA, 2026-12-01: the rollout
    phase held 3.5, 8.4 and 16.2 GiB above the rest of this estimate at 0.6B, 4B and 8B, where the AV's
    weights are 1.1, 7.5 and 15.3 GiB. Run AB read torch's reserved-but-unallocated memory while vLLM was
    awake: 4.0 GiB at 1.7B, 15.2 at 8B, but 4.7 at 14B, where this term put the rollout 23.3 GiB high.
    The engine has emptied torch's cache after the push since run AB; run AC (2026-12-02) read the same
    15.2 GiB at 8B (14.7 with vLLM's FP8), so the push's freed buckets are not what holds it, and the term
    stays an upper bound.
  update: the LoRA's float32 gradients and one micro-batch's activations (`memory.sequence_bytes`,
    the estimate `logp_micro_batch=auto` uses; a group's prompt counted once, as `training.prefix`
    computes it).
  critic: the AR's bf16 gradients and one critic micro-batch's activations.
  fp8 (`nla train fp8=`, nla_shell.models.fp8): e4m3 copies of the block matrices beside the bf16 ones
    (with `backward`, a transposed copy of each too), 1 byte per weight and a float32 scale per row,
    resident: the actor's base for reference/update (quantised once) and the AR's backbone for score
    (a trained AR's re-quantised in place at each scoring block; measured at 8B, run Z: 6,629 + 4,604 MiB;
    the transposed copies added 10.7 GiB in use in run AC, where this estimate adds 10.9).

The step's peak is the resident parts plus its largest phase. The update phase errs high: at 8B,
256 x 8 (micro-batch 64, critic 64, AdamW8bit, after_all) it gives 119.6 GiB where run AA measured
103.7 GiB in use, compile_blocks cutting the update's activations by about a fifth not being
modelled; at 4B 77.5 against 75.6. vLLM's own need (its weights + the KV cache of the concurrent
sequences) above its share counts in full: a short share makes vLLM preempt (or not start).

    python bench/memory_model.py                                  # the scaling matrix, markdown
    python bench/memory_model.py --shapes 14b --cases 256x8 --micro-batch 16
    python bench/memory_model.py --shapes 14b --cases 256x8 --bench-args   # bench_step flags that fit
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from synthetic import QWEN3_SHAPES, ar_extraction_layer  # noqa: E402

from nla_shell.training.memory import sequence_bytes  # noqa: E402

GIB = 2**30
H200_GIB = 139.0
"""The H200's memory as torch reports it (139.8 GiB total; the rest is the CUDA context's)."""
CRITIC_TEMPLATE_TOKENS = 8
"""Tokens the critic's prompt template adds to an explanation ("Text: {explanation}")."""
QUANT_BYTES = {"none": 2.0, "8bit": 1.0, "4bit": 0.5}
"""Bytes a block matrix takes under TrainConfig.quant (bitsandbytes keeps embeddings and norms in bf16)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """One step's settings; names follow bench_step's flags (TrainConfig's keys in the comments)."""

    prompts: int = 256
    group: int = 8
    prompt_len: int = 96
    new_tokens: int = 160  # max_new_tokens
    micro_batch: int = 64  # logp_micro_batch
    critic_micro_batch: int = 64  # critic_micro_batch
    lora_r: int = 128
    adamw8bit: bool = True  # bitsandbytes installed: runtime.make_optimizer picks AdamW8bit
    bf16_autocast: bool = True
    gradient_checkpointing: bool = False
    critic: bool = True  # train_critic
    ar_lora: bool = False  # an AR-LoRA checkpoint (nla sft --mode ar ar_lora=true): only its LoRA trains
    quant: str = "none"  # the AV's frozen base and a frozen or LoRA AR
    fp8_actor: bool = False  # fp8=reference and/or update: FP8 copies of the actor's base matrices
    fp8_score: bool = False  # fp8=score: FP8 copies of the AR backbone's matrices
    fp8_backward: bool = False  # fp8=...,backward: a transposed copy beside each (the actor's counted as with update)
    vllm_gpu_mem: float = 0.35
    vllm_sleep: int = 2
    vllm_max_seqs: int = 1024
    gpu_gib: float = H200_GIB


@dataclasses.dataclass
class Estimate:
    shape: str
    settings: Settings
    resident: dict[str, float]
    """GiB held through the whole step, by part."""
    phases: dict[str, dict[str, float]]
    """GiB each phase adds on top of the resident parts, by part."""
    vllm_need_gib: float
    """vLLM's weights + the KV cache of its concurrent sequences (its share should hold both)."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: sum(self.phases[name].values()))

    def phase_total(self, phase: str) -> float:
        """GiB held during `phase`: the resident parts and the phase's own."""
        return sum(self.resident.values()) + sum(self.phases[phase].values())

    @property
    def total(self) -> float:
        return self.phase_total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.total <= self.settings.gpu_gib

    @property
    def vllm_share_gib(self) -> float:
        return self.settings.vllm_gpu_mem * self.settings.gpu_gib

    def what_does_not_fit(self) -> str:
        """'' when it fits; else the peak phase's parts, largest first, and by how much it is over."""
        if self.fits:
            return ""
        parts = {**self.resident, **self.phases[self.peak_phase]}
        largest = ", ".join(f"{k} {v:.1f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:3])
        return f"over by {self.total - self.settings.gpu_gib:.1f} GiB in the {self.peak_phase} phase ({largest} GiB)"


def block_params(shape: dict) -> tuple[int, int]:
    """(matrix, norm) parameters of one decoder block: q, k, v, o, gate, up, down; two norms and q/k norms."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return 2 * h * q + 2 * h * kv + 3 * h * inter, 2 * h + 2 * hd


def lora_params(shape: dict, r: int) -> int:
    """Parameters of the LoRA on q, k, v, o (families.lora_targets) over every block."""
    h, hd = shape["hidden_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    return shape["num_hidden_layers"] * r * ((h + q) * 2 + (h + kv) * 2)


def fp8_copy_bytes(shape: dict, layers: int, *, transposed: bool = False) -> float:
    """Bytes of FP8 copies of `layers` blocks' matrices: 1 per weight and a float32 scale per output row
    (transposed: per input column, the copy fp8=...,backward's input gradients read)."""
    h, inter, hd = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    rows = q + 2 * kv + h + 2 * inter + h  # q, k, v, o, gate, up, down
    columns = 3 * h + q + 2 * h + inter
    return layers * (block_params(shape)[0] + 4 * (columns if transposed else rows))


def model_bytes(shape: dict, layers: int, *, matrix_bytes: float, lm_head: bool) -> float:
    """Bytes of an LM of `layers` blocks: bf16 embeddings, norms (and an untied LM head), blocks at matrix_bytes."""
    matrices, norms = block_params(shape)
    embed = shape["vocab_size"] * shape["hidden_size"]
    head = embed if lm_head and not shape["tie_word_embeddings"] else 0
    return layers * (matrices * matrix_bytes + norms * 2) + 2 * (embed + head + shape["hidden_size"])


def estimate(shape_name: str, settings: Settings = Settings()) -> Estimate:
    s, shape = settings, QWEN3_SHAPES[shape_name]
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    ar_layers = ar_extraction_layer(shape_name) + 1
    moment_bytes = 2 if s.adamw8bit else 4  # two moments: 1 byte each (AdamW8bit) or the bf16 param's 2
    config = SimpleNamespace(**shape)
    ar_config = SimpleNamespace(**dict(shape, num_hidden_layers=ar_layers))

    lora = lora_params(shape, s.lora_r)
    samples = s.prompts * s.group
    # A frozen or LoRA AR may be quantised; a fully fine-tuned one stays bf16 (quant.require_quant).
    ar_quantised = not s.critic or s.ar_lora
    ar_matrix_bytes = QUANT_BYTES[s.quant] if ar_quantised else 2.0
    ar_trained = (lora_params(ar_config.__dict__, s.lora_r) if s.ar_lora else
                  ar_layers * sum(block_params(shape)) + shape["vocab_size"] * h)
    resident = {
        "AV weights": model_bytes(shape, layers, matrix_bytes=QUANT_BYTES[s.quant], lm_head=True),
        # float32 LoRA factors; their moments float32 under torch AdamW, 1 byte each under AdamW8bit
        "LoRA + moments": lora * (4 + (2 if s.adamw8bit else 8)),
        "AR weights": model_bytes(shape, ar_layers, matrix_bytes=ar_matrix_bytes, lm_head=True) + 4 * h * h,
    }
    if s.critic:
        # LoRA factors are float32 (moments 8 bytes under torch AdamW); the backbone bf16 (4 bytes).
        per_param = (2 if s.adamw8bit else 8) if s.ar_lora else moment_bytes
        resident["AR moments"] = ar_trained * per_param + h * h * (2 if s.adamw8bit else 8)
    kv_per_token = layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2
    concurrent = min(s.prompts * s.group, s.vllm_max_seqs or s.prompts * s.group)
    # With prefix caching a group's samples share their prompt's blocks.
    kv_tokens = concurrent * (s.new_tokens + s.prompt_len / s.group)
    vllm_weights = model_bytes(shape, layers, matrix_bytes=2.0, lm_head=True)
    vllm_need = vllm_weights + kv_tokens * kv_per_token
    # vLLM takes its share; a share below its need preempts (or, below its weights, does not start), so
    # the need is what a step without preemption takes (`fitting` raises vllm_gpu_mem to it).
    share = max(s.vllm_gpu_mem * s.gpu_gib * GIB, vllm_need)
    # While vLLM is awake: its share, and (measured: the module docstring) about one more bf16 copy of
    # the AV's weights in torch's cache. A quantised base rolls out with engine=hf: no vLLM.
    vllm_awake = {"vLLM share": share, "torch's cache of the push (measured, an upper bound)": vllm_weights + GIB}
    with_vllm = s.quant == "none"
    # The step's rollouts (ids, behaviour and reference log-probs, masks) kept until the update ends.
    resident["rollouts"] = s.prompts * s.group * (s.prompt_len + s.new_tokens) * 24
    if with_vllm and s.vllm_sleep == 0:
        resident.update(vllm_awake)
    if s.fp8_actor:
        resident["FP8 copies (actor)"] = fp8_copy_bytes(shape, layers)
        if s.fp8_backward:
            resident["FP8 transposed copies (actor)"] = fp8_copy_bytes(shape, layers, transposed=True)
    if s.fp8_score:
        resident["FP8 copies (AR)"] = fp8_copy_bytes(shape, ar_layers)
        if s.fp8_backward:
            resident["FP8 transposed copies (AR)"] = fp8_copy_bytes(shape, ar_layers, transposed=True)

    # A group's prompt once (training.prefix), its samples' responses each.
    policy_tokens = s.new_tokens + math.ceil(s.prompt_len / s.group)
    activation_dtype = 2
    policy = sequence_bytes(config, policy_tokens, grad=True, dtype_bytes=activation_dtype,
                            lora_bytes=2 if s.bf16_autocast else 4, gradient_checkpointing=s.gradient_checkpointing)
    critic_tokens = s.new_tokens + CRITIC_TEMPLATE_TOKENS
    critic_activations = sequence_bytes(ar_config, critic_tokens, grad=s.critic, dtype_bytes=activation_dtype,
                                        lora_bytes=4 if s.ar_lora else 0)
    rollout = ((vllm_awake if s.vllm_sleep else {}) if with_vllm
               else {"generate's KV cache (engine=hf)": kv_tokens * kv_per_token})
    phases = {
        "rollout": rollout,
        "update": {"LoRA grads": 4 * lora, "policy activations": min(s.micro_batch, samples) * policy},
        "critic": {"AR grads": (4 if s.ar_lora else 2) * ar_trained * s.critic + 4 * h * h * s.critic,
                   "AR activations": min(s.critic_micro_batch, samples) * critic_activations},
    }
    gib = lambda parts: {k: v / GIB for k, v in parts.items()}  # noqa: E731
    return Estimate(shape_name, s, gib(resident), {k: gib(v) for k, v in phases.items()}, vllm_need / GIB)


def fitting(shape_name: str, settings: Settings = Settings()) -> tuple[Estimate, list[str]]:
    """The estimate with the existing options that make it fit, and those options as TrainConfig keys.

    Greedy, cheapest first (vLLM's share up to its need, AdamW8bit, sleeping vLLM, halved micro-batches
    down to 8, gradient checkpointing, an AR-LoRA, quant=8bit then 4bit): each round takes the first option
    that lowers the peak (a smaller micro-batch does not help a step whose peak is the rollout, and helps
    again once quant= drops vLLM), until the estimate fits or no option helps; then the last estimate.
    """
    vllm = lambda s: s.quant == "none"  # noqa: E731 - a quantised base rolls out with engine=hf
    options = [
        (lambda s: vllm(s) and s.vllm_gpu_mem * s.gpu_gib < current.vllm_need_gib,
         lambda s: dataclasses.replace(s, vllm_gpu_mem=math.ceil(20 * current.vllm_need_gib / s.gpu_gib) / 20),
         "vllm_gpu_mem={vllm_gpu_mem}"),
        (lambda s: not s.adamw8bit, lambda s: dataclasses.replace(s, adamw8bit=True), "AdamW8bit (pip install 'nla[bnb]')"),
        (lambda s: vllm(s) and s.vllm_sleep == 0, lambda s: dataclasses.replace(s, vllm_sleep=2), "vllm_sleep=2"),
        (lambda s: s.micro_batch > 8, lambda s: dataclasses.replace(s, micro_batch=s.micro_batch // 2),
         "logp_micro_batch={micro_batch}"),
        (lambda s: s.critic_micro_batch > 8,
         lambda s: dataclasses.replace(s, critic_micro_batch=s.critic_micro_batch // 2),
         "critic_micro_batch={critic_micro_batch}"),
        (lambda s: not s.gradient_checkpointing, lambda s: dataclasses.replace(s, gradient_checkpointing=True),
         "gradient_checkpointing=true"),
        (lambda s: s.critic and not s.ar_lora, lambda s: dataclasses.replace(s, ar_lora=True),
         "an AR-LoRA ar_ckpt (nla sft --mode ar ar_lora=true)"),
        (lambda s: s.quant == "none", lambda s: dataclasses.replace(s, quant="8bit"), "quant=8bit (engine=hf)"),
        (lambda s: s.quant == "8bit", lambda s: dataclasses.replace(s, quant="4bit"), "quant=4bit (engine=hf)"),
    ]
    current, applied = estimate(shape_name, settings), []
    short_share = lambda e: vllm(e.settings) and e.vllm_need_gib > e.vllm_share_gib  # noqa: E731
    while not current.fits or short_share(current):
        for applies, apply, label in options:
            if not applies(current.settings):
                continue
            candidate = estimate(shape_name, apply(current.settings))
            # vLLM's share raised to its need adds memory, and is kept: below it vLLM preempts or does not start.
            if candidate.total < current.total or short_share(current) and not short_share(candidate):
                current = candidate
                applied.append(label.format(**dataclasses.asdict(current.settings)))
                break
        else:
            break
    # A micro-batch halved twice reads as its last value only; vLLM's settings go with quant= (engine=hf).
    latest = {label.split("=")[0]: label for label in applied if vllm(current.settings) or not label.startswith("vllm_")}
    return current, list(latest.values())


def bench_args(estimate_: Estimate) -> str:
    """bench_step's flags for the estimate's micro-batches and vLLM settings."""
    s = estimate_.settings
    return (f"--micro-batch {s.micro_batch} --critic-micro-batch {s.critic_micro_batch} --reference-micro-batch "
            f"{max(s.micro_batch, 16)} --vllm-gpu-mem {s.vllm_gpu_mem} --vllm-sleep {s.vllm_sleep} "
            f"--vllm-max-seqs {s.vllm_max_seqs}" + (" --ar-lora" if s.ar_lora else ""))


def table(shapes: list[str], cases: list[tuple[int, int]], settings: Settings) -> str:
    """Markdown: per shape and case, the parts, the peak, and the options that make it fit."""
    lines = ["| shape | case | AV weights | LoRA + moments | AR weights + moments | rollout (vLLM awake) | update | critic "
             "| peak phase | estimated GiB | fits 139 GiB | what does not fit | to fit (estimate after) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |"]
    for shape in shapes:
        for prompts, group in cases:
            e = estimate(shape, dataclasses.replace(settings, prompts=prompts, group=group))
            fixed, applied = fitting(shape, e.settings)
            ar = e.resident["AR weights"] + e.resident.get("AR moments", 0.0)
            phase = {k: sum(v.values()) for k, v in e.phases.items()}
            to_fit = ("-" if e.fits else f"{', '.join(applied)} ({fixed.total:.1f} GiB)" if fixed.fits
                      else f"nothing here fits ({', '.join(applied)}: {fixed.total:.1f} GiB)")
            vllm_note = (f"; vLLM's share {e.vllm_share_gib:.0f} GiB < its need {e.vllm_need_gib:.0f}"
                         if e.vllm_need_gib > e.vllm_share_gib else "")
            lines.append(
                f"| {shape} | {prompts}x{group} | {e.resident['AV weights']:.1f} | {e.resident['LoRA + moments']:.1f} "
                f"| {ar:.1f} | {phase['rollout']:.1f} | {phase['update']:.1f} | {phase['critic']:.1f} | {e.peak_phase} "
                f"| {e.total:.1f} | {'yes' if e.fits else 'no'} | {(e.what_does_not_fit() or '-') + vllm_note} "
                f"| {to_fit} |")
    return "\n".join(lines)


def parse_cases(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in case.split("x")) for case in text.split(",") if case]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(QWEN3_SHAPES))
    parser.add_argument("--cases", default="256x8,64x8")
    parser.add_argument("--bench-args", action="store_true",
                        help="print bench_step's flags for the first shape and case, the micro-batches halved "
                             "while that lowers the estimate, until it fits, then an AR-LoRA if it still does not (one line, for bench/gpu_session.sh's scaling stage)")
    defaults = Settings()
    for field in dataclasses.fields(Settings):
        if field.name in ("prompts", "group") or field.type not in ("int", "float", "bool", "str"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, type=lambda v: v.lower() in ("1", "true", "on", "yes"), default=field.default)
        else:
            parser.add_argument(flag, type={"int": int, "float": float, "str": str}[field.type], default=field.default)
    args = parser.parse_args()
    settings = dataclasses.replace(defaults, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)
                                                if hasattr(args, f.name)})
    shapes, cases = args.shapes.split(","), parse_cases(args.cases)
    if args.bench_args:
        (prompts, group), shape = cases[0], shapes[0]
        # vLLM's share, the micro-batches and an AR-LoRA: bench_step has no switch for the other options.
        e = estimate(shape, dataclasses.replace(settings, prompts=prompts, group=group))
        share = max(e.settings.vllm_gpu_mem, math.ceil(20 * e.vllm_need_gib / e.settings.gpu_gib) / 20)
        e = estimate(shape, dataclasses.replace(e.settings, vllm_gpu_mem=share))
        while not e.fits and max(e.settings.micro_batch, e.settings.critic_micro_batch) > 1:
            s = e.settings
            bigger = "micro_batch" if s.micro_batch >= s.critic_micro_batch else "critic_micro_batch"
            smaller = estimate(shape, dataclasses.replace(s, **{bigger: max(1, getattr(s, bigger) // 2)}))
            if smaller.total >= e.total:  # the peak is elsewhere (the rollout): smaller micro-batches only cost time
                break
            e = smaller
        if not e.fits and e.settings.critic and not e.settings.ar_lora:
            e = estimate(shape, dataclasses.replace(e.settings, ar_lora=True))
        print(bench_args(e))
        return
    print(table(shapes, cases, settings))


if __name__ == "__main__":
    main()
