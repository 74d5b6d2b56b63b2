"""Checkpoints that a crash cannot tear, runs that never cross, resumes that are checked.

- ``SafeCheckpointIO``: a checkpoint is written to a partial file *beside* its target, synced,
  then renamed over it. The rename is atomic on every POSIX filesystem, so the previous
  checkpoint stays complete until the new one is; nothing is staged in ``$TMPDIR`` (Lightning
  stages there and moves, which across filesystems is a copy that a kill can cut short).
  A partial file is removed when the next run sets up only if its writer (the PID in its
  name, ``.NAME.partial-PID``) is this process or no longer alive: a run never deletes the
  in-flight write of another run sharing its run dir. Checked with ``os.kill(pid, 0)``,
  which assumes the writer ran on this host (a run dir shared by several hosts keeps the
  other hosts' partial files, which are only disk space). A failed write (disk full) removes
  its partial file and says so, naming the path; the previous checkpoint is intact.
- ``read_checkpoint``: a checkpoint file read with ``weights_only=True``; an empty,
  truncated, corrupt or not-weights-only file is a one-line ``ConfigError`` naming it.
- Run layout: every ``salvage fit`` invocation is one ``RUN/version_N`` (the CSV logger's
  version) and keeps its checkpoints in ``RUN/version_N/checkpoints/``; ``--ckpt_path last``
  means the newest ``last.ckpt`` of any version of RUN (``find_last_checkpoint``), so a
  resumed run continues from its own history and a second run in the same RUN never
  overwrites or shadows the first one's checkpoints.
- ``RunConfigRecorder`` stores the run's resolved config in every checkpoint
  (``salvage_config``, plain YAML text); a resume compares it with the new config and refuses
  a difference outside ``RESUMABLE_KEYS`` (``config_diff``), naming the keys.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from salvage.errors import ConfigError
from salvage.history import STAGE_FILE, VERSION_DIR, run_versions

PARTIAL = ".partial-"
_CHUNK = 1 << 20

# keys that may change between a run and its resume (dotted, as in the CLI); a key matches
# itself and everything below it
RESUMABLE_KEYS: tuple[str, ...] = (
    "config",
    "ckpt_path",
    "allow_config_change",
    "debug",
    "verbose",
    "print_memory",
    "trainer.max_steps",
    "trainer.max_epochs",
    "trainer.max_time",
    "trainer.logger",
    "trainer.enable_progress_bar",
    "trainer.default_root_dir",
)


def _write_all(fd: int, data: memoryview) -> None:
    for start in range(0, len(data), _CHUNK):
        view = data[start : start + _CHUNK]
        while len(view):
            n = os.write(fd, view)
            view = view[n:]


def write_atomic_bytes(path: str | Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` through a synced partial file beside it and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}{PARTIAL}{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                _write_all(fd, memoryview(data))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        kept = "the previous checkpoint is intact" if path.exists() else "no earlier checkpoint"
        raise CheckpointWriteError(
            f"cannot write checkpoint {path}: {e.strerror or e} ({len(data)} bytes; {kept}, "
            "the partial file is removed); free space and resume with --ckpt_path last"
        ) from e
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


class CheckpointWriteError(ConfigError, OSError):
    """A checkpoint that could not be written (disk full): names the path; nothing is torn."""


def writer_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) is still running."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_partials(directory: str | Path) -> list[Path]:
    """Delete the partial checkpoint files in ``directory`` that this process wrote or whose
    writer is gone (``.NAME.partial-PID``, PID checked on this host); another live run's
    in-flight write stays."""
    d = Path(directory)
    gone = []
    if d.is_dir():
        for p in d.iterdir():
            if not (p.name.startswith(".") and PARTIAL in p.name and p.is_file()):
                continue
            tail = p.name.rsplit(PARTIAL, 1)[1]
            pid = int(tail) if tail.isdigit() else -1
            if pid != os.getpid() and writer_alive(pid):
                continue
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def read_checkpoint(path: str | Path, what: str = "--ckpt_path") -> dict[str, Any]:
    """A checkpoint file (or a distributed checkpoint's ``meta.pt``) loaded with
    ``weights_only=True`` (tensors memory-mapped, not read); a file that cannot be is one
    ``ConfigError`` line naming ``what`` and the path."""
    ckpt = Path(path)
    file = ckpt / "meta.pt" if ckpt.is_dir() else ckpt
    if not file.exists():
        raise ConfigError(f"{what} {ckpt}: no such checkpoint")
    if file.stat().st_size == 0:
        raise ConfigError(
            f"{what} {file}: the checkpoint is empty (0 bytes: a copy or write cut short); "
            "use another checkpoint"
        )
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=file is ckpt)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else "UnpicklingError"
        if "weights only" in str(e).lower() or "weights_only" in str(e):
            raise ConfigError(
                f"{what} {file}: the checkpoint holds objects other than tensors and plain "
                "data, so it cannot be loaded with weights_only=True (salvage never runs "
                "code from a checkpoint)"
            ) from e
        raise ConfigError(f"{what} {file}: not a readable checkpoint ({first})") from e
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as e:
        import zipfile

        if not zipfile.is_zipfile(file):  # torch.save writes a zip; its directory is at the end
            first = f"not a complete zip archive, {file.stat().st_size} bytes"
        else:
            text = " ".join(str(e).split())
            first = text.split(". ")[0][:160] if text else type(e).__name__
        raise ConfigError(
            f"{what} {file}: not a readable checkpoint (truncated or corrupt: {first})"
        ) from e
    if not isinstance(state, dict):
        raise ConfigError(
            f"{what} {file}: holds a {type(state).__name__}, not a Lightning checkpoint (a dict)"
        )
    return state


class SafeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose writes are a partial file beside the target, then a rename."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("SafeCheckpointIO.save_checkpoint takes no storage_options")
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        write_atomic_bytes(path, buf.getbuffer())


def find_last_checkpoint(root: str | Path) -> Path | None:
    """The newest ``last.ckpt`` of run dir ``root``: the highest ``version_N`` holding one.

    A run dir written before per-version checkpoints (``root/checkpoints/last.ckpt``) counts
    as older than every version.
    """
    for v in reversed(run_versions(root)):
        p = v / "checkpoints" / "last.ckpt"
        if p.exists():
            return p
    legacy = Path(root) / "checkpoints" / "last.ckpt"
    return legacy if legacy.exists() else None


def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``{"a.b.c": leaf}``; lists stay leaves (compared whole)."""
    if isinstance(cfg, dict):
        out: dict[str, Any] = {}
        for k, v in cfg.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(flatten(v, key))
            else:
                out[key] = v
        return out
    return {prefix: cfg}


def _resumable(key: str, allowed: Iterable[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allowed)


def config_diff(
    saved: dict[str, Any], current: dict[str, Any], allowed: Iterable[str] = RESUMABLE_KEYS
) -> list[str]:
    """Dotted keys whose values differ between two configs, outside the ``allowed`` keys."""
    a, b = flatten(saved), flatten(current)
    allowed = tuple(allowed)
    return sorted(k for k in set(a) | set(b) if not _resumable(k, allowed) and a.get(k) != b.get(k))


class RunConfigRecorder(L.Callback):
    """Stores the run's resolved config (YAML text) in every checkpoint, for resume checks.

    Args:
        config_yaml: the resolved config as YAML text (the CLI passes it).
    """

    def __init__(self, config_yaml: str) -> None:
        self.config_yaml = config_yaml

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # partial files of a killed run are garbage; the complete checkpoints stay
        for cb in trainer.checkpoint_callbacks:
            dirpath = getattr(cb, "dirpath", None)
            if dirpath and trainer.is_global_zero:
                remove_partials(dirpath)
        root = trainer.default_root_dir
        # every rank: trainer.log_dir is a collective (a broadcast from rank 0); asked on
        # rank 0 alone it paired with the next collective of the others and hung the run
        log_dir = trainer.log_dir if trainer.loggers else None
        if trainer.is_global_zero:
            for v in run_versions(root):
                remove_partials(v / "checkpoints")
            if log_dir and VERSION_DIR.match(Path(log_dir).name):  # what wrote this version
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                name = str(getattr(stage, "value", stage))  # TrainerFn.FITTING -> "fit"
                (Path(log_dir) / STAGE_FILE).write_text(f"{name}\n", encoding="utf-8")

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["salvage_config"] = self.config_yaml
