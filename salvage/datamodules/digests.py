"""Content digests of environment tasks, cached on disk across processes and runs.

The held-out check digests every training and evaluation task's content, and an
environment that must reset and look around to show a task (TextWorld-Express: ~0.2 s a
game) spends seconds on it at each fit's start (64 coin games: 13 s here), in every process
of a study. A digest depends only on the task, the environment's constructor arguments and
what fixes its content function (``ReplayEnv.content_identity``: the engine's version and
the function's own), so it is kept, one small file per task, under
``$SALVAGE_CACHE/task-digests/<env>/`` (default ``~/.cache/salvage``) and read back by any
later process. Environments whose identity is None are not cached. A file that is not a
digest is recomputed and rewritten; a cache that cannot be written is skipped with one
warning. Deleting the directory only costs the recomputation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
_DIGEST = re.compile(r"[0-9a-f]{40}")
_warned: set[str] = set()


def cache_root() -> Path:
    from salvage.models import cache_dir

    return cache_dir() / "task-digests"


def entry_path(env: str, identity: str, kwargs: dict[str, Any], task: dict[str, Any]) -> Path:
    """Where the digest of ``task`` on ``env(**kwargs)`` under ``identity`` is kept."""
    key = json.dumps(
        {"env": env, "identity": identity, "kwargs": kwargs, "task": task},
        sort_keys=True,
        default=str,
    )
    h = hashlib.sha1(key.encode("utf-8", "surrogatepass")).hexdigest()
    return cache_root() / env / h[:2] / h


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text if _DIGEST.fullmatch(text) else None


def _write(path: Path, digest: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(digest + "\n", encoding="ascii")
        os.replace(tmp, path)  # readers see the old file or the whole new one
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # no directory to hold it either
            pass
        if str(path.parents[2]) not in _warned:
            _warned.add(str(path.parents[2]))
            log.warning("task digest cache %s not written (%s); digests are recomputed", path, e)


def cached_digests(
    env: str,
    identity: str | None,
    kwargs: dict[str, Any],
    tasks: Sequence[dict[str, Any]],
    compute: Callable[[list[dict[str, Any]]], list[str]],
) -> list[str]:
    """The digest of each task, from the cache where it holds one, else ``compute(missing)``
    (in order, one digest per task given), which is then stored."""
    if identity is None:
        return compute(list(tasks))
    paths = [entry_path(env, identity, kwargs, t) for t in tasks]
    out = [_read(p) for p in paths]
    missing = [i for i, d in enumerate(out) if d is None]
    if missing:
        fresh = compute([tasks[i] for i in missing])
        if len(fresh) != len(missing):
            raise RuntimeError(f"{len(fresh)} digests for {len(missing)} tasks")
        for i, d in zip(missing, fresh, strict=True):
            out[i] = d
            _write(paths[i], d)
    return [d for d in out if d is not None]
