"""What the vLLM engine needs around vLLM itself: the supported import, the platform's
facts, the weight stream, and the temporary checkpoints vLLM builds a built-in model from
(removed when the engine closes, at exit, before a hard exit, and by the next build when
the process that wrote one is gone)."""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from salvage.rollout.config import on_hard_exit
from salvage.rollout.vllm_rules import PlatformFacts, check_vllm_version


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


_OWNED_DIRS: list[Path] = []


def _remove_owned_dirs() -> None:
    for d in _OWNED_DIRS:
        shutil.rmtree(d, ignore_errors=True)
    _OWNED_DIRS.clear()


def remove_owned_dir(d: Path) -> None:
    """Remove one engine's dir once that engine is shut down (its rendezvous is done with)."""
    shutil.rmtree(d, ignore_errors=True)
    if d in _OWNED_DIRS:
        _OWNED_DIRS.remove(d)


atexit.register(_remove_owned_dirs)
on_hard_exit(_remove_owned_dirs)


@contextlib.contextmanager
def owned_tempdir(tmp: str | None = None) -> Iterator[Path]:
    """While an engine is built, vLLM's own temporary files go in a dir named for this
    process: its FileStore rendezvous (``vllm_dist_<hex>``, made in
    ``tempfile.gettempdir()`` by ``get_file_store_init_method``) would otherwise outlive a
    ``kill -9`` in ``$TMPDIR``. The dir (``salvage-vllm-<pid>-tmp-*``) is removed when its
    engine shuts down (``remove_owned_dir``), at exit, before a hard exit, and by the next
    build's sweep once its process is gone; ``TMPDIR``
    and ``tempfile.tempdir`` are put back after the build."""
    env_before, cached_before = os.environ.get("TMPDIR"), tempfile.tempdir
    base = tmp or tempfile.gettempdir()
    sweep_stale_checkpoints(base)
    d = Path(tempfile.mkdtemp(prefix=f"{SOURCE_PREFIX}{os.getpid()}-tmp-", dir=base))
    _OWNED_DIRS.append(d)
    os.environ["TMPDIR"] = str(d)
    tempfile.tempdir = str(d)
    try:
        yield d
    finally:
        tempfile.tempdir = cached_before
        if env_before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env_before


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
