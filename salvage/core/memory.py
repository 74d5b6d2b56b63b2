"""Per-GPU memory estimate of a run, per phase (rollout, update): what ``--print_memory`` shows.

A rough, conservative sum of the big buffers (no allocator fragmentation, CUDA context or
NCCL buffers: keep ~10% headroom). Everything is per GPU; ``gpus`` is the FSDP2 world size
(1: no sharding). The terms, for a model of P parameters (``Shape``):

- weights: ``P x weight bytes`` (4 for fp32 master weights, 2 for bf16), divided by the
  number of GPUs when sharded (the trained policy under FSDP2; frozen models unless
  replicated). Gradients: as the weights (FSDP2 keeps them in the parameters' dtype, sharded);
  freed (``set_to_none``) outside the update. AdamW: two states, each as the weights.
- gathered: a sharded model used whole on every GPU (FSDP2 all-gathers it): ``P x compute
  bytes`` (bf16: 2). In the update only the layers being computed are gathered (two layers,
  with prefetching) unless ``reshard_after_forward`` is off (then the whole model, kept from
  forward to backward). On one GPU under ``bf16-mixed`` autocast keeps a bf16 copy of every
  weight used in the forward: also ``P x 2``.
- KV cache of the HF engine: ``batch x length x layers x 2 x kv_dim x compute bytes``. A vLLM
  engine takes its ``gpu_memory_utilization`` share of the GPU while awake (weights + KV
  cache inside it; a batch whose KV cache does not fit waits, it does not run out of memory).
  The first trainable policy's engine sleeps outside rollouts; a teacher's, and a second
  policy's, keep their share.
- activations of the update (micro-batch x length tokens), per token and decoder layer
  ``compute bytes x (10 h + 2 kv_dim + 4 I)`` (norm outputs, q/k/v, attention output,
  residuals; SwiGLU's gate, up, activation and product) ``+ 4 x 2 h`` (two RMSNorms' fp32
  copies). With activation checkpointing only each layer's input (``h`` per token per layer)
  is kept, plus one layer's activations while it is recomputed.
- logits: the LM head's output for the scored positions in compute bytes, plus the fp32
  log-softmax kept for the backward (``salvage.lm.token_logprobs`` upcasts one row at a time
  but keeps every row's result): ``micro-batch x length x vocab x (compute bytes + 4)``.
  Without gradients (behaviour / reference scoring) only one row's fp32 copy is alive.
  Chunked (``logprob_chunk`` > 0, the modules' ``logprob_chunk_size``): one chunk of
  ``min(chunk, rows x length)`` positions at a time, its head output, fp32 log-softmax and,
  with a backward (the chunk is recomputed there), that log-softmax's gradient:
  ``chunk x vocab x (compute bytes + 4 + 4)``, ``+ 4`` less without gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's sizes (what the memory terms need)."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    kv_dim: int  # key/value heads x head dim
    vocab: int

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer with query width ``hidden`` (biases left out): q and o
        ``h x h`` each, k and v ``h x kv_dim`` each, SwiGLU ``3 x h x I``, two norms ``h``."""
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h

    @property
    def tied(self) -> bool:
        """Whether the LM head shares the input embedding (the rest of ``params`` holds one
        vocabulary matrix, not two)."""
        return self.params - self.layers * self.layer_params < 1.5 * self.vocab * self.hidden


# Shapes of the models the shipped configs name (from their config.json), so the estimate
# needs no download; other models are read from their config by the caller.
KNOWN_SHAPES: dict[str, Shape] = {
    "Qwen/Qwen2.5-1.5B-Instruct": Shape(1_543_714_304, 28, 1536, 8960, 256, 151936),
    "Qwen/Qwen2.5-7B-Instruct": Shape(7_615_616_512, 28, 3584, 18944, 512, 152064),
    "Qwen/Qwen3-1.7B-Base": Shape(1_720_574_976, 28, 2048, 6144, 1024, 151936),
    "HuggingFaceTB/SmolLM3-3B-Base": Shape(3_075_098_624, 36, 2048, 11008, 512, 128256),
}


@dataclass(frozen=True)
class ModelMem:
    """One model held by the run.

    ``role``: ``policy`` (trained), ``reference`` or ``teacher`` (frozen). ``weight_bytes``:
    bytes per stored parameter. ``sharded``: split over the GPUs (FSDP2). ``engine``: its
    rollout engine's vLLM share (fraction of the GPU) or None (HF generate / no engine).
    ``engine_sleeps``: the engine gives its share back outside rollouts. ``samples``: it
    generates (a policy, a teacher; a reference only scores). ``gathered_in_rollout``:
    all-gathered (or, unsharded, cast to compute precision) during rollouts.
    ``scores_in_update``: used whole (no gradients) during the update (a reference).
    """

    role: str
    shape: Shape
    weight_bytes: int = 4
    sharded: bool = False
    engine: float | None = None
    engine_sleeps: bool = True
    samples: bool = True
    gathered_in_rollout: bool = True
    scores_in_update: bool = False

    @property
    def trainable(self) -> bool:
        return self.role.startswith("policy")


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU of a run holds (see the module docstring for each term).

    ``engine_batch`` x ``engine_len``: the HF engine's sequences per call and their length
    (prompt + new tokens). ``micro_batch`` x ``update_len``: sequences and tokens per
    forward/backward of the update. ``autocast_copies``: one GPU under ``bf16-mixed``.
    ``logprob_batch``: sequences per no-grad scoring forward. ``logprob_chunk``: positions
    per LM-head chunk when scoring (0: the full logits).
    """

    models: tuple[ModelMem, ...]
    gpus: int = 1
    gpu_gb: float = 80.0
    compute_bytes: int = 2
    engine_batch: int = 64
    engine_len: int = 1024
    logprob_batch: int = 8
    micro_batch: int = 8
    update_len: int = 1024
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    autocast_copies: bool = False
    logprob_chunk: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)


def _per_gpu(n: float, sharded: bool, gpus: int) -> float:
    return n / gpus if sharded else n


def kv_cache_bytes(shape: Shape, batch: int, length: int, dtype_bytes: int = 2) -> float:
    """Keys and values of ``batch`` sequences of ``length`` tokens, every layer."""
    return float(batch * length * shape.layers * 2 * shape.kv_dim * dtype_bytes)


def activation_bytes_per_token_layer(shape: Shape, compute_bytes: int = 2) -> float:
    """Tensors one decoder layer keeps for its backward, per token (no checkpointing)."""
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_dim
    return float(compute_bytes * (10 * h + 2 * kv + 4 * i) + 4 * 2 * h)


def activation_bytes(
    shape: Shape, tokens: int, checkpointing: bool, compute_bytes: int = 2
) -> float:
    """Activations of one forward kept for the backward, over ``tokens`` tokens."""
    per_layer = activation_bytes_per_token_layer(shape, compute_bytes) * tokens
    if not checkpointing:
        return per_layer * shape.layers
    return float(tokens * shape.hidden * compute_bytes * shape.layers) + per_layer


def logits_bytes(
    shape: Shape, rows: int, length: int, grad: bool, compute_bytes: int = 2, chunk: int = 0
) -> float:
    """The LM head's output over ``rows`` x ``length`` positions, and its fp32 log-softmax
    (every row's kept for a backward; one row at a time without gradients). ``chunk`` > 0:
    one chunk of positions at a time (with its log-softmax gradient in the backward)."""
    if chunk > 0:
        positions = min(chunk, rows * length)
        return float(positions * shape.vocab * (compute_bytes + 4 + (4 if grad else 0)))
    head = rows * length * shape.vocab * compute_bytes
    fp32 = (rows if grad else 1) * length * shape.vocab * 4
    return float(head + fp32)


def estimate(plan: MemoryPlan) -> dict[str, dict[str, float]]:
    """Bytes per GPU: ``{"rollout": {term: bytes}, "update": {term: bytes}}``.

    Terms are summed by ``peak``; a term of 0 is left out.
    """
    g = plan.gpus
    rollout: dict[str, float] = {}
    update: dict[str, float] = {}

    def add(d: dict[str, float], key: str, value: float) -> None:
        if value:
            d[key] = d.get(key, 0.0) + value

    for m in plan.models:
        p = m.shape.params
        w = _per_gpu(p * m.weight_bytes, m.sharded, g)
        add(rollout, f"{m.role} weights", w)
        add(update, f"{m.role} weights", w)
        if m.trainable:
            add(rollout, f"{m.role} AdamW state", 2 * w)
            add(update, f"{m.role} AdamW state", 2 * w)
            add(update, f"{m.role} gradients", w)
        # rollouts: a sharded model used whole is all-gathered in compute precision
        if m.gathered_in_rollout and (m.sharded or m.weight_bytes != plan.compute_bytes):
            add(rollout, f"{m.role} gathered / cast", p * plan.compute_bytes)
        if m.samples and m.engine is not None:
            share = m.engine * plan.gpu_gb * GB
            add(rollout, f"{m.role} vLLM engine", share)
            if not m.engine_sleeps:
                add(update, f"{m.role} vLLM engine (awake)", share)
        elif m.samples:
            kv = kv_cache_bytes(m.shape, plan.engine_batch, plan.engine_len, plan.compute_bytes)
            add(rollout, f"{m.role} KV cache", kv)
        # the update: trained layers gathered as they compute; frozen scorers whole
        if m.trainable:
            if m.sharded:
                whole = not plan.reshard_after_forward
                n = p if whole else 2 * m.shape.layer_params
                add(update, f"{m.role} gathered layers", n * plan.compute_bytes)
            elif plan.autocast_copies:
                add(update, f"{m.role} bf16 autocast copies", p * plan.compute_bytes)
            tokens = plan.micro_batch * plan.update_len
            add(
                update,
                f"{m.role} activations"
                + (" (checkpointed)" if plan.activation_checkpointing else ""),
                activation_bytes(
                    m.shape, tokens, plan.activation_checkpointing, plan.compute_bytes
                ),
            )
            add(
                update,
                f"{m.role} logits",
                logits_bytes(
                    m.shape,
                    plan.micro_batch,
                    plan.update_len,
                    True,
                    plan.compute_bytes,
                    plan.logprob_chunk,
                ),
            )
        elif m.scores_in_update:
            if m.sharded:
                add(update, f"{m.role} gathered", p * plan.compute_bytes)
            add(
                update,
                f"{m.role} scoring logits",
                logits_bytes(
                    m.shape,
                    plan.micro_batch,
                    plan.update_len,
                    False,
                    plan.compute_bytes,
                    plan.logprob_chunk,
                ),
            )
    # rollouts also score behaviour log-probs (no gradients), one model at a time
    scorers = [m for m in plan.models if m.trainable]
    if scorers:
        worst = max(
            logits_bytes(
                m.shape,
                plan.logprob_batch,
                plan.engine_len,
                False,
                plan.compute_bytes,
                plan.logprob_chunk,
            )
            for m in scorers
        )
        add(rollout, "scoring logits", worst)
    return {"rollout": rollout, "update": update}


def peak(phases: dict[str, dict[str, float]]) -> tuple[str, float]:
    """The phase with the most bytes, and its bytes."""
    sums = {k: sum(v.values()) for k, v in phases.items()}
    name = max(sums, key=lambda k: sums[k])
    return name, sums[name]


def format_estimate(plan: MemoryPlan, phases: dict[str, dict[str, float]]) -> str:
    """A table for the terminal: each phase's terms and total in GB, per GPU."""
    lines = [f"Estimated memory per GPU ({plan.gpus} GPU(s), {plan.gpu_gb:.0f} GB each; rough):"]
    for phase, terms in phases.items():
        total = sum(terms.values())
        flag = "" if total <= plan.gpu_gb * GB else f"  > {plan.gpu_gb:.0f} GB: does not fit"
        lines.append(f"  {phase}: {total / GB:.1f} GB{flag}")
        for k, v in sorted(terms.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<40} {v / GB:8.2f} GB")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
