"""Rollout engine configuration and construction (one config key picks the backend)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from salvage.types import RolloutEngine

BACKENDS = ("hf", "vllm")


@dataclass
class EngineConfig:
    """Sampling settings of a rollout engine. Every field is a config key."""

    backend: str = "hf"
    """``hf`` (transformers generate; CPU and tests) or ``vllm`` (GPU, extra ``gpu``)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with this much probability (1: off)."""
    max_new_tokens: int = 256
    """Cap on generated tokens per response (per turn for agents)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation of a sample ends once its text contains one (kept)."""
    batch_size: int = 64
    """Sequences per ``generate`` call."""
    logprob_batch_size: int = 8
    """Sequences per forward pass when recomputing behaviour log-probs (vllm, or hf with
    ``hf_recompute_logprobs``)."""
    hf_recompute_logprobs: bool | None = None
    """hf: behaviour log-probs from a separate teacher-forced pass (exact first ratio 1)
    instead of from the sampler's own logits (fp32 rounding only); None: recompute only
    under reduced precision (bf16 / fp16 weights or autocast)."""
    hf_decode_loop: str = "own"
    """hf: ``own`` (prefill + KV-cache steps, ended rows leave the batch) or ``generate``
    (``transformers`` ``generate``, the previous path; kept for one release)."""
    hf_tall_head: bool | None = None
    """hf, own loop: the LM head as ``W @ h.T`` (the vocabulary as the long GEMM dimension),
    1.3-2.3x faster than ``F.linear`` for a few rows on CPU BLAS; logits differ by fp32
    rounding only. None: on for a CPU fp32 bias-free head of >= 8192 tokens."""
    hf_compile_decode: bool = False
    """hf, own loop: run the KV-cache decode steps of small batches through ``torch.compile``
    (inductor, dynamic shapes; weights are read at run time, so updates apply). Cuts eager
    per-op overhead (tiny, 2-8 rows: 0.56-0.74x per call); the first calls compile (~20 s
    per graph on 2 CPUs)."""
    hf_compile_max_rows: int = 8
    """hf, with ``hf_compile_decode``: compiled steps only while at most this many rows are
    live; larger steps run eager (on tiny the compiled step is no faster above ~12 rows)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vllm: fraction of the GPU the engine may take while awake (GRAFT runs two)."""
    vllm_sleep_level: int = 1
    """vllm: between rollout phases 1 offloads weights to CPU, 2 discards them (re-synced
    from the policy), 0 never sleeps. Only one engine per process can sleep (the first
    trainable policy's); the others run at 0 within their memory share."""
    vllm_recompute_logprobs: bool = True
    """vllm: behaviour log-probs from the training policy (exact ratio 1) instead of vLLM's
    (those need top_p = 1)."""
    vllm_max_model_len: int | None = None
    """vllm: context length (prompt + response); None: the model's."""
    vllm_dtype: str = "bfloat16"
    """vllm: the engine's weight dtype (the weights are cast to it at every sync)."""
    vllm_enforce_eager: bool = False
    """vllm: no CUDA graphs / compilation (faster start, slower decoding; quick checks)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"engine.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.temperature < 0:
            raise ValueError(f"engine.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"engine.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"engine.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1 or self.logprob_batch_size < 1:
            raise ValueError("engine.batch_size and engine.logprob_batch_size must be >= 1")
        if self.hf_decode_loop not in ("own", "generate"):
            raise ValueError(
                f"engine.hf_decode_loop must be 'own' or 'generate', got {self.hf_decode_loop!r}"
            )
        if self.hf_compile_max_rows < 1:
            raise ValueError(
                f"engine.hf_compile_max_rows must be >= 1, got {self.hf_compile_max_rows}"
            )
        if self.hf_compile_decode and self.hf_decode_loop != "own":
            raise ValueError("engine.hf_compile_decode=true needs engine.hf_decode_loop='own'")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(
                f"engine.vllm_gpu_memory_utilization must be in (0, 1], got "
                f"{self.vllm_gpu_memory_utilization}"
            )
        if self.vllm_sleep_level not in (0, 1, 2):
            raise ValueError(
                f"engine.vllm_sleep_level must be 0, 1 or 2, got {self.vllm_sleep_level}"
            )
        if self.backend == "vllm":
            from salvage.rollout.vllm_rules import check_vllm_sampling

            check_vllm_sampling(self.temperature, self.top_p, self.vllm_recompute_logprobs)


ENGINE_CLASSES = {
    "hf": "salvage.rollout.hf:HFEngine",
    "vllm": "salvage.rollout.vllm:VLLMEngine",  # imports vllm lazily: an optional GPU extra
}
"""The engines by ``engine.backend``: each class builds itself with ``from_config``."""


def build_engine(
    cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any, frozen: bool = False
) -> RolloutEngine:
    """The engine ``cfg.backend`` names, sampling from ``model`` (``frozen``: a teacher, never re-synced)."""
    if cfg.backend not in ENGINE_CLASSES:
        raise ValueError(f"engine.backend must be one of {BACKENDS}, got {cfg.backend!r}")
    import importlib

    mod, name = ENGINE_CLASSES[cfg.backend].split(":")
    engine: RolloutEngine = getattr(importlib.import_module(mod), name).from_config(
        cfg, model, tokenizer, frozen
    )
    return engine


def call_settings(
    engine: RolloutEngine,
    seed: int | None,
    temperature: float | None,
    top_p: float | None,
    max_new_tokens: int | None,
    stop: Any,
) -> tuple[int, float, float, int, tuple[str, ...]]:
    """One ``generate`` call's settings: the call's overrides, else the engine's own; an unseeded
    call takes the engine's call counter as its seed (and every call advances it)."""
    if seed is None:
        seed = engine.calls
    engine.calls += 1
    return (
        seed,
        engine.temperature if temperature is None else temperature,
        engine.top_p if top_p is None else top_p,
        engine.max_new_tokens if max_new_tokens is None else max_new_tokens,
        engine.stop if stop is None else tuple(stop),
    )


class RolloutEngineError(RuntimeError):
    """The rollout engine failed twice on the same request; the step cannot go on."""


def generate_with_retry(engine: RolloutEngine, *args: Any, **kwargs: Any) -> Any:
    """``engine.generate`` retried once on an error; a second error fails with both causes."""
    import logging

    try:
        return engine.generate(*args, **kwargs)
    except Exception as first:  # noqa: BLE001 - any engine fault gets one retry
        logging.getLogger(__name__).warning("rollout engine error, retrying once: %r", first)
        try:
            return engine.generate(*args, **kwargs)
        except Exception as second:
            raise RolloutEngineError(
                f"rollout engine failed twice: first {first!r}, then {second!r}"
            ) from second
