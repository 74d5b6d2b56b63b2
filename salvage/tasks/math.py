"""Single-turn math RLVR: tasks, data loading and the math-verify reward.

Reward (SPEC §3): 1 if ``math_verify.verify(gold, last \\boxed{} of the response)`` holds,
else 0. A verifier timeout or error scores 0 and is counted, never raised.

Data sources (``MathData.source``):
- ``reasoning_gym:<task>`` — generated offline by reasoning-gym (``size`` rows, ``seed``);
- ``*.jsonl`` — one object per line with a problem field and an answer field (MATH500,
  AIME, AMC layouts), or Minerva's layout where the answer is the last ``\\boxed{}`` of
  ``solution``;
- ``*.parquet`` — verl layout: ``prompt`` (chat messages) and ``reward_model.ground_truth``.
Malformed rows are skipped, counted and the first few reported. A file that cannot be read
at all (not UTF-8, binary, a corrupt parquet) is refused with a ``DataError`` naming it.

Task ids are ``<label>/<row id>``: the row's ``unique_id`` / ``id`` / ``idx`` (else its
position), and the label of its source (the file stem or the reasoning-gym task). Ids are
unique by construction: two rows of one file with the same id are refused (naming the file
and both rows); sources of one split that share a label are told apart by their paths
(``aime/test``, ``amc/test``; ``source_labels``), else by their ``name``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from salvage.core.heldout import in_digest_part, text_digest
from salvage.errors import ConfigError, DataError, MissingFileError
from salvage.io import utf8_text

log = logging.getLogger(__name__)

PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."


@dataclass
class MathTask:
    id: str
    messages: list[dict[str, str]]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    reward: float
    success: bool
    timed_out: bool = False
    error: bool = False


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    key = "\\boxed"
    pos = text.rfind(key)
    while pos != -1:
        i = pos + len(key)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
                j += 1
        pos = text.rfind(key, 0, pos)
    return None


class Reward:
    """A verifiable reward: ``reward(response_text, answer) -> RewardResult``.

    Subclass it to plug another verifier into ``data.reward`` (class_path in YAML).
    """

    timeouts: int = 0
    errors: int = 0

    def __call__(self, response: str, answer: str) -> RewardResult:  # pragma: no cover
        raise NotImplementedError


_GOLD_FAILED = object()
"""Cached in place of a gold answer whose parse timed out or failed."""


def nan_text(text: str) -> bool:
    """Whether an answer reads as NaN (``nan``, ``-NaN``, ``\\text{nan}``, ...)."""
    t = text.strip().replace(" ", "").lower().lstrip("+-")
    return t in ("nan", "\\text{nan}", "\\mathrm{nan}")


def non_finite_text(text: str) -> bool:
    """Whether a gold answer is NaN or a bare infinity as a number is written (``inf``,
    ``Infinity``: JSON's, a float's ``str``); LaTeX ``\\infty`` is a math answer and passes."""
    t = text.strip().replace(" ", "").lower().lstrip("+-")
    return nan_text(text) or t in ("inf", "infinity")


class MathVerifyReward(Reward):
    """Binary reward with math-verify on the last ``\\boxed{}`` answer.

    math-verify enforces its timeout with ``signal.alarm``, which only works in the main
    thread; off the main thread its timeout is disabled and a hung check would hang the
    caller, so this class must be called from the main thread (the datamodule does).
    """

    def __init__(self, timeout_s: int = 5) -> None:
        if timeout_s < 1:
            raise ConfigError(f"reward timeout_s must be >= 1 second, got {timeout_s}")
        self.timeout_s = timeout_s
        self._gold_cache: dict[str, Any] = {}
        self.timeouts = 0
        self.errors = 0

    def _parse(self, latex: str) -> Any:
        from math_verify import parse

        return parse(f"\\boxed{{{latex}}}", parsing_timeout=self.timeout_s, raise_on_error=True)

    def __call__(self, response: str, answer: str) -> RewardResult:
        from math_verify import verify
        from math_verify.errors import TimeoutException

        pred_text = last_boxed(response)
        if pred_text is None or not pred_text.strip() or nan_text(pred_text):
            return RewardResult(0.0, False)  # NaN is never a correct answer
        gold = self._gold_cache.get(answer)
        if gold is _GOLD_FAILED:  # its parse failed once: never retried per response
            self.errors += 1
            return RewardResult(0.0, False, error=True)
        if gold is None:
            try:
                gold = self._gold_cache.setdefault(answer, self._parse(answer))
            except TimeoutException:
                self._gold_cache[answer] = _GOLD_FAILED
                self.timeouts += 1
                log.warning("math-verify timed out parsing the gold answer %r", answer[:80])
                return RewardResult(0.0, False, timed_out=True)
            except Exception as e:  # noqa: BLE001 - a verifier failure scores 0, never crashes
                self._gold_cache[answer] = _GOLD_FAILED
                self.errors += 1
                log.warning("math-verify cannot parse the gold answer %r: %s", answer[:80], e)
                return RewardResult(0.0, False, error=True)
        try:
            pred = self._parse(pred_text)
            ok = bool(verify(gold, pred, timeout_seconds=self.timeout_s, raise_on_error=True))
        except TimeoutException:
            self.timeouts += 1
            return RewardResult(0.0, False, timed_out=True)
        except Exception as e:  # noqa: BLE001 - a verifier failure scores 0, never crashes
            self.errors += 1
            log.debug("math-verify error on %r: %s", pred_text[:80], e)
            return RewardResult(0.0, False, error=True)
        return RewardResult(1.0 if ok else 0.0, ok)


@dataclass
class MathData:
    """Where math tasks come from. Each field is a config key."""

    source: str = "reasoning_gym:basic_arithmetic"
    """``reasoning_gym:<task>``, or a path to a .jsonl / .parquet file."""
    name: str | None = None
    """Benchmark name for per-benchmark metrics (default: the file stem or task name)."""
    size: int = 1000
    """reasoning-gym only: number of generated tasks."""
    seed: int = 0
    """reasoning-gym only: generator seed."""
    limit: int | None = None
    """Keep only the first ``limit`` tasks (a slice for quick runs)."""
    problem_key: str = "problem"
    """The row field holding the problem text (``question`` is tried when it is absent)."""
    answer_key: str = "answer"
    """The row field holding the reference answer (a ``solution``'s last ``\\boxed{}`` otherwise)."""
    add_suffix: bool = True
    """Append SPEC's "Let's think step by step ... \\boxed{}." to problems lacking it."""
    rg_kwargs: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym only: extra generator parameters (e.g. ``min_terms``)."""
    dedupe: bool = True
    """Drop a task whose normalised prompt text repeats an earlier one of the source."""
    split_frac: float | None = None
    """Digest split: keep one part of the distinct prompts, chosen by their content digest
    (``split_part``); the ``heldout`` and ``train`` parts of one pool are disjoint."""
    split_part: str = "train"
    """Digest split part: ``heldout`` (digests in the first ``split_frac`` of the hash
    space) or ``train`` (the rest)."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ConfigError("data source must be set")
        if not self.source.startswith("reasoning_gym:"):
            p = Path(self.source)
            if p.suffix not in (".jsonl", ".parquet"):
                raise ConfigError(
                    f"data source {self.source!r}: expected reasoning_gym:<task>, a .jsonl or a .parquet file"
                )
            if not p.exists():
                raise MissingFileError(f"data source {self.source!r} does not exist")
            if p.is_dir():
                raise ConfigError(
                    f"data source {self.source!r} is a directory; name a .jsonl or .parquet file"
                )
        if self.size < 1:
            raise ConfigError(f"data source {self.source!r}: size must be >= 1, got {self.size}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(
                f"data source {self.source!r}: limit must be >= 1 or null, got {self.limit}"
            )
        if self.split_frac is not None and not 0.0 < self.split_frac < 1.0:
            raise ConfigError(f"data split_frac must be in (0, 1) or null, got {self.split_frac}")
        if self.split_part not in ("train", "heldout"):
            raise ConfigError(
                f"data split_part must be 'train' or 'heldout', got {self.split_part!r}"
            )


def task_digest(task: MathTask) -> str:
    """A math task's content digest: its normalised prompt messages (SPEC's suffix included,
    as the policy sees them)."""
    return text_digest(*(m["content"] for m in task.messages))


def _with_suffix(problem: str, add: bool) -> str:
    problem = problem.strip()
    if add and "\\boxed" not in problem[-200:]:
        return f"{problem} {PROMPT_SUFFIX}"
    return problem


def load_math_tasks(
    data: MathData, label: str | None = None
) -> tuple[list[MathTask], dict[str, Any]]:
    """Tasks plus a report ``{"rows": n, "skipped": k, "duplicates": d, "outside_split": o,
    "examples": [...]}`` (repeated prompts dropped when ``data.dedupe``; a digest split
    keeps only its part).

    ``label``: the task-id prefix (default: ``source_labels([data])[0]``, the file stem or
    the reasoning-gym task name); a split of several sources passes ``source_labels``'s.
    """
    if data.source.startswith("reasoning_gym:"):
        rows = _reasoning_gym_rows(data)
        stem = data.source.split(":", 1)[1]
        where = [f"row {i}" for i in range(len(rows))]
    else:
        path = Path(data.source)
        where, rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
        stem = path.stem
    label = label or stem
    tasks: list[MathTask] = []
    skipped: list[str] = []
    first_seen: dict[str, str] = {}
    seen_digests: set[str] = set()
    duplicates = outside = 0
    bench = data.name or label
    for i, row in enumerate(rows):
        try:
            task = _row_to_task(row, i, label, data)
        except (KeyError, TypeError, ValueError) as e:
            skipped.append(f"{where[i]}: {e}")
            continue
        bad = _bad_text(row, task)
        if bad:
            raise DataError(f"data source {data.source!r}: {where[i]}: {bad}")
        if task.id in first_seen:
            raise DataError(
                f"data source {data.source!r}: {where[i]} repeats the id of {first_seen[task.id]} "
                f"(task id {task.id!r}); task ids must be unique within a file "
                "(fix or drop the id field)"
            )
        first_seen[task.id] = where[i]
        digest = task_digest(task)
        if data.dedupe:
            if digest in seen_digests:
                duplicates += 1
                continue
            seen_digests.add(digest)
        if data.split_frac is not None and not in_digest_part(
            digest, data.split_frac, data.split_part
        ):
            outside += 1
            continue
        task.meta["family"] = bench
        tasks.append(task)
        if data.limit is not None and len(tasks) >= data.limit:
            break
    if skipped:
        log.warning(
            "%s: skipped %d malformed rows; first: %s",
            data.source,
            len(skipped),
            "; ".join(skipped[:3]),
        )
    if not tasks:
        raise DataError(
            f"data source {data.source!r} yielded no usable tasks ({len(skipped)} skipped"
            + (f"; first: {skipped[0]}" if skipped else "")
            + ")"
        )
    if duplicates:
        log.info("%s: dropped %d repeated prompts", data.source, duplicates)
    return tasks, {
        "rows": len(tasks) + len(skipped) + duplicates + outside,
        "skipped": len(skipped),
        "duplicates": duplicates,
        "outside_split": outside,
        "examples": skipped[:3],
    }


def source_labels(sources: list[MathData], key: str = "data") -> list[str]:
    """The task-id prefix of each source of one split, distinct by construction.

    Each source's label is its file stem (or reasoning-gym task name). Files sharing a stem
    get the shortest tail of their path that tells them apart (``aime/test.jsonl`` and
    ``amc/test.jsonl`` -> ``aime/test``, ``amc/test``); sources still alike (the same file
    or reasoning-gym task twice) take their ``name``. Sources that nothing tells apart are
    refused (``key``: the config key named in the error, e.g. ``data.val``).
    """

    def parts(d: MathData) -> tuple[str, ...]:
        if d.source.startswith("reasoning_gym:"):
            return (d.source.split(":", 1)[1],)
        p = Path(d.source).resolve().with_suffix("")
        return p.parts[1:] if p.anchor else p.parts  # no leading "/" in a label

    labels = [parts(d)[-1] for d in sources]
    for label in set(labels):
        same = [i for i, x in enumerate(labels) if x == label]
        if len(same) < 2:
            continue
        longest = max(len(parts(sources[i])) for i in same)
        for k in range(2, longest + 1):
            tails = ["/".join(parts(sources[i])[-k:]) for i in same]
            if len(set(tails)) == len(tails):
                for i, t in zip(same, tails, strict=True):
                    labels[i] = t
                break
        else:
            names = [sources[i].name for i in same]
            if any(n is None for n in names) or len(set(names)) < len(names):
                shown = ", ".join(f"{key}[{i}] ({sources[i].source})" for i in same)
                raise ConfigError(
                    f"{shown} would give the same task ids ({label!r}); give each a distinct `name`"
                )
            for i, n in zip(same, names, strict=True):
                labels[i] = str(n)
    if len(set(labels)) < len(labels):  # a name equal to another source's label
        raise ConfigError(
            f"{key}: the sources' task-id labels {labels} are not distinct; rename them"
        )
    return labels


def _row_to_task(row: Any, i: int, stem: str, data: MathData) -> MathTask:
    if isinstance(row, str):
        raise ValueError(row)  # a line that was not valid JSON
    if not isinstance(row, dict):
        raise TypeError(f"expected an object, got {type(row).__name__}")
    if isinstance(row.get("prompt"), list) and isinstance(row.get("reward_model"), dict):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in row["prompt"]]
        answer = str(row["reward_model"].get("ground_truth") or "").strip()
        meta = {k: row[k] for k in ("level", "type") if k in row}
    else:
        problem = row.get(data.problem_key) or row.get("question")
        if not isinstance(problem, str) or not problem.strip():
            raise ValueError(f"missing {data.problem_key!r}")
        found = row.get(data.answer_key)
        if found is None and isinstance(row.get("solution"), str):
            found = last_boxed(row["solution"])  # Minerva layout
        answer = _answer_text(found)
        messages = [{"role": "user", "content": _with_suffix(problem, data.add_suffix)}]
        meta = {k: row[k] for k in ("level", "subject", "type") if k in row}
    if not answer:
        raise ValueError("empty answer")
    # the first id field present (an id of 0 is an id, not a missing one)
    tid = next((row[k] for k in ("unique_id", "id", "idx") if row.get(k) is not None), i)
    return MathTask(id=f"{stem}/{tid}", messages=messages, answer=answer, meta=meta)


def _bad_text(row: Any, task: MathTask) -> str | None:
    """What makes a parsed row unusable, or None: a lone surrogate (valid JSON, not valid
    Unicode: the tokenizer would fail mid-run) in the prompt or answer, or an answer that is
    NaN or infinite (a response could "match" it)."""
    for what, text in [
        *(("problem", m["content"]) for m in task.messages),
        ("answer", task.answer),
    ]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"the {what} holds a lone surrogate ({text[e.start]!r} at character {e.start}): "
                "not valid Unicode text; fix or drop the row"
            )
    raw = row.get("answer") if isinstance(row, dict) else None
    if (isinstance(raw, float) and not math.isfinite(raw)) or non_finite_text(task.answer):
        return f"the answer is {task.answer!r}, not a finite value a response can match"
    return None


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))  # AMC stores 27.0
    return str(answer).strip()


def _jsonl_rows(path: Path) -> tuple[list[str], list[Any]]:
    """(where each row is, e.g. ``line 3``; the rows); a line that is not JSON is its message."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is allowed
        raw = raw[3:]
    if b"\x00" in raw[:65536]:
        raise DataError(
            f"data source {str(path)!r} is not a text file (it holds NUL bytes: binary, or "
            "UTF-16); save it as UTF-8 JSON lines"
        )
    text = utf8_text(raw, f"data source {str(path)!r}", "; save it as UTF-8 JSON lines")
    where: list[str] = []
    rows: list[Any] = []
    for n, record in enumerate(text.split("\n"), 1):
        if not record.strip():
            continue
        where.append(f"line {n}")
        try:
            rows.append(json.loads(record))
        except json.JSONDecodeError as e:
            rows.append(f"invalid JSON ({e.msg})")  # counted as malformed
    return where, rows


def _parquet_rows(path: Path) -> tuple[list[str], list[Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"data source {str(path)!r} is not a readable parquet file: {first}"
        ) from None
    return [f"row {i}" for i in range(len(rows))], rows


def _reasoning_gym_rows(data: MathData) -> list[dict[str, Any]]:
    try:
        import reasoning_gym
    except ImportError as e:
        raise RuntimeError(
            "reasoning_gym:<task> sources need the reasoning-gym package (pip install reasoning-gym)"
        ) from e
    name = data.source.split(":", 1)[1]
    try:
        ds = reasoning_gym.create_dataset(name, seed=data.seed, size=data.size, **data.rg_kwargs)
    except Exception as e:
        raise ConfigError(f"data source {data.source!r}: reasoning-gym cannot build it: {e}") from e
    return [
        {"id": f"{data.seed}-{i}", "problem": e["question"], "answer": e["answer"]}
        for i, e in enumerate(ds)
    ]
