"""Errors a user can fix: each message is one line naming the file or key and what is wrong.

``salvage`` (the console script) prints a ``SalvageError`` as ``salvage: error: <message>``
and exits with status 2, without a traceback; ``--debug`` anywhere on the command line
shows the traceback instead. Both classes are also ``ValueError``s, so code catching
those keeps working.
"""

from __future__ import annotations


class SalvageError(Exception):
    """A problem with the user's input (config, data file, model path), stated in one line."""


class ConfigError(SalvageError, ValueError):
    """A config value that cannot work (names the key and the value)."""


class DataError(SalvageError, ValueError):
    """A data file that cannot be read or holds something impossible (names the file)."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file or directory the config names does not exist (names the key and the path)."""


def in_chain(exc: BaseException, cls: type[BaseException]) -> BaseException | None:
    """The first ``cls`` among ``exc`` and the causes and contexts behind it, if any."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, cls):
            return e
        todo += [e.__cause__, e.__context__]
    return None


def user_error(exc: BaseException) -> SalvageError | None:
    """The ``SalvageError`` behind ``exc`` (itself, or a cause or context a library such as
    jsonargparse wrapped it in), if any."""
    found = in_chain(exc, SalvageError)
    return found if isinstance(found, SalvageError) else None
