"""The vLLM engine's rules that need no GPU and no vllm: checked here, tested on CPU.

``salvage.rollout.vllm`` applies them around ``vllm.LLM``; each rule names the vLLM
behaviour it answers (read in the sources of vLLM 0.27.0 and 0.33.0; file:line references
are in that module's docstring).

- **Version.** :func:`check_vllm_version`: the supported range, ``>=0.27,<0.34``.
- **In-process engine.** :func:`require_in_process`: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  before the first ``LLM()``; a user setting that contradicts it is an error.
- **Launcher.** :func:`executor_backend` / :func:`launcher_env`: ``external_launcher``
  only when the live process group has more than one rank, with ``RANK`` (global),
  ``LOCAL_RANK`` (the device index) and ``WORLD_SIZE`` taken from it.
- **Sleep mode.** :class:`EngineRegistry`: one sleep-mode engine per process (vLLM's
  ``CuMemAllocator`` is a per-process singleton); engines of the same live model share
  one ``LLM`` (evaluation reuses the training engine).
- **Sync.** :class:`SyncState`: a trainable policy's engine syncs at its first
  ``prepare()``; a frozen (teacher) engine never does.
- **Sampling.** :func:`check_vllm_sampling`, :func:`request_seeds`, :func:`samples_to_send`.
- **RNG.** :func:`preserved_rng`: building an engine reseeds the global RNGs; they are
  put back.
- **Platform.** :class:`PlatformFacts` (read from vLLM's ``current_platform``):
  :func:`platform_sleep_level` (no sleep mode on CPU), :func:`default_enforce_eager`,
  :func:`check_servable` (head size, dtype), :func:`cpu_kvcache_gib` /
  :func:`check_cpu_kvcache_fits`, :func:`cpu_scheduler_kwargs` (seeded requests, no
  chunked prefill), :func:`cpu_weight_packing_problem` (read in vLLM 0.32.0's CPU build).
"""

from __future__ import annotations

import contextlib
import random
import re
import weakref
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from salvage.errors import ConfigError

SUPPORTED_VLLM = (0, 27), (0, 34)
"""Supported vLLM versions: from 0.27 (inclusive) up to 0.34 (exclusive)."""
SUPPORTED_VLLM_TEXT = "vllm>=0.27,<0.34"
MP_VAR = "VLLM_ENABLE_V1_MULTIPROCESSING"
VLLM_MAX_TEMPERATURE = 2.0
"""vLLM's ``SamplingParams`` refuses temperature > 2."""
VLLM_MIN_TEMPERATURE = 1e-2
"""vLLM raises a temperature in (0, 0.01) to 0.01 (with a warning): refused instead."""
SEED_MODULUS = 2**31 - 1


# -- version ---------------------------------------------------------------------------
def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.33.0`` or ``0.33.1.dev3+g1a2b``."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        raise ImportError(f"cannot read the vllm version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_vllm_version(version: str) -> None:
    """Fail with the supported range unless ``version`` is in it."""
    lo, hi = SUPPORTED_VLLM
    if not lo <= parse_version(version) < hi:
        raise ImportError(
            f"vllm {version} is installed, but salvage's vLLM engine supports "
            f"{SUPPORTED_VLLM_TEXT} (read against 0.27.0 and 0.33.0): "
            f"pip install '{SUPPORTED_VLLM_TEXT}' (or pip install 'salvage[gpu]')"
        )


# -- in-process engine -----------------------------------------------------------------
def require_in_process(environ: MutableMapping[str, str]) -> None:
    """Make vLLM run its engine core in this process; refuse a setting that says otherwise.

    The weight sync reaches the model through ``LLM.apply_model``, i.e. a function run on
    the worker's model, which needs the worker in the trainer's process; vLLM starts a
    separate engine process unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0 (default 1).
    """
    value = environ.get(MP_VAR)
    if value is None:
        environ[MP_VAR] = "0"
        return
    try:
        on = bool(int(value))
    except ValueError:
        on = True  # vLLM would fail on it too (it reads int(value))
    if on:
        raise RuntimeError(
            f"{MP_VAR}={value!r} is set, but salvage's vLLM engine must run inside the "
            f"trainer's process (weights are synced in place through LLM.apply_model): "
            f"unset {MP_VAR} or set it to 0"
        )


# -- launcher ----------------------------------------------------------------------------
def executor_backend(dist_initialized: bool, world_size: int) -> str | None:
    """``external_launcher`` when the trainer runs several ranks, else vLLM's default.

    One ``LLM`` per training rank (tensor parallel 1): vLLM's external launcher joins the
    live process group instead of starting its own workers. A single-process run leaves
    it to vLLM (its in-process executor), even when an earlier engine created a
    1-process group."""
    return "external_launcher" if dist_initialized and world_size > 1 else None


def launcher_env(
    environ: MutableMapping[str, str], rank: int, local_rank: int, world_size: int | None = None
) -> dict[str, tuple[str | None, str]]:
    """Set ``RANK`` and ``LOCAL_RANK`` (read by vLLM's external launcher) from the live group.

    ``rank`` is the *global* rank (``dist.get_rank()``), ``local_rank`` the CUDA device index
    this rank trains on (vLLM puts the engine on ``cuda:LOCAL_RANK``): on node 1 of a 2 x 2
    world, global rank 3 on device 1, or device 0 when the launcher gives each process one
    visible GPU. ``world_size`` (the live group's) also sets ``WORLD_SIZE``, completing the
    ``env://`` variables a launcher such as SLURM does not set (Lightning sets ``MASTER_ADDR``
    / ``MASTER_PORT``). Returns ``{name: (old, new)}`` for every variable it changed."""
    wanted = [("RANK", str(rank)), ("LOCAL_RANK", str(local_rank))]
    if world_size is not None:
        wanted.append(("WORLD_SIZE", str(world_size)))
    changed: dict[str, tuple[str | None, str]] = {}
    for name, val in wanted:
        old = environ.get(name)
        if old != val:
            environ[name] = val
            changed[name] = (old, val)
    return changed


# -- sampling -------------------------------------------------------------------------------
def check_vllm_sampling(
    temperature: float, top_p: float, recompute_logprobs: bool, where: str = "engine"
) -> None:
    """Refuse settings vLLM would reject or silently change (the HF engine accepts them)."""
    if temperature > VLLM_MAX_TEMPERATURE:
        raise ConfigError(
            f"{where}.temperature={temperature}: vLLM accepts temperatures in [0, 2] "
            f"(use backend: hf for higher ones)"
        )
    if 0 < temperature < VLLM_MIN_TEMPERATURE:
        raise ConfigError(
            f"{where}.temperature={temperature}: vLLM raises temperatures below "
            f"{VLLM_MIN_TEMPERATURE} to {VLLM_MIN_TEMPERATURE}; use 0 (greedy) or >= "
            f"{VLLM_MIN_TEMPERATURE}"
        )
    if not recompute_logprobs and top_p < 1:
        raise ConfigError(
            f"{where}.top_p={top_p} with vllm_recompute_logprobs=false: vLLM's "
            f"processed log-probs are renormalised over the top-p nucleus, so the update's "
            f"first ratio would not be 1; set vllm_recompute_logprobs: true or top_p: 1"
        )


def samples_to_send(temperature: float, n: int) -> int:
    """Samples per prompt to ask vLLM for: greedy (temperature 0) sends 1, the rest are copies.

    vLLM refuses n > 1 at temperature 0; greedy decoding gives the same sequence n times
    (what the HF engine returns)."""
    return 1 if temperature == 0 else n


def request_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """Per-prompt request seeds, spaced by ``n``.

    vLLM seeds sample j of a request with ``seed + j``; with prompt i at ``base + i * n``
    the samples of a call use seeds ``base .. base + num_prompts * n - 1``, each once.
    ``base`` mixes the call's seed into [0, 2**31 - 1)."""
    base = (seed * 1_000_003) % SEED_MODULUS
    return [base + i * n for i in range(num_prompts)]


# -- sync bookkeeping ---------------------------------------------------------------------
class SyncState:
    """Which policy version a vLLM engine holds.

    A trainable policy's engine starts unsynced: vLLM loads the checkpoint on disk, which
    is not the live model after a resume, a warm start or mid-run; its first ``prepare()``
    syncs. A frozen engine (a teacher) holds what it loaded and never syncs."""

    def __init__(self, frozen: bool) -> None:
        self.frozen = frozen
        self.version: int | None = None
        self.weights_lost = False

    def needs_sync(self, version: int) -> bool:
        if self.frozen:
            return False
        return self.version is None or self.version != version or self.weights_lost

    def synced(self, version: int) -> None:
        self.version = version
        self.weights_lost = False

    def slept(self, level: int) -> None:
        """Level 2 discards the weights: the next wake must reload them."""
        if level == 2:
            self.weights_lost = True


# -- engine registry ------------------------------------------------------------------------
class EngineRegistry:
    """The vLLM engines of one process.

    vLLM's sleep mode allocates through ``CuMemAllocator``, one per process: a second
    sleep-mode engine fails at load and ``sleep`` would free every engine's memory. So at
    most one engine sleeps: the first trainable policy's (frozen teachers never take it);
    every other engine runs at sleep level 0 within its own ``gpu_memory_utilization``.
    Engines for the same live model with the same engine settings share one backend (one
    ``LLM``): evaluation reuses the training engine."""

    def __init__(self) -> None:
        self.sleep_owner: Any = None
        self._shared: list[tuple[weakref.ref, tuple, Any]] = []

    def sleep_level(self, requested: int, frozen: bool) -> int:
        """The sleep level an engine about to be built gets."""
        if requested == 0 or frozen or self.sleep_owner is not None:
            return 0
        return requested

    def claim_sleep(self, backend: Any) -> None:
        if self.sleep_owner is not None and self.sleep_owner is not backend:
            raise RuntimeError("a vLLM engine in this process already uses sleep mode")
        self.sleep_owner = backend

    def find(self, model: Any, key: tuple) -> Any:
        """The backend already built for this live ``model`` with these settings, if any."""
        self._shared = [(r, k, b) for r, k, b in self._shared if r() is not None]
        for ref, k, backend in self._shared:
            if ref() is model and k == key:
                return backend
        return None

    def add(self, model: Any, key: tuple, backend: Any) -> None:
        self._shared.append((weakref.ref(model), key, backend))

    def remove(self, backend: Any) -> None:
        """Forget a closed backend (and free the process's sleep mode if it held it)."""
        self._shared = [(r, k, b) for r, k, b in self._shared if b is not backend]
        if self.sleep_owner is backend:
            self.sleep_owner = None

    def kv_cache_gib(self) -> list[int]:
        """The CPU KV cache (GiB) of each live backend (``kv_gib``; 0 on a GPU)."""
        return [int(getattr(b, "kv_gib", 0)) for r, _, b in self._shared if r() is not None]


REGISTRY = EngineRegistry()


# -- RNG --------------------------------------------------------------------------------------
@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Put Python's, NumPy's, torch's and (when present) CUDA's global RNG states back.

    vLLM's worker calls ``set_random_seed(seed)`` (random, numpy, torch, all CUDA devices)
    while an engine is built; exact resume needs the trainer's RNG streams untouched."""
    py = random.getstate()
    npy = np.random.get_state()
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# -- platform (CPU or GPU, as vLLM itself detects it) ----------------------------------------
GIB = 1024**3
CPU_KVCACHE_VAR = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM's CPU platform reads it (integer GiB) from ``os.environ`` at every engine build and
makes it the KV cache size; without it ``gpu_memory_utilization`` is read as a share of
system memory."""
CPU_KVCACHE_SHARE = 0.5
"""The KV caches of one process's CPU engines may take at most this share of the memory."""
CPU_MIN_BATCHED_TOKENS = 4096
"""vLLM's CPU default for ``max_num_batched_tokens`` (``LLM`` class)."""


@dataclass(frozen=True)
class PlatformFacts:
    """What the engine needs to know of vLLM's ``current_platform`` (read in ``vllm.py``)."""

    name: str
    """vLLM's ``device_type``: ``cuda``, ``rocm``, ``cpu``, ``xpu``..."""
    is_cpu: bool
    sleep_available: bool
    """``is_sleep_mode_available()``: CUDA, ROCm, XPU only."""
    dtypes: tuple[str, ...]
    """``supported_dtypes`` as names (``float32``, ``bfloat16``...)."""
    head_sizes: tuple[int, ...] | None = None
    """Attention head sizes the platform's attention backend takes (CPU: CPU_ATTN's
    ``get_supported_head_sizes``); None: not checked here (GPU backends are chosen per model)."""


def platform_sleep_level(requested: int, facts: PlatformFacts) -> tuple[int, str | None]:
    """The sleep level the platform allows, and the one-line reason when it lowers it."""
    if requested and not facts.sleep_available:
        return 0, (
            f"vLLM has no sleep mode on {facts.name} (CUDA, ROCm and XPU only): the engine "
            f"runs at sleep level 0 (engine.vllm_sleep_level={requested} ignored) and keeps "
            f"its memory during training"
        )
    return requested, None


def default_enforce_eager(setting: bool | None, facts: PlatformFacts) -> bool:
    """``engine.vllm_enforce_eager`` unset: eager on CPU (compiling costs ~45 s a build
    there and decoding gains little), CUDA graphs / compilation elsewhere."""
    return facts.is_cpu if setting is None else setting


def model_head_dim(config: Any) -> int | None:
    """A transformers config's attention head size (``head_dim``, else width / heads)."""
    head = getattr(config, "head_dim", None)
    if head:
        return int(head)
    width, heads = (
        getattr(config, "hidden_size", None),
        getattr(config, "num_attention_heads", None),
    )
    return int(width) // int(heads) if width and heads else None


def check_servable(model_name: str, head_dim: int | None, dtype: str, facts: PlatformFacts) -> None:
    """Refuse, when the engine is built, a model the platform's vLLM cannot serve (vLLM
    itself accepts it and fails at the first generate), naming the value and the limits."""
    if dtype not in facts.dtypes:
        raise ConfigError(
            f"engine.vllm_dtype={dtype!r}: vLLM on {facts.name} supports {', '.join(facts.dtypes)}"
        )
    if facts.head_sizes is not None and head_dim is not None and head_dim not in facts.head_sizes:
        raise ConfigError(
            f"{model_name} has attention head size {head_dim}; vLLM's attention on "
            f"{facts.name} supports head sizes {', '.join(map(str, facts.head_sizes))} "
            f"(use backend: hf for this model)"
        )


def cpu_kvcache_gib(setting: int | None, environ: MutableMapping[str, str]) -> int:
    """The KV cache (GiB) of a CPU engine: ``engine.vllm_cpu_kvcache_gb``, else a
    ``VLLM_CPU_KVCACHE_SPACE`` the user set, else 1."""
    if setting is not None:
        return setting
    value = environ.get(CPU_KVCACHE_VAR, "")
    if value:
        try:
            gib = int(value)
        except ValueError:
            raise ConfigError(
                f"{CPU_KVCACHE_VAR}={value!r} must be a whole number of GiB"
            ) from None
        if gib > 0:
            return gib
    return 1


def check_cpu_kvcache_fits(new_gib: int, others_gib: Sequence[int], total_bytes: int) -> None:
    """The KV caches of this process's CPU engines (those built and the new one) must fit in
    ``CPU_KVCACHE_SHARE`` of the machine's memory, leaving room for weights and training."""
    used = sum(others_gib) + new_gib
    limit = CPU_KVCACHE_SHARE * total_bytes / GIB
    if used > limit:
        raise ConfigError(
            f"engine.vllm_cpu_kvcache_gb={new_gib}: this process's vLLM engines would hold "
            f"{used} GiB of KV cache ({sum(others_gib)} GiB in {len(others_gib)} engine(s) "
            f"already built), more than {CPU_KVCACHE_SHARE:.0%} of this machine's "
            f"{total_bytes / GIB:.1f} GiB memory ({limit:.1f} GiB); lower "
            f"engine.vllm_cpu_kvcache_gb"
        )


def cpu_scheduler_kwargs(max_model_len: int) -> dict[str, Any]:
    """Scheduler settings for seeded sampling on CPU: no chunked prefill.

    vLLM's model runner rewinds a seeded request's generator (``set_offset``) when a
    prefill chunk ends before the prompt does, and a CPU ``torch.Generator`` has no
    offset ("CPU Generator does not use offset"). Every request here is seeded, so
    prompts are prefilled whole: chunked prefill off, and a step's token budget at least
    one full context (vLLM requires it then)."""
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(int(max_model_len), CPU_MIN_BATCHED_TOKENS),
    }


def cpu_weight_packing_problem(dtype: str, amx: bool, frozen: bool) -> str | None:
    """Why a trainable CPU engine could not be synced, or None.

    vLLM's CPU linears repack their weights after loading (oneDNN, or sgl-kernel on AMX
    for bf16 / fp16) and drop the ``Parameter`` that ``load_weights`` writes into. oneDNN
    is switched off while a trainable engine is built (``vllm._custom_ops._supports_onednn``);
    the sgl-kernel path has no switch, so those settings are refused."""
    if not frozen and amx and dtype in ("bfloat16", "float16"):
        return (
            f"engine.vllm_dtype={dtype!r} on an AMX CPU: vLLM packs these weights for "
            f"sgl-kernel after loading, so the weight sync cannot write into them; use "
            f"vllm_dtype: float32 for a trainable policy"
        )
    return None
