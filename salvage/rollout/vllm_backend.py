"""The ``vllm.LLM`` behind the engines: one per live model and settings, built for the
platform (CPU: sleep level 0, KV cache size, oneDNN off for trainable engines; GPU: sleep
mode), synced from the live weights, rebuilt after an error, shut down by its last user."""

from __future__ import annotations

import gc
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from salvage.lm import weights_version
from salvage.rollout.vllm_rules import (
    CPU_KVCACHE_VAR,
    REGISTRY,
    PlatformFacts,
    SyncState,
    check_cpu_kvcache_fits,
    check_servable,
    cpu_kvcache_gib,
    cpu_scheduler_kwargs,
    cpu_weight_packing_problem,
    default_enforce_eager,
    executor_backend,
    launcher_env,
    model_head_dim,
    platform_sleep_level,
    preserved_rng,
    require_in_process,
)
from salvage.rollout.vllm_support import (
    TempCheckpoint,
    _source,
    iter_full_parameters,
    owned_tempdir,
    platform_facts,
    remove_owned_dir,
)

log = logging.getLogger(__name__)


class _Backend:
    """One ``vllm.LLM`` holding a copy of one live model, shared by that model's engines."""

    def __init__(
        self,
        llm: Any,
        model: torch.nn.Module,
        sleep_level: int,
        frozen: bool,
        *,
        build: dict[str, Any] | None = None,
        facts: PlatformFacts | None = None,
        kv_gib: int = 0,
        checkpoint: TempCheckpoint | None = None,
        tmpdir: Path | None = None,
    ):
        self.llm = llm
        self.model = model
        self.sleep_level = sleep_level
        self.frozen = frozen
        self.sync = SyncState(frozen)
        self.asleep = False
        self.last_sync_s = 0.0
        self.build = build or {}
        """The ``LLM`` keyword arguments it was built with (a rebuild reuses them)."""
        self.facts = facts
        self.kv_gib = kv_gib
        """Its CPU KV cache (GiB; 0 on a GPU)."""
        self.checkpoint = checkpoint
        self.tmpdir = tmpdir
        """The dir vLLM's own temporary files went in while ``llm`` was built."""
        self.rebuilds = 0
        self.users = 0
        """Engines using it (evaluation shares the training engine's)."""

    def wake(self) -> None:
        if self.asleep:
            with preserved_rng():
                self.llm.wake_up()
            self.asleep = False

    def release(self) -> None:
        if self.sleep_level and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            self.sync.slept(self.sleep_level)

    def needs_sync(self) -> bool:
        return self.sync.needs_sync(weights_version(self.model))

    def load_weights(self) -> None:
        """Stream the live model's parameters into the worker's model (``LLM.apply_model``)."""
        t0 = time.perf_counter()
        stream = iter_full_parameters(self.model)

        def load(vllm_model: Any) -> int:  # runs on the in-process worker (vLLM's model class)
            loaded = vllm_model.load_weights(weights=stream)
            return -1 if loaded is None else len(loaded)

        with preserved_rng():
            counts = self.llm.apply_model(load)
        if counts and counts[0] == 0:
            raise RuntimeError("VLLMEngine: the weight sync loaded no parameter into vLLM")
        self.llm.reset_prefix_cache()
        self.sync.synced(weights_version(self.model))
        self.last_sync_s = time.perf_counter() - t0

    def _shutdown_llm(self) -> None:
        """Shut the in-process engine core down (``LLM.llm_engine.engine_core``, vLLM's
        ``InprocClient.shutdown``: executor, scheduler, vLLM's distributed state) and drop it."""
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            try:
                core.shutdown()
            except Exception as e:  # noqa: BLE001 - a broken engine may fail to shut down
                log.warning("vLLM engine shutdown failed: %r", e)
        del llm, core
        gc.collect()
        if self.tmpdir is not None:
            remove_owned_dir(self.tmpdir)
            self.tmpdir = None

    def rebuild(self) -> None:
        """Dispose of this ``LLM`` (after an error inside it) and build a new one with the
        same settings; it holds the live weights again at its next call (first sync).

        Only with one rank: the new engine's sync gathers sharded weights collectively,
        and the other ranks are not rebuilding."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"a vLLM engine cannot be rebuilt on one of {dist.get_world_size()} ranks "
                f"alone (its weight sync is collective)"
            )
        self._shutdown_llm()
        self.llm, self.tmpdir = _new_llm(self.build, self.facts, self.kv_gib, self.frozen)
        self.sync = SyncState(self.frozen)
        self.asleep = False
        self.rebuilds += 1
        self.release()

    def close(self) -> None:
        """Shut the engine down and remove its temporary checkpoint."""
        REGISTRY.remove(self)
        if self.llm is not None:
            self._shutdown_llm()
        if self.checkpoint is not None:
            self.checkpoint.remove()


def _new_llm(
    kwargs: dict[str, Any], facts: PlatformFacts | None, kv_gib: int, frozen: bool
) -> tuple[Any, Path]:
    """``vllm.LLM(**kwargs)`` and the dir its temporary files went in, with the CPU
    platform's process-wide settings applied for the build and put back after it:

    - ``VLLM_CPU_KVCACHE_SPACE`` = ``kv_gib`` (``platforms/cpu.py`` reads it from
      ``os.environ`` at each build: the KV cache size);
    - oneDNN linears off for a trainable engine (``vllm._custom_ops._supports_onednn``,
      read by ``model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm`` when
      the weights are loaded): oneDNN repacks the weight and replaces the ``Parameter``
      that the weight sync's ``load_weights`` writes into; plain ``F.linear`` keeps it;
    - ``torch.set_num_threads``: vLLM's ``CPUWorker.init_device`` replaces it with a no-op
      for the whole process; the function and the thread count are restored.
    """
    from vllm import LLM

    is_cpu = facts is not None and facts.is_cpu
    env_before = os.environ.get(CPU_KVCACHE_VAR)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    ops: Any = None
    onednn_before = None
    if is_cpu:
        os.environ[CPU_KVCACHE_VAR] = str(kv_gib)
        import vllm._custom_ops

        ops = vllm._custom_ops
        onednn_before = ops._supports_onednn
        if not frozen:
            ops._supports_onednn = False
    try:
        with preserved_rng(), owned_tempdir() as tmpdir:  # vLLM's vllm_dist_* under a swept dir
            try:
                return LLM(**kwargs), tmpdir
            except BaseException:
                remove_owned_dir(tmpdir)
                raise
    finally:
        if is_cpu:
            ops._supports_onednn = onednn_before
            if env_before is None:
                os.environ.pop(CPU_KVCACHE_VAR, None)
            else:
                os.environ[CPU_KVCACHE_VAR] = env_before
        if torch.set_num_threads is not set_threads:
            log.info("vLLM replaced torch.set_num_threads for this process: put back")
            setattr(torch, "set_num_threads", set_threads)  # noqa: B010
        if torch.get_num_threads() != threads:
            set_threads(threads)


def _total_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _build_backend(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    key: tuple,
    sleep_level: int,
    frozen: bool,
    gpu_memory_utilization: float,
    recompute_logprobs: bool,
    max_model_len: int | None,
    dtype: str,
    seed: int,
    enforce_eager: bool | None,
    cpu_kvcache_gb: int | None,
) -> _Backend:
    require_in_process(os.environ)
    facts = platform_facts()
    kv_gib = _check_platform(model, dtype, frozen, cpu_kvcache_gb, facts)
    level = _engine_sleep_level(model, sleep_level, frozen, gpu_memory_utilization, facts)
    source, checkpoint = _source(model, tokenizer)
    kwargs: dict[str, Any] = dict(
        model=source,
        tokenizer=source,
        dtype=dtype,
        seed=seed,
        gpu_memory_utilization=gpu_memory_utilization,
        enable_sleep_mode=level > 0,
        enable_prefix_caching=True,
        enforce_eager=default_enforce_eager(enforce_eager, facts),
        # its weight-loading bar only where its INFO lines show (salvage --verbose)
        use_tqdm_on_load=logging.getLogger("vllm").isEnabledFor(logging.INFO),
    )
    _add_platform_kwargs(kwargs, model, max_model_len, recompute_logprobs, facts)
    try:
        llm, tmpdir = _new_llm(kwargs, facts, kv_gib, frozen)
    except BaseException:
        if checkpoint is not None:
            checkpoint.remove()
        raise
    backend = _Backend(
        llm,
        model,
        level,
        frozen,
        build=kwargs,
        facts=facts,
        kv_gib=kv_gib,
        checkpoint=checkpoint,
        tmpdir=tmpdir,
    )
    if level:
        REGISTRY.claim_sleep(backend)
    REGISTRY.add(model, key, backend)
    backend.release()
    return backend


def _check_platform(
    model: torch.nn.Module,
    dtype: str,
    frozen: bool,
    cpu_kvcache_gb: int | None,
    facts: PlatformFacts,
) -> int:
    """Refuse a model the platform cannot serve; the CPU KV cache it gets (GiB; 0 on a GPU)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    check_servable(name, model_head_dim(config), dtype, facts)
    kv_gib = 0
    if facts.is_cpu:
        problem = cpu_weight_packing_problem(dtype, torch.cpu._is_amx_tile_supported(), frozen)
        if problem:
            raise ValueError(problem)
        kv_gib = cpu_kvcache_gib(cpu_kvcache_gb, os.environ)
        check_cpu_kvcache_fits(kv_gib, REGISTRY.kv_cache_gib(), _total_memory_bytes())
    return kv_gib


def _engine_sleep_level(
    model: torch.nn.Module,
    sleep_level: int,
    frozen: bool,
    gpu_memory_utilization: float,
    facts: PlatformFacts,
) -> int:
    """The sleep level the engine gets on this platform and in this process (logged if lower)."""
    level, why = platform_sleep_level(sleep_level, facts)
    if why:
        log.info("%s", why)
    requested = level
    level = REGISTRY.sleep_level(level, frozen)
    if level != requested:
        log.info(
            "vLLM engine for %s runs at sleep level 0 (%s): it keeps its "
            "gpu_memory_utilization=%.2f share during training",
            type(model).__name__,
            "a frozen model" if frozen else "another engine in this process uses sleep mode",
            gpu_memory_utilization,
        )
    return level


def _add_platform_kwargs(
    kwargs: dict[str, Any],
    model: torch.nn.Module,
    max_model_len: int | None,
    recompute_logprobs: bool,
    facts: PlatformFacts,
) -> None:
    """Add the ``LLM`` arguments of the ranks, the context, the CPU and the log-probs mode."""
    config = getattr(model, "config", None)
    dist = torch.distributed
    live = dist.is_available() and dist.is_initialized()
    backend_name = executor_backend(live, dist.get_world_size() if live else 1)
    if backend_name is not None:
        changed = launcher_env(
            os.environ, dist.get_rank(), torch.cuda.current_device(), dist.get_world_size()
        )
        for var, (old, new) in changed.items():
            log.info("vLLM external launcher: %s=%s (was %r)", var, new, old)
        kwargs["distributed_executor_backend"] = backend_name
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if facts.is_cpu:
        context = max_model_len or getattr(config, "max_position_embeddings", None) or 4096
        kwargs.update(cpu_scheduler_kwargs(int(context)))
    if not recompute_logprobs:
        kwargs["logprobs_mode"] = "processed_logprobs"
