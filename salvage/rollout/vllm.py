"""Rollout engine on vLLM (extra ``gpu``; imported lazily): colocated with training.

``engine.backend: vllm`` picks it; the HF engine stays the CPU path. The engines live in
the trainer's process, on the same GPU as the training shard. Supported: vLLM 0.27 to
0.33 (``vllm>=0.27,<0.34``); **this path has not run on a GPU in this project yet**:
every vLLM call below was checked by reading vLLM's source, not by running it.

- **In process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the first ``LLM()``
  (a user setting of 1 is refused): only then does the engine core, its executor and the
  worker holding the model live in this process.
- **Memory.** At most one engine per process uses vLLM's sleep mode (its allocator is a
  per-process singleton): the first trainable policy's. It sleeps after every rollout
  phase (level 1: weights to CPU, KV cache freed; level 2: both freed, weights re-synced)
  and wakes before the next. Every other engine (GRAFT's second policy, an LM teacher)
  runs at sleep level 0 inside its own ``gpu_memory_utilization``. Engines for the same
  live model with the same engine settings share one ``LLM`` (evaluation reuses the
  training engine with its own sampling settings).
- **Weights.** A trainable policy's engine syncs at its first ``prepare()`` (vLLM loaded
  the checkpoint on disk, not the live model) and whenever the policy's version changed
  or a level-2 sleep discarded the weights. The parameters are streamed into the worker's
  model through ``LLM.apply_model`` (one ``load_weights`` call consuming a generator): a
  sharded (FSDP2) parameter is all-gathered alone (``DTensor.full_tensor``), copied and
  freed, so no rank builds a second full copy besides vLLM's own. Every rank calls
  ``prepare()`` at the start of each rollout phase (the all-gathers are collectives).
- **Ranks.** With more than one training rank, one engine per rank joins the live
  process group through vLLM's ``external_launcher`` (``RANK`` / ``WORLD_SIZE`` set from
  the group, ``LOCAL_RANK`` from the rank's CUDA device); with one rank, vLLM's in-process executor.
- **Sampling.** n samples per prompt; request seeds spaced by n (vLLM seeds sample j
  with ``seed + j``); greedy asks for one sample and copies it n times; temperature in
  [0, 2] (not in (0, 0.01)); stop strings kept in the text; token ids in and out.
- **Log-probs.** By default recomputed with the training policy at the sampling
  temperature (``recompute_logprobs``: exactly what the update's ratio divides by);
  otherwise vLLM's sampled-token log-probs after temperature
  (``logprobs_mode="processed_logprobs"``), refused with top_p < 1 (renormalised over
  the nucleus, so the first ratio would not be 1).
- **RNG.** Building an engine reseeds Python, NumPy, torch and CUDA; the states are put
  back after every vLLM call that may touch them.

vLLM source read (file:line in 0.33.0 / 0.27.0, both under ``vllm/``):

- ``envs.py:1444`` / same key: ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to 1, read as
  ``bool(int(...))``; ``v1/engine/core.py:248`` / ``:247`` ``enable_envs_cache()`` freezes
  all variables once an engine core exists (so it is set before the first ``LLM()``).
- ``v1/engine/llm_engine.py:170,186`` / ``:157,174``: multiprocess mode from that variable;
  ``:138`` / ``:125`` ``model_executor`` exists only in process.
- ``entrypoints/llm.py:604`` / ``:595`` ``LLM.apply_model(func)`` ->
  ``v1/engine/llm_engine.py:503`` / ``:435`` ``collective_rpc("apply_model", (func,))`` ->
  ``v1/executor/uniproc_executor.py`` ``collective_rpc`` runs it on the in-process
  ``WorkerWrapperBase`` (``v1/worker/worker_base.py:370`` forwards to the worker) ->
  ``worker_base.py:165`` / ``:128`` ``fn(self.get_model())`` ->
  ``v1/worker/gpu_model_runner.py:3078`` / ``:3343`` ``get_model()`` (the CUDA-graph
  wrapper unwrapped). In process the function is called directly, not pickled.
  ``model_executor/models/qwen2.py:519`` ``load_weights(weights: Iterable[(name, tensor)])``
  returns the loaded names (HF names; stacked q/k/v and gate/up handled there).
- ``entrypoints/llm.py:839`` / ``:799`` ``sleep(level)``: level 0 there means "pause
  scheduling", so an engine at our level 0 never calls it; ``:872`` / ``:824``
  ``wake_up(tags=None)``; ``:832`` / ``:792`` ``reset_prefix_cache()``.
- ``v1/worker/gpu_worker.py:413-416`` / ``:273-275``: a second sleep-mode engine fails with
  "CuMem allocator can only be used for one instance per process";
  ``device_allocator/cumem.py:112-127`` the allocator singleton; its ``sleep`` (``:233``)
  offloads or frees every allocation in the pool, whichever engine made it.
- ``v1/worker/gpu_worker.py:517,1094`` / ``:388,820`` ``set_random_seed(seed)`` ->
  ``utils/torch_utils.py:528`` / ``:404`` seeds random, numpy, torch and all CUDA devices.
- ``v1/executor/uniproc_executor.py:77-86`` / ``:71-75``: the one-process executor
  creates a 1-process torch.distributed group; ``:186-196`` / ``:175-185`` the external
  launcher reads ``os.environ["RANK"]`` and ``["LOCAL_RANK"]`` and asserts
  multiprocessing off; ``distributed/parallel_state.py:1928`` joins an initialised group
  instead of creating one; ``v1/worker/gpu_worker.py:454,491`` the engine's device is
  ``cuda:LOCAL_RANK`` for the external launcher.
- ``sampling_params.py:668`` / ``:559`` temperature > 2 refused; ``:560`` / ``:458``
  0 < temperature < 0.01 raised to 0.01; ``:615-620,769`` / ``:643`` n > 1 refused at
  temperature 0; ``v1/engine/parallel_sampling.py:80`` (both) child j seeded ``seed + j``.
- ``v1/sample/ops/topk_topp_sampler.py:303-308`` / ``:143-148`` ``processed_logprobs`` is
  ``log_softmax`` after ``apply_top_k_top_p`` (top-p renormalised); 0.33's model runner V2
  (its default when Triton is present, ``config/vllm.py:731-766``) does the same
  (``v1/worker/gpu/sample/sampler.py:173,347``) and its ``get_model()``
  (``v1/worker/gpu/model_runner.py:568``) returns the model itself.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from salvage.errors import ConfigError
from salvage.lm import response_logprobs, weights_version
from salvage.rollout.config import (
    DEFAULT_GENERATE_TIMEOUT_S,
    EngineConfig,
    call_settings,
    on_hard_exit,
)
from salvage.rollout.vllm_rules import (
    CPU_KVCACHE_VAR,
    REGISTRY,
    PlatformFacts,
    SyncState,
    check_cpu_kvcache_fits,
    check_servable,
    check_vllm_sampling,
    check_vllm_version,
    cpu_kvcache_gib,
    cpu_scheduler_kwargs,
    cpu_weight_packing_problem,
    default_enforce_eager,
    executor_backend,
    launcher_env,
    model_head_dim,
    platform_sleep_level,
    preserved_rng,
    request_seeds,
    require_in_process,
    samples_to_send,
)
from salvage.types import Sample

log = logging.getLogger(__name__)


def import_vllm() -> Any:
    """``import vllm`` after checking the installed version is a supported one.

    The version is read from the package metadata first, so an unsupported vllm (built
    for another torch) fails with the supported range instead of an import error."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        check_vllm_version(version("vllm"))
    except PackageNotFoundError:
        pass  # not installed as a distribution: the import decides
    import vllm

    check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
    return vllm


def vllm_available() -> tuple[bool, str]:
    """Whether this process can run the vLLM engine, and if not, why.

    The platform is vLLM's own ``current_platform``: its CPU build runs on the CPU, its
    CUDA / ROCm builds need a visible GPU."""
    try:
        import_vllm()
        from vllm.platforms import current_platform
    except ImportError as e:  # not installed, an unsupported version, or a broken install
        if isinstance(e, ModuleNotFoundError) and e.name == "vllm":
            return False, (
                "vllm is not installed (pip install 'salvage[gpu]'; on a CPU, vLLM's CPU "
                "build: make test-vllm shows how)"
            )
        return False, str(e)
    if current_platform.is_cpu():
        return True, ""
    if current_platform.is_cuda_alike() and torch.cuda.is_available():
        return True, ""
    name = getattr(current_platform, "device_type", "") or "none"
    return False, f"vLLM found no platform it runs on here (platform {name!r}; no GPU visible)"


def platform_facts() -> PlatformFacts:
    """What the engine needs of vLLM's ``current_platform`` (``vllm/platforms/``)."""
    from vllm.platforms import current_platform as plat

    heads = None
    if plat.is_cpu():  # CPU_ATTN is the CPU platform's attention backend
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        heads = tuple(int(h) for h in CPUAttentionBackend.get_supported_head_sizes())
    return PlatformFacts(
        name=str(plat.device_type),
        is_cpu=bool(plat.is_cpu()),
        sleep_available=bool(plat.is_sleep_mode_available()),
        dtypes=tuple(str(d).removeprefix("torch.") for d in plat.supported_dtypes),
        head_sizes=heads,
    )


def iter_full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) one parameter at a time; sharded ones all-gathered alone.

    Names are the HF checkpoint names vLLM's ``load_weights`` expects (FSDP2 keeps the
    module's own names). Every rank must iterate in step (each ``full_tensor`` is a
    collective).
    """
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t
    for name, b in model.named_buffers():
        if name.endswith("inv_freq"):  # rotary tables: vLLM builds its own
            continue
        yield name, b.detach()


SOURCE_PREFIX = "salvage-vllm-"
"""Temporary checkpoints are ``<tmp>/salvage-vllm-<pid>-<random>``."""
_SOURCE_RE = re.compile(re.escape(SOURCE_PREFIX) + r"(\d+)-")
_LIVE_CHECKPOINTS: weakref.WeakSet[TempCheckpoint] = weakref.WeakSet()


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_checkpoints(tmp: str | None = None) -> list[Path]:
    """Remove the temporary checkpoints of processes that are gone (killed before their
    exit handlers ran); returns what was removed."""
    removed = []
    for path in Path(tmp or tempfile.gettempdir()).glob(SOURCE_PREFIX + "*"):
        m = _SOURCE_RE.match(path.name)
        if m and path.is_dir() and not _pid_running(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class TempCheckpoint:
    """A built-in model saved for vLLM to build its architecture from, removed when the
    engine closes, when this object is collected, at exit (``weakref.finalize``), before
    a hard exit on a stuck call, and by the next engine build if the process was killed."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, tmp: str | None = None) -> None:
        sweep_stale_checkpoints(tmp)
        self.path = Path(tempfile.mkdtemp(prefix=f"{SOURCE_PREFIX}{os.getpid()}-", dir=tmp))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)
        _LIVE_CHECKPOINTS.add(self)
        try:
            state = {
                k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in model.state_dict().items()
            }
            save: Any = model.save_pretrained  # an HF PreTrainedModel
            save(self.path, state_dict=state, safe_serialization=True)
            tokenizer.save_pretrained(self.path)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        self._finalizer()


def _remove_live_checkpoints() -> None:
    for ckpt in list(_LIVE_CHECKPOINTS):
        ckpt.remove()


on_hard_exit(_remove_live_checkpoints)


def _source(model: torch.nn.Module, tokenizer: Any) -> tuple[str, TempCheckpoint | None]:
    """A path or hub id vLLM can build the architecture from, and the temporary checkpoint
    that holds it when the model is a built-in one (saved for this engine)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if name and (Path(name).is_dir() or "/" in name):
        return name, None
    ckpt = TempCheckpoint(model, tokenizer)
    return str(ckpt.path), ckpt


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
        self.llm = _new_llm(self.build, self.facts, self.kv_gib, self.frozen)
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


def _new_llm(kwargs: dict[str, Any], facts: PlatformFacts | None, kv_gib: int, frozen: bool) -> Any:
    """``vllm.LLM(**kwargs)``, with the CPU platform's process-wide settings applied for the
    build and put back after it:

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
        with preserved_rng():
            return LLM(**kwargs)
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
    )
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
    try:
        llm = _new_llm(kwargs, facts, kv_gib, frozen)
    except BaseException:
        if checkpoint is not None:
            checkpoint.remove()
        raise
    backend = _Backend(
        llm, model, level, frozen, build=kwargs, facts=facts, kv_gib=kv_gib, checkpoint=checkpoint
    )
    if level:
        REGISTRY.claim_sleep(backend)
    REGISTRY.add(model, key, backend)
    backend.release()
    return backend


class VLLMEngine:
    """``RolloutEngine`` on a colocated ``vllm.LLM`` holding a copy of the live policy."""

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any, frozen: bool = False
    ) -> VLLMEngine:
        """Built from ``engine.*`` settings; ``frozen``: a teacher, never re-synced."""
        return cls(
            model,
            tokenizer,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=cfg.stop,
            logprob_batch_size=cfg.logprob_batch_size,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            sleep_level=cfg.vllm_sleep_level,
            recompute_logprobs=cfg.vllm_recompute_logprobs,
            max_model_len=cfg.vllm_max_model_len,
            dtype=cfg.vllm_dtype,
            enforce_eager=cfg.vllm_enforce_eager,
            cpu_kvcache_gb=cfg.vllm_cpu_kvcache_gb,
            generate_timeout_s=cfg.generate_timeout_s,
            frozen=frozen,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] = (),
        logprob_batch_size: int = 8,
        gpu_memory_utilization: float = 0.3,
        sleep_level: int = 1,
        recompute_logprobs: bool = True,
        max_model_len: int | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        enforce_eager: bool | None = None,
        cpu_kvcache_gb: int | None = None,
        generate_timeout_s: float | None = DEFAULT_GENERATE_TIMEOUT_S,
        frozen: bool = False,
    ) -> None:
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"engine.backend=vllm: {why}")
        if sleep_level not in (0, 1, 2):
            raise ConfigError(f"engine.vllm_sleep_level must be 0, 1 or 2, got {sleep_level}")
        check_vllm_sampling(temperature, top_p, recompute_logprobs)
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.logprob_batch_size = logprob_batch_size
        self.recompute_logprobs = recompute_logprobs
        self.frozen = frozen
        self.generate_timeout_s = generate_timeout_s
        if frozen and sleep_level == 2:
            sleep_level = 1  # a frozen model has nothing to reload its weights from
        self.calls = 0
        self.last_timings: dict[str, float] = {}
        key: tuple[Any, ...] = (gpu_memory_utilization, sleep_level, recompute_logprobs)
        key += (max_model_len, dtype, enforce_eager, cpu_kvcache_gb, frozen)
        found = REGISTRY.find(model, key)
        self.backend: _Backend = found or _build_backend(
            model,
            tokenizer,
            key=key,
            sleep_level=sleep_level,
            frozen=frozen,
            gpu_memory_utilization=gpu_memory_utilization,
            recompute_logprobs=recompute_logprobs,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            cpu_kvcache_gb=cpu_kvcache_gb,
        )
        self.backend.users += 1
        self._closed = False

    @property
    def llm(self) -> Any:
        return self.backend.llm

    @property
    def sleep_level(self) -> int:
        """The sleep level this engine got (0 unless it holds the process's sleep mode)."""
        return self.backend.sleep_level

    # -- weights -----------------------------------------------------------------
    def prepare(self) -> None:
        """Wake the engine and sync the policy's weights if needed (always the first time).

        Called by every rank at the start of a rollout phase (sharded parameters are
        gathered one at a time, each a collective)."""
        self.backend.wake()
        if self.backend.needs_sync():
            self.backend.load_weights()
            self.last_timings["sync_s"] = self.backend.last_sync_s

    def release(self) -> None:
        """Free the engine's GPU memory for training (end of a rollout phase)."""
        self.backend.release()

    def rebuild(self) -> None:
        """After an error inside vLLM: dispose of the ``LLM`` and build it anew (its engines
        that share it see the new one); the next call syncs the live weights."""
        self.backend.rebuild()

    def close(self) -> None:
        """This engine is done; the last engine of a shared ``LLM`` shuts it down and removes
        its temporary checkpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.backend.users -= 1
        if self.backend.users <= 0:
            self.backend.close()

    # -- sampling ----------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[list[Sample]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed, temperature, top_p, max_new, stop = call_settings(
            self, seed, temperature, top_p, max_new_tokens, stop
        )
        check_vllm_sampling(temperature, top_p, self.recompute_logprobs)
        if self.backend.asleep or self.backend.needs_sync():
            self.prepare()  # outside a phase (or a gathered policy): no collectives needed
        t0 = time.perf_counter()
        n_send = samples_to_send(temperature, n)
        params = [
            SamplingParams(
                n=n_send,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new,
                stop=list(stop) or None,
                include_stop_str_in_output=True,
                logprobs=None if self.recompute_logprobs else 0,  # 0: the sampled token's
                seed=s,
            )
            for s in request_seeds(seed, len(prompts), n_send)
        ]
        with preserved_rng():
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
            )
        if self.frozen:
            self.release()  # a teacher sleeps between its calls (when it holds sleep mode)
        t1 = time.perf_counter()
        groups: list[list[Sample]] = []
        for prompt, out in zip(prompts, outs, strict=True):
            group = []
            for c in out.outputs:
                lps = [float(next(iter(d.values())).logprob) for d in (c.logprobs or [])]
                group.append(
                    Sample(
                        prompt_ids=list(prompt),
                        response_ids=list(c.token_ids),
                        text=c.text,
                        logprobs=lps,
                        finish_reason="length" if c.finish_reason == "length" else "stop",
                        seed=seed,
                    )
                )
            group += [copy.deepcopy(group[0]) for _ in range(n - len(group))]  # greedy copies
            groups.append(group)
        if self.recompute_logprobs:
            flat = [s for g in groups for s in g]
            exact = response_logprobs(
                self.model,
                [s.prompt_ids for s in flat],
                [s.response_ids for s in flat],
                int(self.tokenizer.pad_token_id),
                temperature=temperature if temperature > 0 else 1.0,
                batch_size=self.logprob_batch_size,
            )
            for s, lp in zip(flat, exact, strict=True):
                s.logprobs = lp
        self.last_timings.update(sample_s=t1 - t0, logprob_s=time.perf_counter() - t1)
        return groups
