"""Single-turn math RLVR: tasks, data loading and the math-verify reward.

Reward (SPEC §3): 1 if ``math_verify.verify(gold, last \\boxed{} of the response)`` holds,
else 0. A verifier timeout or error scores 0 and is counted, never raised.

Data sources (``MathData.source``):
- ``reasoning_gym:<task>`` — generated offline by reasoning-gym (``size`` rows, ``seed``);
- ``*.jsonl`` — one object per line with a problem field and an answer field (MATH500,
  AIME, AMC layouts), or Minerva's layout where the answer is the last ``\\boxed{}`` of
  ``solution``;
- ``*.parquet`` — verl layout: ``prompt`` (chat messages) and ``reward_model.ground_truth``.
Malformed rows are skipped, counted and the first few reported.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class MathVerifyReward(Reward):
    """Binary reward with math-verify on the last ``\\boxed{}`` answer.

    math-verify enforces its timeout with ``signal.alarm``, which only works in the main
    thread; off the main thread its timeout is disabled and a hung check would hang the
    caller, so this class must be called from the main thread (the datamodule does).
    """

    def __init__(self, timeout_s: int = 5) -> None:
        if timeout_s < 1:
            raise ValueError(f"reward timeout_s must be >= 1 second, got {timeout_s}")
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
        if pred_text is None or not pred_text.strip():
            return RewardResult(0.0, False)
        try:
            gold = self._gold_cache.get(answer)
            if gold is None:
                gold = self._gold_cache.setdefault(answer, self._parse(answer))
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
    answer_key: str = "answer"
    add_suffix: bool = True
    """Append SPEC's "Let's think step by step ... \\boxed{}." to problems lacking it."""
    rg_kwargs: dict[str, Any] = field(default_factory=dict)
    """reasoning-gym only: extra generator parameters (e.g. ``min_terms``)."""

    def __post_init__(self) -> None:
        if not self.source:
            raise ValueError("data source must be set")
        if not self.source.startswith("reasoning_gym:"):
            p = Path(self.source)
            if p.suffix not in (".jsonl", ".parquet"):
                raise ValueError(
                    f"data source {self.source!r}: expected reasoning_gym:<task>, a .jsonl or a .parquet file"
                )
            if not p.exists():
                raise FileNotFoundError(f"data source {self.source!r} does not exist")
        if self.size < 1:
            raise ValueError(f"data size must be >= 1, got {self.size}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"data limit must be >= 1 or null, got {self.limit}")


def _with_suffix(problem: str, add: bool) -> str:
    problem = problem.strip()
    if add and "\\boxed" not in problem[-200:]:
        return f"{problem} {PROMPT_SUFFIX}"
    return problem


def load_math_tasks(data: MathData) -> tuple[list[MathTask], dict[str, Any]]:
    """Tasks plus a report ``{"rows": n, "skipped": k, "examples": [...]}``."""
    if data.source.startswith("reasoning_gym:"):
        rows = _reasoning_gym_rows(data)
        stem = data.source.split(":", 1)[1]
    else:
        path = Path(data.source)
        rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
        stem = path.stem
    tasks: list[MathTask] = []
    skipped: list[str] = []
    bench = data.name or stem
    for i, row in enumerate(rows):
        try:
            tasks.append(_row_to_task(row, i, stem, data))
            tasks[-1].meta["family"] = bench
        except (KeyError, TypeError, ValueError) as e:
            skipped.append(f"row {i}: {e}")
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
        raise ValueError(
            f"data source {data.source!r} yielded no usable tasks ({len(skipped)} skipped)"
        )
    return tasks, {
        "rows": len(tasks) + len(skipped),
        "skipped": len(skipped),
        "examples": skipped[:3],
    }


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
        answer = row.get(data.answer_key)
        if answer is None and isinstance(row.get("solution"), str):
            answer = last_boxed(row["solution"])  # Minerva layout
        answer = _answer_text(answer)
        messages = [{"role": "user", "content": _with_suffix(problem, data.add_suffix)}]
        meta = {k: row[k] for k in ("level", "subject", "type") if k in row}
    if not answer:
        raise ValueError("empty answer")
    tid = row.get("unique_id") or row.get("id") or row.get("idx")
    return MathTask(
        id=f"{stem}/{tid if tid is not None else i}", messages=messages, answer=answer, meta=meta
    )


def _answer_text(answer: Any) -> str:
    if answer is None:
        return ""
    if isinstance(answer, float) and answer.is_integer():
        return str(int(answer))  # AMC stores 27.0
    return str(answer).strip()


def _jsonl_rows(path: Path) -> list[Any]:
    rows: list[Any] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                rows.append(f"line {n}: invalid JSON ({e.msg})")  # counted as malformed
    return rows


def _parquet_rows(path: Path) -> list[Any]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


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
        raise ValueError(f"data source {data.source!r}: reasoning-gym cannot build it: {e}") from e
    return [
        {"id": f"{data.seed}-{i}", "problem": e["question"], "answer": e["answer"]}
        for i, e in enumerate(ds)
    ]
