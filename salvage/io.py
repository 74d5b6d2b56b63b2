"""File I/O shared by the shell: writes a crash cannot leave half-done, text decoding that
names the file and line on bad input."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from salvage.errors import DataError


def _umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, then put it back at once
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str, newline: str | None = None) -> None:
    """Write ``text`` to a temporary beside ``path``, fsync, then rename it over ``path``.

    A crash at any moment leaves either the previous file or the new one, never a torn one.
    The file keeps the mode of the one it replaces; a new file gets the mode ``open()``
    would give it (0666 less the umask), not the temporary's private 0600.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline=newline) as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def utf8_text(raw: bytes, what: str, hint: str = "") -> str:
    """``raw`` decoded as UTF-8; a ``DataError`` naming ``what`` (e.g. "metrics file 'x'"),
    the offending byte and its line otherwise (``hint``: appended, e.g. how to fix it)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line}){hint}"
        ) from None
