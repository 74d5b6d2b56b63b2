"""``salvage study STUDY.yaml``: every (method, seed) of a study as its own ``salvage fit`` run.

A study file::

    # salvage study studies/example.yaml
    name: example                 # default: the file's stem
    base: configs/vhgpo/twx_tiny.yaml   # one config or a list, passed first as --config
    baseline: grpo                # the method `salvage compare` compares against
    seeds: [0, 1, 2]
    overrides:                    # common to every method: {dotted.key: value} or "--key value"
      trainer.max_steps: 40
      trainer.val_check_interval: 10
      trainer.check_val_every_n_epoch: null
    methods:                      # name -> list of config fragments and/or overrides
      grpo: [configs/vhgpo/ablations/grpo_baseline.yaml]
      vhgpo: []
      no_pair:
        - {model.init_args.lambda_pair: 0}
        - "--model.init_args.beta 0.2"
    seed_keys: [seed_everything, data.init_args.seed, model.init_args.seed]  # the default
    order: seeds                  # run every method of seed 0, then of seed 1, ... (default: methods)
    ray_resources: {num_gpus: 1, num_cpus: 4}    # optional, --backend ray only
    prepare:                      # optional set-up before the runs (e.g. a shared warm start):
      - creates: runs/warmstart/x_policy        # skipped when this path exists
        run: fit --config configs/... --config studies/warmstart/x.yaml   # salvage arguments
      - creates: runs/warmstart/x_policy
        run: export runs/warmstart/x runs/warmstart/x_policy
    regime:                       # optional: criteria a short calibration run must meet
      method: grpo                # whose run it calibrates (default: the baseline, else the first)
      seed: 0                     # default: the first seed
      overrides: {trainer.max_steps: 3}   # on top of that run's arguments (mapping or strings)
      criteria:                   # metric: a metrics.csv column; one of ">=", "<=", ">", "<"
        - {metric: rollout/zero_signal_frac, steps: [1, 3], stat: mean, ">=": 0.6}
        - {metric: graft/admitted_frac, stat: last, ">=": 0.3}
        - {method: vhgpo, metric: relay/retained, stat: mean, ">=": 0.5}   # another method's run

Method names are plain names (letters, digits, ``_ . -``, not starting with ``.`` or ``-``).
Paths (``base`` and fragments): absolute, or relative to the study file's folder if the file
is there, else relative to the current directory. A mapping item's values are passed as
YAML text (lists and mappings as JSON). Each run gets, in this order (later wins):
``--config`` for each base config, the common overrides, ``--config`` for each of the
method's fragments, the method's overrides, then ``--<key> k`` for every seed key and
``--trainer.default_root_dir STUDY_DIR/<method>/seed<k>``; so a method's own switches win
over the common settings (e.g. a budget-matched baseline's ``group_size``).
The seed reaches the sampling streams through ``data.init_args.seed`` and the minibatch
order through ``model.init_args.seed`` (``seed_everything`` alone does not change them);
task sets (``data.init_args.train.seed``) and model initialisations stay those of the config.

Regime checks: with a ``regime:`` block, before any record run starts, the study runs the
calibration, the method's run for that seed plus the regime's overrides (they come after the
seed keys), in ``STUDY_DIR/_calibration/<method>/seed<k>`` (like any run: resumable,
``done.json``, reused on later calls), then evaluates each criterion on its metrics.csv
(all ``version_*``, later versions winning): ``stat`` (``mean``, the default; ``min``,
``max``, ``last``) of the metric over the updates ``steps: [first, last]`` (1-based,
inclusive; default every logged update) compared with the threshold. Update k is the
``step`` value k - 1 of metrics.csv (Lightning logs update k, and the validation after it, at
step k - 1), one value per update. A criterion with its own ``method`` is measured on that
method's calibration run (same seed and overrides; every calibrated method runs, in
parallel). It prints a table (metric, value, threshold,
pass/FAIL) and writes ``STUDY_DIR/regime.json`` (the values, pass/fail, the calibration's
command, when checked). When a criterion fails, or names a metric the calibration did not log
(the failure lists the logged names), no record run starts and the study exits 3 with one
``regime: FAIL`` line per failed criterion; ``--skip-regime`` still runs and records the
check but starts the record runs anyway (``"skipped": true`` in regime.json and study.json).

The study dir (``--out``; default ``runs/studies/<name>``) holds ``study.json`` (the study as
run) and one run dir per (method, seed). A run that exited 0 has ``done.json`` (its command
and exit code) and is skipped on later calls; a run without it is started again, resuming
through ``--ckpt_path last`` when the run dir holds a ``last.ckpt``, so a study interrupted at
any point finishes on the next call. A run stopped by a signal (``salvage fit`` exits 75 on
SIGTERM, 130 on SIGINT) is "stopped", never done.

Processes and locks: each run's ``salvage fit`` is its own session (``RUN/child.pid`` holds
its pid while it runs) and, on Linux, gets SIGTERM if the study process dies (even by
``kill -9``). SIGTERM or SIGINT (Ctrl-C) to the study sends SIGTERM to each running fit (it
ends its update, checkpoints and exits 75), starts no further run, waits for them and exits
75 (130 for SIGINT); a second signal kills the fits' process groups. ``STUDY_DIR/.lock``
(held while the study runs; it records pid, host and start time) makes a second ``salvage
study`` on the same dir exit 2 naming the holder; ``RUN/.lock``, held by the study and the fit
while a run goes, keeps two processes out of one run dir. The locks are ``flock`` locks: the
kernel drops them when their holders exit, so a crash leaves none behind.
Exit codes: 0 every run done; 1 a run, a prepare step or the calibration failed; 2 a bad study
file or a locked study dir; 3 the regime check failed; 75 (130) the study or a run was stopped
by SIGTERM (SIGINT): call it again to resume. Runs go one after another (``--backend local``; ``--jobs
N`` runs N at a time, each its own process) or as
one Ray task each (``--backend ray``; resources from ``ray_resources`` or else from the
config: ``num_gpus = trainer.devices`` when ``trainer.accelerator`` is gpu/cuda, or auto on
a cluster with GPUs; the study dir must be on a filesystem every Ray node sees). Each run's environment sets
``WANDB_RUN_GROUP`` = study name, ``WANDB_JOB_TYPE`` = method and ``WANDB_NAME`` =
``<method>-seed<k>``, so W&B overlays the methods of a study without set-up (add
``--config configs/logger/wandb.yaml`` to ``base``; ``wandb.init`` reads these variables,
and a ``group`` / ``job_type`` set in the config wins). ``salvage compare`` reads the CSV
logger's ``metrics.csv``, which ``salvage fit`` keeps beside a W&B logger.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import math
import operator
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from salvage.errors import ConfigError, MissingFileError

if sys.platform != "win32":
    import fcntl

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
STATS = ("mean", "min", "max", "last")
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
CALIBRATION_DIR = "_calibration"
METHOD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
"""A method name: its run dirs are ``STUDY_DIR/<name>/seed<k>``, so never a path."""

EXIT_FAILED = 1
EXIT_BUSY = 2
EXIT_REGIME = 3
EXIT_STOPPED = 75  # salvage fit stopped by SIGTERM (salvage.cli)
EXIT_INTERRUPTED = 130  # salvage fit stopped by SIGINT (salvage.cli)
STOPPED = {EXIT_STOPPED, EXIT_INTERRUPTED, -signal.SIGTERM, -signal.SIGINT}
"""Exit codes of a run stopped by a signal: not done, resumed on the next call."""


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

    def describe(self) -> str:
        where = f" over updates {self.steps[0]}-{self.steps[1]}" if self.steps else ""
        who = f"{self.method}: " if self.method else ""
        return f"{who}{self.stat} {self.metric}{where} {self.op} {self.threshold:g}"


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
class Verdict:
    """A criterion measured on the calibration run."""

    criterion: Criterion
    value: float | None
    """The statistic; None when the metric (or a row in ``steps``) is missing."""
    passed: bool
    rows: int
    """How many logged updates the statistic is over."""
    why: str = ""
    """Why there is no value."""

    def line(self) -> str:
        c = self.criterion
        if self.value is None:
            return f"{c.describe()}: {self.why}"
        return f"{c.describe()}: measured {self.value:.6g} over {self.rows} update(s)"


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
        return [sys.executable, "-m", "salvage.cli", "fit", *self.args, *resume]


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


def load_study(path: str | Path) -> Study:
    """Parse and check a study file; every error names the file, the key and the value."""
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
    name = spec.get("name", file.stem)
    if not isinstance(name, str) or not name or "/" in name:
        raise _err(file, "name", name, "must be a non-empty name without '/'")
    base_raw = spec.get("base")
    if base_raw is None:
        raise _err(file, "base", base_raw, "is required (a config path or a list of them)")
    base_list = base_raw if isinstance(base_raw, list) else [base_raw]
    base = [_path(file, "base", b) for b in base_list]
    seeds = spec.get("seeds")
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise _err(file, "seeds", seeds, "must be a non-empty list of distinct integers")
    overrides = _overrides(file, "overrides", spec.get("overrides"))
    methods_raw = spec.get("methods")
    if not isinstance(methods_raw, dict) or not methods_raw:
        raise _err(file, "methods", methods_raw, "must be a non-empty mapping name -> list")
    methods: dict[str, tuple[list[Path], list[str]]] = {}
    for m, items in methods_raw.items():
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
    prepare = []
    for i, step in enumerate(spec.get("prepare") or []):
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
    order = spec.get("order", "methods")
    if order not in ("methods", "seeds"):
        raise _err(file, "order", order, "must be 'methods' or 'seeds'")
    regime = _regime(file, spec.get("regime"), methods, baseline, list(seeds))
    return Study(
        order=order,
        name=name,
        file=file.resolve(),
        base=base,
        methods=methods,
        seeds=list(seeds),
        overrides=overrides,
        baseline=baseline,
        seed_keys=tuple(seed_keys),
        ray_resources=res,
        prepare=prepare,
        regime=regime,
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
    criteria = []
    for i, c in enumerate(crit_raw):
        key = f"regime.criteria[{i}]"
        if not isinstance(c, dict):
            raise _err(file, key, c, "must be a mapping {metric: NAME, '>=': NUMBER, ...}")
        extra = sorted(set(c) - {"metric", "steps", "stat", "method"} - set(COMPARISONS), key=str)
        if extra:
            raise _err(
                file,
                f"{key}[{extra[0]!r}]",
                c[extra[0]],
                "is not a criterion key (metric, steps, stat, method, and one of >=, <=, >, <)",
            )
        c_method = c.get("method")
        if c_method is not None and c_method not in methods:
            raise _err(
                file, f"{key}.method", c_method, f"is not one of the methods {sorted(methods)}"
            )
        metric = c.get("metric")
        if not isinstance(metric, str) or not metric:
            raise _err(
                file, f"{key}.metric", metric, "must be a metric name (a metrics.csv column)"
            )
        ops = [k for k in COMPARISONS if k in c]
        if len(ops) != 1:
            raise _err(
                file,
                key,
                c,
                f"needs exactly one comparison key of >=, <=, >, < (has {ops or 'none'})",
            )
        op = ops[0]
        if not _number(c[op]):
            raise _err(file, f"{key}[{op!r}]", c[op], "must be a finite number")
        stat = c.get("stat", "mean")
        if stat not in STATS:
            raise _err(file, f"{key}.stat", stat, f"must be one of {', '.join(STATS)}")
        steps = c.get("steps")
        if steps is not None and not (
            isinstance(steps, list)
            and len(steps) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) for k in steps)
            and 1 <= steps[0] <= steps[1]
        ):
            raise _err(
                file,
                f"{key}.steps",
                steps,
                "must be [first, last] update indices, 1 <= first <= last",
            )
        criteria.append(
            Criterion(
                metric,
                op,
                float(c[op]),
                stat,
                None if steps is None else (steps[0], steps[1]),
                None if c_method in (None, method) else c_method,
            )
        )
    return Regime(method, seed, overrides, criteria)


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


def evaluate(criteria: list[Criterion], series: dict[str, dict[float, float]]) -> list[Verdict]:
    """Each criterion on a run's metrics (``salvage.compare.read_run``: metric -> {step: value}).

    Update ``k`` (1-based) is the ``step`` value ``k - 1``: Lightning logs the metrics of
    update k, and the validation after it, at ``step`` = k - 1. A missing metric, or one
    without a row in ``steps``, fails the criterion and says why.
    """
    out = []
    for c in criteria:
        pts = sorted(series.get(c.metric, {}).items())
        if not pts:
            # the metrics of the same namespace first (a misspelt name is among them)
            ns = c.metric.split("/", 1)[0]
            names = sorted(series, key=lambda k: (k.split("/", 1)[0] != ns, k))
            shown = ", ".join(names[:40]) + (
                f" (+{len(names) - 40} more)" if len(names) > 40 else ""
            )
            why = (
                f"{c.metric} is not in the calibration's metrics.csv (it has: {shown or 'nothing'})"
            )
            out.append(Verdict(c, None, False, 0, why))
            continue
        if c.steps is not None:
            lo, hi = c.steps
            sel = [v for s, v in pts if lo - 1 <= s <= hi - 1]
            if not sel:
                why = (
                    f"{c.metric} has no row in updates {lo}-{hi} (logged at updates "
                    f"{int(pts[0][0]) + 1}-{int(pts[-1][0]) + 1})"
                )
                out.append(Verdict(c, None, False, 0, why))
                continue
        else:
            sel = [v for _, v in pts]
        stats: dict[str, Callable[[list[float]], float]] = {
            "mean": lambda v: sum(v) / len(v),
            "min": min,
            "max": max,
            "last": lambda v: v[-1],
        }
        value = stats[c.stat](sel)
        out.append(Verdict(c, value, COMPARISONS[c.op](value, c.threshold), len(sel)))
    return out


def regime_table(verdicts: list[Verdict]) -> str:
    """The criteria as a text table: metric, stat, updates, measured value, threshold, result."""
    head = ("metric", "stat", "updates", "value", "threshold", "result")
    rows = [
        (
            (f"{v.criterion.method}: " if v.criterion.method else "") + v.criterion.metric,
            v.criterion.stat,
            "all" if v.criterion.steps is None else "{}-{}".format(*v.criterion.steps),
            "missing" if v.value is None else f"{v.value:.6g}",
            f"{v.criterion.op} {v.criterion.threshold:g}",
            "pass" if v.passed else "FAIL",
        )
        for v in verdicts
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [head, *rows]
    )


def run_env(study: Study, run: Run) -> dict[str, str]:
    """The run's environment: W&B group = study, job type = method, name = method-seed."""
    env = dict(os.environ)
    env["WANDB_RUN_GROUP"] = study.name
    env["WANDB_JOB_TYPE"] = "calibration" if run.calibration else run.method
    env["WANDB_NAME"] = f"{'calibration-' if run.calibration else ''}{run.method}-seed{run.seed}"
    # from a source checkout, the child imports the same salvage as this process
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a marker is whole or absent


class Busy(ValueError):
    """A study dir or run dir locked by another live process (the message names it)."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _write_holder(f: IO[str], **extra: Any) -> None:
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": _now()} | extra))
    f.write("\n")
    f.flush()


def _holder(text: str) -> str:
    try:
        h = json.loads(text)
        who = f"pid {h['pid']} on {h['host']} since {h['since']}"
        return who + (f" (running pid {h['child']})" if h.get("child") else "")
    except (ValueError, KeyError, TypeError):
        return "another process"


def lock(path: Path, what: str) -> IO[str]:
    """Hold an exclusive ``flock`` on ``path`` (it records pid, host and start time) until
    the returned file is closed (or every process holding it has exited); ``Busy``, naming
    the holder, when another process holds it. No lock on Windows."""
    f = path.open("a+", encoding="utf-8")
    if sys.platform == "win32":  # pragma: no cover
        return f
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        who = _holder(f.read())
        f.close()
        raise Busy(f"{what} is in use by {who} (lock {path})") from None
    _write_holder(f)
    return f


@functools.lru_cache(maxsize=1)
def _prctl() -> Any:
    """libc's ``prctl`` (Linux), looked up before any fork; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.restype = ctypes.c_int
    return fn


PR_SET_PDEATHSIG = 1


def _child_setup() -> Callable[[], None] | None:
    """``preexec_fn`` of a run: on Linux, SIGTERM it when the thread that started it dies
    (``kill -9`` of ``salvage study``), so a run never outlives its study unattended."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def setup() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the study died before prctl took effect
            os._exit(EXIT_STOPPED)

    return setup


_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
_CHILDREN_LOCK = threading.RLock()  # re-entrant: the signal handler runs in the main thread
_STOP = threading.Event()
_STOP_SIGNALS: list[int] = []


def _signal_children(sig: int, group: bool) -> None:
    """Send ``sig`` to every running run (its ``salvage fit``, or its whole process group)."""
    with _CHILDREN_LOCK:
        procs = list(_CHILDREN.values())
    for proc in procs:
        if proc.returncode is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(proc.pid, sig)  # the run is its own session: pgid = its pid
            else:
                os.kill(proc.pid, sig)


@contextlib.contextmanager
def forwarding_signals() -> Iterator[None]:
    """While the study runs: SIGTERM / SIGINT stop it. The first signal sends SIGTERM to each
    running fit (it ends its update, writes ``last.ckpt`` and exits 75) and starts no
    further run; a second one kills the runs' process groups (SIGKILL). Main thread only."""
    _STOP.clear()
    _STOP_SIGNALS.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, _frame: Any) -> None:
        first = not _STOP.is_set()
        _STOP.set()
        _STOP_SIGNALS.append(signum)
        name = signal.Signals(signum).name
        msg = (
            f"salvage study: {name}: stopping the running fits (each ends its update and "
            "checkpoints); no further run starts; again to kill them\n"
            if first
            else f"salvage study: {name} again: killing the running fits\n"
        )
        os.write(2, msg.encode())  # not print: the handler may interrupt a print
        _signal_children(signal.SIGTERM if first else signal.SIGKILL, group=not first)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def execute(cmd: list[str], run_dir: str, env: dict[str, str]) -> int:
    """Run one fit, its output appended to ``RUN/fit.log``; write ``done.json`` on exit 0.

    The fit is its own session (a Ctrl-C at the terminal reaches the study, which stops it
    cleanly) and, on Linux, gets SIGTERM when the study dies. ``RUN/.lock`` is held while it
    runs (by this process and the fit: ``Busy`` when another holds it) and ``RUN/child.pid``
    holds its pid. Module-level so a Ray worker can call it."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    held = lock(d / ".lock", f"run dir {d}")
    try:
        with (d / "fit.log").open("a", encoding="utf-8") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                pass_fds=(held.fileno(),),  # the lock lasts as long as the fit, too
                preexec_fn=_child_setup(),
            )
            with _CHILDREN_LOCK:
                _CHILDREN[proc.pid] = proc
            try:
                _write_holder(held, child=proc.pid)
                (d / "child.pid").write_text(f"{proc.pid}\n", encoding="utf-8")
                if _STOP.is_set():  # the study was stopped while this run was starting
                    _signal_children(signal.SIGTERM, group=False)
                rc = proc.wait()
            finally:
                with _CHILDREN_LOCK:
                    _CHILDREN.pop(proc.pid, None)
                (d / "child.pid").unlink(missing_ok=True)
    finally:
        held.close()
    if rc == 0:
        _write_json(
            d / "done.json",
            {
                "command": cmd,
                "returncode": rc,
                "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            },
        )
    return rc


def _recorded_args(run: Run) -> list[str] | None:
    """The fit arguments a finished run recorded (without a resume's ``--ckpt_path``)."""
    try:
        cmd = json.loads((run.dir / "done.json").read_text(encoding="utf-8"))["command"]
        args = cmd[cmd.index("fit") + 1 :]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return args[:-2] if args[-2:] == ["--ckpt_path", "last"] else args


def _tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _merged_config(study: Study, configs: list[Path]) -> dict[str, Any]:
    """Base configs and fragments deep-merged (enough to read trainer.accelerator/devices)."""

    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    cfg: dict[str, Any] = {}
    for c in [*study.base, *configs]:
        try:
            loaded = yaml.safe_load(c.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"config file {str(c)!r} is not readable YAML: {first}") from None
        if isinstance(loaded, dict):
            cfg = merge(cfg, loaded)
    return cfg


def ray_resources(study: Study, run: Run, cluster_gpus: float = 0.0) -> dict[str, float]:
    """Ray task resources of a run: ``ray_resources`` from the study, else from the config
    and overrides: ``num_gpus = trainer.devices`` on a gpu/cuda accelerator (``auto``: when
    the cluster has GPUs), one CPU."""
    if study.ray_resources is not None:
        return dict(study.ray_resources)
    trainer = _merged_config(study, study.methods[run.method][0]).get("trainer") or {}
    acc, devices = trainer.get("accelerator", "auto"), trainer.get("devices", 1)
    toks = study.overrides + study.methods[run.method][1]
    for i, t in enumerate(toks[:-1]):
        if t == "--trainer.accelerator":
            acc = toks[i + 1]
        elif t == "--trainer.devices":
            devices = yaml.safe_load(toks[i + 1])
    acc = str(acc).lower()
    gpu = acc in ("gpu", "cuda") or (acc == "auto" and cluster_gpus > 0)
    if isinstance(devices, list):
        n = len(devices)
    elif isinstance(devices, int) and devices > 0:
        n = devices
    else:  # "auto" / -1: all of a node's devices; ask for one, set ray_resources for more
        n = 1
    return {"num_cpus": 1.0, "num_gpus": float(n) if gpu else 0.0}


Outcome = tuple[Run, int | None]
"""A run that did not finish: its exit code, or None when it was not started (study stopped)."""


def _report(r: Run, rc: int | None) -> None:
    log = r.dir / "fit.log"
    if rc is None:
        return
    if rc in STOPPED:
        print(f"  {r.label}: stopped by a signal (exit {rc}); resumes on the next call", flush=True)
    else:
        print(f"  {r.label}: exit code {rc}; last lines of {log}:\n" + _tail(log), file=sys.stderr)


def _run_local(study: Study, todo: list[Run], jobs: int = 1) -> list[Outcome]:
    """Run ``todo`` in plan order, ``jobs`` runs at a time (each its own process); the runs
    that did not finish, with their exit codes."""

    def one(i: int, r: Run) -> Outcome | None:
        if _STOP.is_set():
            return r, None
        cmd = r.command()
        how = "resuming" if "--ckpt_path" in cmd else "starting"
        print(f"[{i}/{len(todo)}] {how} {r.label} -> {r.dir}", flush=True)
        try:
            rc = execute(cmd, str(r.dir), run_env(study, r))
        except Busy as e:
            print(f"  {r.label}: not started: {e}", file=sys.stderr)
            return r, EXIT_BUSY
        if rc == 0:
            return None
        _report(r, rc)
        return r, rc

    if jobs <= 1:
        res = [one(i, r) for i, r in enumerate(todo, 1)]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            res = list(pool.map(one, range(1, len(todo) + 1), todo))
    return [o for o in res if o is not None]


def _run_ray(study: Study, todo: list[Run], address: str | None) -> list[Outcome]:
    try:
        import ray
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit("--backend ray needs ray: pip install 'salvage[ray]'") from e
    ray.init(address=address, ignore_reinit_error=True)
    task = ray.remote(execute)
    gpus = float(ray.cluster_resources().get("GPU", 0.0))
    refs = {}
    for r in todo:
        opts = ray_resources(study, r, gpus)
        print(f"submitting {r.label} ({opts}) -> {r.dir}", flush=True)
        refs[task.options(**opts).remote(r.command(), str(r.dir), run_env(study, r))] = r
    failed: list[Outcome] = []
    for ref, r in refs.items():
        rc = ray.get(ref)
        if rc != 0:
            _report(r, rc)
            failed.append((r, rc))
    return failed


def _run(
    study: Study, todo: list[Run], backend: str, address: str | None, jobs: int
) -> list[Outcome]:
    return _run_ray(study, todo, address) if backend == "ray" else _run_local(study, todo, jobs)


def _stop_code() -> int:
    """The study's exit code after a signal: 130 for SIGINT, else 75."""
    return EXIT_INTERRUPTED if _STOP_SIGNALS[:1] == [signal.SIGINT] else EXIT_STOPPED


def _finish(study: Study, runs: list[Run], outcomes: list[Outcome], out_dir: Path) -> int:
    """The study's exit code: 0 all done; 75/130 stopped by a signal; 1 a run failed."""
    failed = [r for r, rc in outcomes if rc is not None and rc not in STOPPED]
    stopped = [r for r, rc in outcomes if rc in STOPPED]
    unstarted = [r for r, rc in outcomes if rc is None]
    names = lambda rs: ", ".join(f"{r.method}/seed{r.seed}" for r in rs)  # noqa: E731
    if failed:
        print(f"study {study.name}: {len(failed)} run(s) failed: {names(failed)}", file=sys.stderr)
    if stopped or unstarted:
        print(
            f"study {study.name}: stopped: {len(stopped)} run(s) stopped by a signal"
            + (f" ({names(stopped)})" if stopped else "")
            + (f", {len(unstarted)} not started" if unstarted else "")
            + "; the next call resumes them",
            file=sys.stderr,
        )
    if failed:
        return EXIT_FAILED
    if _STOP.is_set():
        return _stop_code()
    if stopped:
        return EXIT_STOPPED
    print(f"study {study.name}: all {len(runs)} runs done; next: salvage compare {out_dir}")
    return 0


def check_regime(
    study: Study,
    out_dir: Path,
    backend: str = "local",
    address: str | None = None,
    skip: bool = False,
) -> tuple[int | None, dict[str, Any]]:
    """Run (or reuse) the calibration, print and record its criteria in ``regime.json``.

    Returns the exit code to stop the study with, None to go on to the record runs (every
    criterion passed, or ``skip``): 3 when a criterion failed, the calibration's failure or
    stop otherwise; and what ``regime.json`` holds (empty when the calibration did not end)."""
    from salvage.compare import read_run

    cals = calibration_runs(study, out_dir)
    assert cals and study.regime is not None
    cal = cals[0]
    for c in cals:
        if c.done and _recorded_args(c) not in (None, c.args):
            print(
                f"warning: the calibration {c.dir} is done but was run with other arguments "
                f"than the study now gives; delete {c.dir} to recalibrate",
                file=sys.stderr,
            )
    todo = [c for c in cals if not c.done]
    if todo:
        for c in todo:
            print(f"study {study.name}: regime check: calibration -> {c.dir}", flush=True)
        outcomes = _run(study, todo, backend, address, len(todo))
        if outcomes:
            rc = outcomes[0][1]
            print(
                f"study {study.name}: the calibration did not finish (exit {rc}); no record "
                "run started",
                file=sys.stderr,
            )
            if _STOP.is_set():
                return _stop_code(), {}
            return (EXIT_STOPPED if rc in STOPPED else EXIT_FAILED), {}
    series = {c.method: read_run(c.dir) for c in cals}
    verdicts = [
        evaluate([k], series[k.method or study.regime.method])[0] for k in study.regime.criteria
    ]
    passed = all(v.passed for v in verdicts)
    where = ", ".join(f"{c.label} ({c.dir})" for c in cals)
    print(f"study {study.name}: regime check on {where}:")
    print(regime_table(verdicts), flush=True)
    record = {
        "passed": passed,
        "skipped": skip,
        "method": cal.method,
        "seed": cal.seed,
        "run_dir": str(cal.dir),
        "command": _recorded_command(cal) or cal.command(),
        "runs": {c.method: str(c.dir) for c in cals},
        "checked": _now(),
        "criteria": [
            {
                "method": v.criterion.method or study.regime.method,
                "metric": v.criterion.metric,
                "stat": v.criterion.stat,
                "steps": None if v.criterion.steps is None else list(v.criterion.steps),
                "op": v.criterion.op,
                "threshold": v.criterion.threshold,
                "value": v.value,
                "rows": v.rows,
                "result": "pass" if v.passed else "FAIL",
                **({"why": v.why} if v.why else {}),
            }
            for v in verdicts
        ],
    }
    _write_json(out_dir / "regime.json", record)
    if passed:
        return None, record
    for v in verdicts:
        if not v.passed:
            print(f"regime: FAIL: {v.line()}", file=sys.stderr)
    if skip:
        print(f"study {study.name}: --skip-regime: starting the record runs anyway", flush=True)
        return None, record
    print(
        f"study {study.name}: the regime check failed (see {out_dir / 'regime.json'}); no record "
        "run started (--skip-regime to run them anyway)",
        file=sys.stderr,
    )
    return EXIT_REGIME, record


def _recorded_command(run: Run) -> list[str] | None:
    try:
        cmd = json.loads((run.dir / "done.json").read_text(encoding="utf-8"))["command"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cmd if isinstance(cmd, list) else None


def run_study(
    path: str | Path,
    out: str | Path | None = None,
    backend: str = "local",
    address: str | None = None,
    jobs: int = 1,
    skip_regime: bool = False,
) -> int:
    """Run the study's unfinished runs. Exit codes: 0 every run done; 1 a run (or a prepare
    step, or the calibration) failed; 3 the regime check failed; 75 (130) stopped by SIGTERM
    (SIGINT), or a run was; ``Busy`` when another study holds the study dir. ``jobs``: runs at
    a time on the local backend."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    study = load_study(path)
    out_dir = Path(out) if out is not None else Path("runs") / "studies" / study.name
    out_dir.mkdir(parents=True, exist_ok=True)
    held = lock(out_dir / ".lock", f"study dir {out_dir}")
    try:
        with forwarding_signals():
            return _run_study(study, out_dir, backend, address, jobs, skip_regime)
    finally:
        held.close()


def _run_study(
    study: Study, out_dir: Path, backend: str, address: str | None, jobs: int, skip_regime: bool
) -> int:
    runs = plan(study, out_dir)
    info: dict[str, Any] = {
        "name": study.name,
        "file": str(study.file),
        "baseline": study.baseline,
        "seeds": study.seeds,
        "methods": list(study.methods),
        "runs": {f"{r.method}/seed{r.seed}": r.args for r in runs},
    }
    if study.regime is not None:
        info["regime"] = {
            "criteria": [c.describe() for c in study.regime.criteria],
            "passed": None,
            "skipped": skip_regime,
        }
    _write_json(out_dir / "study.json", info)
    for i, (creates, args) in enumerate(study.prepare):
        if creates.exists():
            continue
        cmd = [sys.executable, "-m", "salvage.cli", *args]
        print(f"[prepare {i + 1}/{len(study.prepare)}] salvage {shlex.join(args)}", flush=True)
        try:
            rc = execute(cmd, str(out_dir / "prepare" / str(i)), dict(os.environ))
        except Busy as e:
            print(f"study {study.name}: prepare step {i + 1}: {e}", file=sys.stderr)
            return EXIT_FAILED
        if rc != 0:
            log = out_dir / "prepare" / str(i) / "fit.log"
            print(
                f"study {study.name}: prepare step {i + 1} (salvage {shlex.join(args)}) exited "
                f"{rc}; see {log}:\n{_tail(log)}",
                file=sys.stderr,
            )
            if _STOP.is_set():
                return _stop_code()
            return EXIT_STOPPED if rc in STOPPED else EXIT_FAILED
    if study.regime is not None:
        rc_regime, regime = check_regime(study, out_dir, backend, address, skip_regime)
        info["regime"] |= {"passed": regime.get("passed"), "checked": regime.get("checked")}
        _write_json(out_dir / "study.json", info)
        if rc_regime is not None:
            return rc_regime
    todo = [r for r in runs if not r.done]
    for r in runs:
        if r.done and _recorded_args(r) not in (None, r.args):
            print(
                f"warning: {r.method}/seed{r.seed} is done but was run with other arguments "
                f"than the study now gives (see {r.dir / 'done.json'}); delete its done.json "
                "to rerun it",
                file=sys.stderr,
            )
    print(
        f"study {study.name}: {len(runs)} runs, {len(runs) - len(todo)} done, "
        f"{len(todo)} to run -> {out_dir}",
        flush=True,
    )
    return _finish(study, runs, _run(study, todo, backend, address, jobs), out_dir)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="salvage study", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("study", help="the study YAML")
    p.add_argument("--out", default=None, help="study dir (default runs/studies/<name>)")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument("--jobs", type=int, default=1, help="local backend: runs at a time (default 1)")
    p.add_argument(
        "--skip-regime",
        action="store_true",
        help="run and record the regime check, but start the record runs even if it fails",
    )
    a = p.parse_args(argv)
    try:
        rc = run_study(a.study, a.out, a.backend, a.ray_address, a.jobs, a.skip_regime)
    except ValueError as e:  # Busy included: exit 2 naming the holder
        p.exit(EXIT_BUSY, f"salvage study: error: {' '.join(str(e).split())}\n")
    sys.exit(rc)
