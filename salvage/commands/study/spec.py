"""The study file of ``salvage study``: parsed, checked, and planned into runs.

``load_study`` reads a study YAML (every error names the file, the key and the value) into
a ``Study``; ``plan`` gives its (method, seed) runs, ``calibration_runs`` the regime's
calibration runs, each a ``Run`` with its ``salvage fit`` arguments. The file format is
documented in ``salvage.commands.study`` (``salvage study --help``).
"""

from __future__ import annotations

import json
import math
import operator
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from salvage.errors import ConfigError, MissingFileError

DEFAULT_SEED_KEYS = ("seed_everything", "data.init_args.seed", "model.init_args.seed")
STUDY_KEYS = {
    "name",
    "base",
    "baseline",
    "seeds",
    "overrides",
    "methods",
    "seed_keys",
    "ray_resources",
    "prepare",
    "order",
    "regime",
}
REGIME_KEYS = {"method", "seed", "overrides", "criteria"}
STATS = ("mean", "min", "max", "last", "gain")
"""``gain``: the mean of the last ``k`` logged updates in ``steps`` minus the mean of the
first ``k`` (the learning criterion: does the baseline's training success rise?)."""
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
CALIBRATION_DIR = "_calibration"
METHOD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A method name: its run dirs are ``STUDY_DIR/<name>/seed<k>``, so never a path."""


@dataclass
class Study:
    """A parsed study: resolved config paths and override tokens per method."""

    name: str
    file: Path
    base: list[Path]
    methods: dict[str, tuple[list[Path], list[str]]]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)
    baseline: str | None = None
    seed_keys: tuple[str, ...] = DEFAULT_SEED_KEYS
    ray_resources: dict[str, float] | None = None
    prepare: list[tuple[Path, list[str]]] = field(default_factory=list)
    """Set-up steps before the runs: (path the step creates, ``salvage`` arguments)."""
    order: str = "methods"
    """Run order: ``methods`` (each method's seeds in turn) or ``seeds`` (every method of a
    seed before the next seed: a study stopped part-way holds whole paired seeds)."""
    regime: Regime | None = None
    """Criteria a calibration run must meet before any record run starts."""


@dataclass(frozen=True)
class Criterion:
    """One regime criterion: ``stat`` of ``metric`` over updates ``steps`` ``op`` ``threshold``."""

    metric: str
    op: str
    threshold: float
    stat: str = "mean"
    steps: tuple[int, int] | None = None
    """1-based update indices, inclusive; None: every logged update."""
    method: str | None = None
    """The method whose calibration run it is measured on; None: the regime's ``method``."""
    k: int | None = None
    """``stat: gain`` only: how many updates each end's mean is over."""

    def describe(self) -> str:
        where = f" over updates {self.steps[0]}-{self.steps[1]}" if self.steps else ""
        who = f"{self.method}: " if self.method else ""
        stat = f"gain (last {self.k} - first {self.k})" if self.stat == "gain" else self.stat
        return f"{who}{stat} {self.metric}{where} {self.op} {self.threshold:g}"


@dataclass
class Regime:
    """The study's ``regime:`` block, resolved: the calibration's method, seed and overrides."""

    method: str
    seed: int
    overrides: list[str]
    criteria: list[Criterion]

    @property
    def methods(self) -> list[str]:
        """The calibrated methods: the regime's, then those criteria name, in order."""
        out = [self.method]
        for c in self.criteria:
            if c.method is not None and c.method not in out:
                out.append(c.method)
        return out


@dataclass
class Run:
    """One (method, seed) run: its dir and the ``salvage fit`` arguments (without resume)."""

    method: str
    seed: int
    dir: Path
    args: list[str]
    calibration: bool = False
    """The regime's calibration run (``STUDY_DIR/_calibration/<method>/seed<k>``)."""

    @property
    def label(self) -> str:
        return f"{'calibration ' if self.calibration else ''}{self.method} seed {self.seed}"

    @property
    def done(self) -> bool:
        return (self.dir / "done.json").is_file()

    def has_checkpoint(self) -> bool:
        """A ``last.ckpt`` anywhere under the run dir (per run dir or per logger version)."""
        return self.dir.is_dir() and any(self.dir.glob("**/last.ckpt"))

    def command(self) -> list[str]:
        """The command for this call: resumes through ``--ckpt_path last`` when it can."""
        resume = ["--ckpt_path", "last"] if self.has_checkpoint() else []
        return [sys.executable, "-m", "salvage", "fit", *self.args, *resume]


def _err(file: Path, key: str, value: Any, why: str) -> ValueError:
    return ConfigError(f"{file}: {key}={value!r} {why}")


def _path(file: Path, key: str, value: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise _err(file, key, value, "must be a path to a config file")
    p = Path(value)
    if p.is_absolute():
        cands = [p]
    else:
        cands = [file.parent / p, Path.cwd() / p]
    for c in cands:
        if c.is_file():
            return c.resolve()
    raise _err(
        file,
        key,
        value,
        "is not a file (looked relative to the study file's folder, then the current directory)",
    )


def _value_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _override_tokens(file: Path, key: str, item: Any) -> list[str]:
    """``{dotted.key: value}`` or ``"--key value ..."`` -> CLI tokens."""
    if isinstance(item, dict):
        out = []
        for k, v in item.items():
            if not isinstance(k, str) or not k or k.startswith("-"):
                raise _err(file, key, k, "must be a dotted config key without dashes")
            out += [f"--{k}", _value_text(v)]
        return out
    if isinstance(item, str) and item.startswith("--"):
        return shlex.split(item)
    raise _err(file, key, item, "must be a {dotted.key: value} mapping or a '--key value' string")


def _read_spec(path: str | Path) -> dict[str, Any]:
    """The study file's top-level mapping: UTF-8 YAML, only study keys."""
    file = Path(path)
    if not file.is_file():
        raise MissingFileError(f"study file {str(path)!r} does not exist")
    try:
        spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"study file {str(file)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at "
            f"offset {e.start})"
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"study file {str(file)!r} is not valid YAML: {what}{where}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{file}: a study file must be a YAML mapping, got {type(spec).__name__}")
    unknown = sorted(set(spec) - STUDY_KEYS)
    if unknown:
        raise _err(file, unknown[0], spec[unknown[0]], f"is not a study key ({sorted(STUDY_KEYS)})")
    return spec


def _seeds(file: Path, seeds: Any) -> list[int]:
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise _err(file, "seeds", seeds, "must be a non-empty list of distinct integers")
    return list(seeds)


def _methods(file: Path, raw: Any) -> dict[str, tuple[list[Path], list[str]]]:
    """``methods:``: name -> (config fragments, override tokens)."""
    if not isinstance(raw, dict) or not raw:
        raise _err(file, "methods", raw, "must be a non-empty mapping name -> list")
    methods: dict[str, tuple[list[Path], list[str]]] = {}
    for m, items in raw.items():
        key = f"methods.{m}"
        if not isinstance(m, str) or not METHOD_NAME.fullmatch(m):
            raise _err(
                file,
                "methods",
                m,
                "method names must be plain names: letters, digits, '_', '.', '-', not "
                "starting with '.' or '-' (a run dir is STUDY_DIR/<method>/seed<k>)",
            )
        items = items or []
        if isinstance(items, (str, dict)):
            items = [items]
        if not isinstance(items, list):
            raise _err(file, key, items, "must be a list of config paths and overrides")
        configs, toks = [], []
        for it in items:
            if isinstance(it, str) and not it.startswith("--"):
                configs.append(_path(file, key, it))
            else:
                toks += _override_tokens(file, key, it)
        methods[m] = (configs, toks)
    return methods


def _prepare(file: Path, raw: Any) -> list[tuple[Path, list[str]]]:
    """``prepare:``: (the path a step creates, its ``salvage`` arguments) per step."""
    prepare = []
    for i, step in enumerate(raw or []):
        key = f"prepare[{i}]"
        if not (isinstance(step, dict) and set(step) == {"creates", "run"}):
            raise _err(file, key, step, "must be a mapping with exactly 'creates' and 'run'")
        cmd = step["run"]
        args = shlex.split(cmd) if isinstance(cmd, str) else cmd
        if not (isinstance(args, list) and args and all(isinstance(a, str) for a in args)):
            raise _err(file, f"{key}.run", cmd, "must be salvage arguments (a string or a list)")
        if not isinstance(step["creates"], str) or not step["creates"]:
            raise _err(file, f"{key}.creates", step["creates"], "must be a path")
        prepare.append((Path(step["creates"]), list(args)))
    return prepare


def load_study(path: str | Path) -> Study:
    """Parse and check a study file; every error names the file, the key and the value."""
    file = Path(path)
    spec = _read_spec(path)
    name = spec.get("name", file.stem)
    if not isinstance(name, str) or not METHOD_NAME.fullmatch(name):
        raise _err(
            file,
            "name",
            name,
            "must be a plain name: letters, digits, '_', '.', '-', not starting with '.' or '-' "
            "(the default study dir is runs/studies/<name>)",
        )
    base_raw = spec.get("base")
    if base_raw is None:
        raise _err(file, "base", base_raw, "is required (a config path or a list of them)")
    base_list = base_raw if isinstance(base_raw, list) else [base_raw]
    base = [_path(file, "base", b) for b in base_list]
    seeds = _seeds(file, spec.get("seeds"))
    overrides = _overrides(file, "overrides", spec.get("overrides"))
    methods = _methods(file, spec.get("methods"))
    baseline = spec.get("baseline")
    if baseline is not None and baseline not in methods:
        raise _err(file, "baseline", baseline, f"is not one of the methods {sorted(methods)}")
    seed_keys = spec.get("seed_keys", list(DEFAULT_SEED_KEYS))
    if not isinstance(seed_keys, list) or not all(isinstance(k, str) and k for k in seed_keys):
        raise _err(file, "seed_keys", seed_keys, "must be a list of dotted config keys")
    res = spec.get("ray_resources")
    if res is not None and not (
        isinstance(res, dict) and all(isinstance(v, (int, float)) for v in res.values())
    ):
        raise _err(file, "ray_resources", res, "must be a mapping name -> number")
    prepare = _prepare(file, spec.get("prepare"))
    order = spec.get("order", "methods")
    if order not in ("methods", "seeds"):
        raise _err(file, "order", order, "must be 'methods' or 'seeds'")
    return Study(
        order=order,
        name=name,
        file=file.resolve(),
        base=base,
        methods=methods,
        seeds=seeds,
        overrides=overrides,
        baseline=baseline,
        seed_keys=tuple(seed_keys),
        ray_resources=res,
        prepare=prepare,
        regime=_regime(file, spec.get("regime"), methods, baseline, seeds),
    )


def _overrides(file: Path, key: str, raw: Any) -> list[str]:
    """A mapping, or a list of mappings and ``--key value`` strings -> CLI tokens."""
    items = [raw] if isinstance(raw, dict) else (raw or [])
    if not isinstance(items, list):
        raise _err(file, key, raw, "must be a mapping or a list")
    return [t for it in items for t in _override_tokens(file, key, it)]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _regime(
    file: Path, raw: Any, methods: dict[str, Any], baseline: str | None, seeds: list[int]
) -> Regime | None:
    """The ``regime:`` block, checked; errors name the file, the key and the value."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _err(file, "regime", raw, "must be a mapping with criteria (method, seed, overrides)")
    unknown = sorted(set(raw) - REGIME_KEYS, key=str)
    if unknown:
        raise _err(
            file,
            f"regime.{unknown[0]}",
            raw[unknown[0]],
            f"is not a regime key {sorted(REGIME_KEYS)}",
        )
    method = raw.get("method", baseline if baseline is not None else next(iter(methods)))
    if method not in methods:
        raise _err(file, "regime.method", method, f"is not one of the methods {sorted(methods)}")
    seed = raw.get("seed", seeds[0])
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _err(file, "regime.seed", seed, "must be an integer")
    overrides = _overrides(file, "regime.overrides", raw.get("overrides"))
    crit_raw = raw.get("criteria")
    if not isinstance(crit_raw, list) or not crit_raw:
        raise _err(file, "regime.criteria", crit_raw, "must be a non-empty list of criteria")
    criteria = [
        _criterion(file, f"regime.criteria[{i}]", c, methods, method)
        for i, c in enumerate(crit_raw)
    ]
    return Regime(method, seed, overrides, criteria)


def _criterion(file: Path, key: str, c: Any, methods: dict[str, Any], method: str) -> Criterion:
    """One item of ``regime.criteria`` (``key``), checked; ``method``: the regime's."""
    if not isinstance(c, dict):
        raise _err(file, key, c, "must be a mapping {metric: NAME, '>=': NUMBER, ...}")
    extra = sorted(set(c) - {"metric", "steps", "stat", "method", "k"} - set(COMPARISONS), key=str)
    if extra:
        raise _err(
            file,
            f"{key}[{extra[0]!r}]",
            c[extra[0]],
            "is not a criterion key (metric, steps, stat, k, method, and one of >=, <=, >, <)",
        )
    c_method = c.get("method")
    if c_method is not None and c_method not in methods:
        raise _err(file, f"{key}.method", c_method, f"is not one of the methods {sorted(methods)}")
    metric = c.get("metric")
    if not isinstance(metric, str) or not metric:
        raise _err(file, f"{key}.metric", metric, "must be a metric name (a metrics.csv column)")
    ops = [k for k in COMPARISONS if k in c]
    if len(ops) != 1:
        raise _err(
            file, key, c, f"needs exactly one comparison key of >=, <=, >, < (has {ops or 'none'})"
        )
    op = ops[0]
    if not _number(c[op]):
        raise _err(file, f"{key}[{op!r}]", c[op], "must be a finite number")
    stat = c.get("stat", "mean")
    if stat not in STATS:
        raise _err(file, f"{key}.stat", stat, f"must be one of {', '.join(STATS)}")
    steps = _steps(file, f"{key}.steps", c.get("steps"))
    k = c.get("k")
    if stat == "gain":
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise _err(file, f"{key}.k", k, "must be an integer >= 1 for stat: gain")
        if steps is not None and steps[1] - steps[0] + 1 < 2 * k:
            raise _err(
                file, f"{key}.k", k, f"needs 2k <= the updates in steps {list(steps)} (no overlap)"
            )
    elif k is not None:
        raise _err(file, f"{key}.k", k, f"is for stat: gain only (stat is {stat!r})")
    return Criterion(
        metric,
        op,
        float(c[op]),
        stat,
        steps,
        None if c_method in (None, method) else c_method,
        k,
    )


def _steps(file: Path, key: str, steps: Any) -> tuple[int, int] | None:
    """A criterion's ``steps: [first, last]`` (1-based update indices); None: every update."""
    if steps is None:
        return None
    if not (
        isinstance(steps, list)
        and len(steps) == 2
        and all(isinstance(k, int) and not isinstance(k, bool) for k in steps)
        and 1 <= steps[0] <= steps[1]
    ):
        raise _err(file, key, steps, "must be [first, last] update indices, 1 <= first <= last")
    return steps[0], steps[1]


def _fit_args(study: Study, method: str, seed: int, d: Path, extra: list[str]) -> list[str]:
    configs, toks = study.methods[method]
    args = [a for c in study.base for a in ("--config", str(c))] + study.overrides
    args += [a for c in configs for a in ("--config", str(c))] + toks
    for k in study.seed_keys:
        args += [f"--{k}", str(seed)]
    return [*args, *extra, "--trainer.default_root_dir", str(d)]


def plan(study: Study, out: Path) -> list[Run]:
    """Every (method, seed) run of the study: methods in file order, then seeds (``order:
    seeds``: seeds in file order, then methods)."""
    runs = []
    pairs = [(m, s) for m in study.methods for s in study.seeds]
    if study.order == "seeds":
        pairs = [(m, s) for s in study.seeds for m in study.methods]
    for m, s in pairs:
        d = out / m / f"seed{s}"
        runs.append(Run(m, s, d, _fit_args(study, m, s, d, [])))
    return runs


def calibration_runs(study: Study, out: Path) -> list[Run]:
    """The regime's calibration runs, one per calibrated method (``Regime.methods``): the
    method's run of the seed, plus the regime's overrides, in
    ``STUDY_DIR/_calibration/<method>/seed<k>``; none without a regime."""
    if study.regime is None:
        return []
    s = study.regime.seed
    runs = []
    for m in study.regime.methods:
        d = out / CALIBRATION_DIR / m / f"seed{s}"
        runs.append(
            Run(m, s, d, _fit_args(study, m, s, d, study.regime.overrides), calibration=True)
        )
    return runs
