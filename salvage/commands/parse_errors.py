"""jsonargparse's parse errors as one line: the key as the user types it, the value, the reason,
and for an unknown key the nearest valid ones.

jsonargparse prints its usage text (50-70 lines) with the reason at the bottom, nested through
every union member it tried (``Parser key "model": ... Problem with given class_path ... Parser
key "lr": Expected a <class 'float'>. Got value: fast``). ``one_line`` reads that message; it
imports nothing heavy and is pure apart from ``class_keys`` (which imports the named class to
read its constructor's parameters, for the nearest-key hint).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Callable, Iterable

_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS = re.compile(r"^- Problem with given class_path '([^']+)':$")
_NOT_ACCEPTED = re.compile(r"^Option '([^']+)' is not accepted")
_NESTED = re.compile(r"NestedArg\(key='([^']*)', val='([^']*)'\)")
_EXPECTED = re.compile(r"^Expected a <class '([^']+)'>\. Got value: (.*)$")
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.+)$")
_TYPE = re.compile(r"<class '(?:[\w.]+\.)?([\w]+)'>")

_SKIP = (
    "Does not validate",
    "Subtypes:",
    "Errors:",
    "- Expected a <class 'NoneType'>",
    "Given value",
)
HINT = "--help for the keys, --debug for the parser's full message"


def class_keys(class_path: str) -> list[str]:
    """The constructor parameters of ``class_path`` (its ``init_args`` keys); [] if it cannot
    be imported."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        params = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return []
    return [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _nearest(word: str, candidates: Iterable[str], prefix: str = "") -> str:
    found = difflib.get_close_matches(word, list(candidates), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(prefix + f for f in found)}?)" if found else ""


def _value(raw: str) -> str:
    if raw.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return f"{raw!r} (not a finite number)"
    return repr(raw)


def one_line(
    message: str,
    options: Iterable[str] = (),
    keys_of: Callable[[str], list[str]] = class_keys,
) -> str:
    """The reason of a jsonargparse ``message``, one line, naming the key as typed on the
    command line (``model.init_args.lr``). ``options``: the parser's option strings (for an
    unrecognized ``--trainer.x``); ``keys_of``: a class path's valid keys (for an unknown
    ``init_args`` key)."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    m = _UNRECOGNIZED.search(" ".join(lines))
    if m:
        args = m.group(1).split()
        flags = [a for a in args if a.startswith("-")] or args[:1]
        flag = flags[0].split("=", 1)[0]
        near = _nearest(flag.lstrip("-"), [o[2:] for o in options if o.startswith("--")])
        return f"unknown key {flag.lstrip('-')} (in: {' '.join(args)}){near}; {HINT}"
    path: list[str] = []
    last_class = None
    reason = None
    for i, ln in enumerate(lines):
        if k := _KEY.match(ln):
            if len(path) == 1 and last_class is not None:  # model -> model.init_args.lr
                path.append("init_args")
            path.extend(k.group(1).split("."))
            continue
        if c := _CLASS.match(ln):
            last_class = c.group(1)
            continue
        if ln.startswith(_SKIP):
            continue
        if o := _NOT_ACCEPTED.match(ln):
            key = o.group(1)
            val = next((v for k2, v in _NESTED.findall(" ".join(lines[i:])) if k2 == key), None)
            where = [*path, "init_args"] if len(path) == 1 and last_class else path
            prefix = ".".join(where) + "." if where else ""
            shown = prefix + key
            near = _nearest(key, keys_of(last_class) if last_class else [], prefix)
            given = f" (value {val!r})" if val is not None else ""
            return f"unknown key {shown}{given}{near}; {HINT}"
        if e := _EXPECTED.match(ln):
            reason = f"expected a {e.group(1)}, got {_value(e.group(2))}"
            break
        reason = _TYPE.sub(r"\1", ln)
        break
    key = ".".join(path) if path else None
    if reason is None:
        reason = _TYPE.sub(r"\1", lines[-1]) if lines else "could not parse the arguments"
    return f"{key}: {reason}; {HINT}" if key else f"{reason}; {HINT}"
