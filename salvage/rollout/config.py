"""Rollout engine configuration and construction (one config key picks the backend)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from salvage.errors import ConfigError
from salvage.types import RolloutEngine

log = logging.getLogger(__name__)

BACKENDS = ("hf", "vllm")
DEFAULT_GENERATE_TIMEOUT_S = 600.0


@dataclass
class EngineConfig:
    """Sampling settings of a rollout engine. Every field is a config key."""

    backend: str = "hf"
    """``hf`` (our decode loop on the live model; CPU and GPU) or ``vllm`` (a colocated
    ``vllm.LLM``: the extra ``gpu`` on a GPU, or vLLM's CPU build)."""
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
    generate_timeout_s: float | None = DEFAULT_GENERATE_TIMEOUT_S
    """Wall-clock limit of one ``generate`` call (seconds; None: none). A call past it is
    interrupted and counts as an engine error: the engine is rebuilt and the call retried
    once, then the update fails."""
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
    vllm_enforce_eager: bool | None = None
    """vllm: no CUDA graphs / compilation (faster start, slower decoding; quick checks).
    None: eager on CPU (vLLM's CPU build), compiled on a GPU."""
    vllm_cpu_kvcache_gb: int | None = None
    """vllm on CPU: the engine's KV cache in GiB (``VLLM_CPU_KVCACHE_SPACE``, set for each
    build); None: a ``VLLM_CPU_KVCACHE_SPACE`` already set, else 1. The sum over a
    process's engines must fit in half the machine's memory."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"engine.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.temperature < 0:
            raise ConfigError(f"engine.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"engine.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"engine.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.generate_timeout_s is not None and self.generate_timeout_s <= 0:
            raise ConfigError(
                f"engine.generate_timeout_s must be > 0 (or null: no limit), got "
                f"{self.generate_timeout_s}"
            )
        if self.batch_size < 1 or self.logprob_batch_size < 1:
            raise ConfigError("engine.batch_size and engine.logprob_batch_size must be >= 1")
        if self.hf_decode_loop not in ("own", "generate"):
            raise ConfigError(
                f"engine.hf_decode_loop must be 'own' or 'generate', got {self.hf_decode_loop!r}"
            )
        if self.hf_compile_max_rows < 1:
            raise ConfigError(
                f"engine.hf_compile_max_rows must be >= 1, got {self.hf_compile_max_rows}"
            )
        if self.hf_compile_decode and self.hf_decode_loop != "own":
            raise ConfigError("engine.hf_compile_decode=true needs engine.hf_decode_loop='own'")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                f"engine.vllm_gpu_memory_utilization must be in (0, 1], got "
                f"{self.vllm_gpu_memory_utilization}"
            )
        if self.vllm_cpu_kvcache_gb is not None and self.vllm_cpu_kvcache_gb < 1:
            raise ConfigError(
                f"engine.vllm_cpu_kvcache_gb must be a whole number of GiB >= 1, got "
                f"{self.vllm_cpu_kvcache_gb}"
            )
        if self.vllm_sleep_level not in (0, 1, 2):
            raise ConfigError(
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
        raise ConfigError(f"engine.backend must be one of {BACKENDS}, got {cfg.backend!r}")
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
    """The rollout engine failed on a request and again on a rebuilt engine (or could not
    be rebuilt); the update cannot go on."""


class GenerateTimeout(RuntimeError):
    """A ``generate`` call ran past ``engine.generate_timeout_s``."""


EXIT_ENGINE_HUNG = 70
"""Exit status (``EX_SOFTWARE``) when a ``generate`` call could not even be interrupted
(stuck in native code past its limit and a grace period): the process ends itself."""

_HARD_EXIT_HOOKS: list[Callable[[], None]] = []
"""Run before that hard exit (it skips ``atexit``): the engines' temporary checkpoints."""


def on_hard_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` before the process ends itself on a stuck ``generate`` call."""
    _HARD_EXIT_HOOKS.append(fn)


def hard_exit_grace_s(timeout_s: float) -> float:
    """How long past its limit a stuck call may go on before the process ends itself."""
    return min(120.0, max(10.0, timeout_s))


def _hard_exit(timeout_s: float) -> None:
    print(
        f"salvage: error: a rollout engine generate call ran past engine.generate_timeout_s="
        f"{timeout_s:g} s and did not stop within {hard_exit_grace_s(timeout_s):g} s more "
        f"(stuck outside Python); exiting with status {EXIT_ENGINE_HUNG} (last.ckpt holds "
        f"the last finished update)",
        file=sys.stderr,
        flush=True,
    )
    for fn in _HARD_EXIT_HOOKS:
        with contextlib.suppress(Exception):
            fn()
    os._exit(EXIT_ENGINE_HUNG)


@contextlib.contextmanager
def generate_guard(timeout_s: float | None) -> Iterator[None]:
    """One ``generate`` call's wall-clock limit, and SIGTERM ending the call at once.

    - The limit is a ``SIGALRM`` timer whose handler raises :class:`GenerateTimeout` in the
      call (Python code, vLLM's scheduler loop included, is interrupted between
      bytecodes; native code when it returns). Should the call still not return
      :func:`hard_exit_grace_s` later (stuck in native code), a watchdog thread prints one
      line, removes the engines' temporary checkpoints and ends the process with
      :data:`EXIT_ENGINE_HUNG`.
    - A SIGTERM during the call runs the handler that was there (Lightning's marks the
      run stopped) and then raises Lightning's ``SIGTERMException`` out of the call: the
      update in flight is dropped, ``last.ckpt`` holds the last finished one and
      ``salvage fit`` exits 75 (Lightning alone would wait for the call to return). SIGINT
      needs nothing here: Python raises ``KeyboardInterrupt`` in the call (exit 130).

    Signals are the main thread's: from another thread the call runs without a limit.
    ``timeout_s`` None or 0: no limit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    prev_alarm = signal.getsignal(signal.SIGALRM)
    prev_term = signal.getsignal(signal.SIGTERM)

    def on_alarm(signum: int, frame: Any) -> None:
        raise GenerateTimeout(
            f"the generate call ran past engine.generate_timeout_s={timeout_s:g} s "
            f"(raise it for longer rollouts)"
        )

    def on_term(signum: int, frame: Any) -> None:
        if callable(prev_term):
            prev_term(signum, frame)
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        raise SIGTERMException

    watchdog: threading.Timer | None = None
    term_set = callable(prev_term) and prev_term is not signal.default_int_handler
    if term_set:
        signal.signal(signal.SIGTERM, on_term)
    if timeout_s:
        signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        watchdog = threading.Timer(
            timeout_s + hard_exit_grace_s(timeout_s), _hard_exit, args=(timeout_s,)
        )
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    finally:
        if timeout_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, prev_alarm)
        if watchdog is not None:
            watchdog.cancel()
        if term_set:
            signal.signal(signal.SIGTERM, prev_term)


def generate_with_retry(engine: RolloutEngine, *args: Any, **kwargs: Any) -> Any:
    """``engine.generate`` under the engine's wall-clock limit; on an error, once more on a
    rebuilt engine.

    An error inside an engine (a timeout included) may leave it broken (vLLM's scheduler
    spinning on a failed request), so it is never retried on the same engine: the engine's
    ``rebuild()`` disposes of what it built and builds it anew, then the call runs once
    more. A second error, or an engine without ``rebuild``, fails the update with
    :class:`RolloutEngineError` naming both causes. Signals (SIGTERM, SIGINT) are not
    errors: they stop the run (:func:`generate_guard`)."""
    timeout = getattr(engine, "generate_timeout_s", DEFAULT_GENERATE_TIMEOUT_S)
    try:
        with generate_guard(timeout):
            return engine.generate(*args, **kwargs)
    except Exception as first:  # noqa: BLE001 - any engine fault: rebuild, retry once
        rebuild = getattr(engine, "rebuild", None)
        if rebuild is None:
            raise RolloutEngineError(
                f"rollout engine failed: {first!r} ({type(engine).__name__} has no rebuild(), "
                f"so it is not retried on the same engine)"
            ) from first
        log.warning("rollout engine error: %r; rebuilding the engine, retrying once", first)
        try:
            rebuild()
        except Exception as e:
            raise RolloutEngineError(
                f"rollout engine failed: {first!r}, and could not be rebuilt: {e!r}"
            ) from e
        try:
            with generate_guard(timeout):
                return engine.generate(*args, **kwargs)
        except Exception as second:
            raise RolloutEngineError(
                f"rollout engine failed twice (the second time rebuilt): first {first!r}, "
                f"then {second!r}"
            ) from second
