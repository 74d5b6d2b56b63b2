"""``salvage study STUDY.yaml``: the command: plan, prepare, check the regime, run, report.

The study file and what the command does are documented in ``salvage.commands.study``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from salvage.commands import EXIT_STOPPED
from salvage.commands.study.regime import check_regime
from salvage.commands.study.runner import (
    EXIT_BUSY,
    EXIT_FAILED,
    STOPPED,
    Busy,
    Outcome,
    execute,
    forwarding_signals,
    lock,
    log_tail,
    ran_with_other_args,
    run_all,
    stop_code,
    stop_requested,
    write_json,
)
from salvage.commands.study.spec import Run, Study, load_study, plan
from salvage.invocation import command


def run_study(
    path: str | Path,
    out: str | Path | None = None,
    backend: str = "local",
    address: str | None = None,
    jobs: int = 1,
    skip_regime: bool = False,
    methods: list[str] | None = None,
    seeds: list[int] | None = None,
) -> int:
    """Run the study's unfinished runs. Exit codes: 0 every run done; 1 a run (or a prepare
    step, or the calibration) failed; 3 the regime check failed; 75 (130) stopped by SIGTERM
    (SIGINT), or a run was; ``Busy`` when another study holds the study dir. ``jobs``: runs at
    a time on the local backend. ``methods`` / ``seeds``: run only those record runs (the
    regime check and the prepare steps are unchanged); None: all."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    study = load_study(path)
    only = _only(study, methods, seeds)
    out_dir = Path(out) if out is not None else Path("runs") / "studies" / study.name
    bad = next((q for q in (out_dir, *out_dir.parents) if q.exists() and not q.is_dir()), None)
    if bad is not None:
        where = "is a file" if bad == out_dir else f"is under a file ({bad})"
        raise ValueError(f"--out {out_dir} {where}; a study dir must be a directory")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out_dir} cannot be made: {e.strerror or e}") from None
    held = lock(out_dir / ".lock", f"study dir {out_dir}")
    try:
        with forwarding_signals():
            return _run_study(study, out_dir, backend, address, jobs, skip_regime, only)
    finally:
        held.close()


def _only(
    study: Study, methods: list[str] | None, seeds: list[int] | None
) -> tuple[set[str], set[int]]:
    """The (methods, seeds) a ``--methods`` / ``--seeds`` selection keeps, checked against the
    study file before anything runs: an unknown name or seed is a ValueError naming it."""
    bad_m = [m for m in methods or [] if m not in study.methods]
    if bad_m:
        raise ValueError(
            f"--methods: {', '.join(bad_m)} not a method of {study.file} "
            f"(its methods: {', '.join(study.methods)})"
        )
    bad_s = [s for s in seeds or [] if s not in study.seeds]
    if bad_s:
        raise ValueError(
            f"--seeds: {', '.join(map(str, bad_s))} not a seed of {study.file} "
            f"(its seeds: {', '.join(map(str, study.seeds))})"
        )
    return set(methods or study.methods), set(seeds or study.seeds)


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
    if stop_requested():
        return stop_code()
    if stopped:
        return EXIT_STOPPED
    print(f"study {study.name}: all {len(runs)} runs done; next: {command()} compare {out_dir}")
    return 0


def _study_info(study: Study, runs: list[Run], skip_regime: bool) -> dict[str, Any]:
    """What ``study.json`` holds: the study as run (its runs' arguments, the regime)."""
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
    return info


def _prepare(study: Study, out_dir: Path) -> int | None:
    """The ``prepare:`` steps whose path does not exist yet, in order; the exit code to stop
    the study with when one failed or was stopped, else None."""
    for i, (creates, args) in enumerate(study.prepare):
        if creates.exists():
            continue
        cmd = [sys.executable, "-m", "salvage", *args]
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
                f"{rc}; see {log}:\n{log_tail(log)}",
                file=sys.stderr,
            )
            if stop_requested():
                return stop_code()
            return EXIT_STOPPED if rc in STOPPED else EXIT_FAILED
    return None


def _run_study(
    study: Study,
    out_dir: Path,
    backend: str,
    address: str | None,
    jobs: int,
    skip_regime: bool,
    only: tuple[set[str], set[int]],
) -> int:
    every = plan(study, out_dir)
    info = _study_info(study, every, skip_regime)
    write_json(out_dir / "study.json", info)
    rc = _prepare(study, out_dir)
    if rc is not None:
        return rc
    if study.regime is not None:
        rc_regime, regime = check_regime(study, out_dir, backend, address, skip_regime, jobs)
        info["regime"] |= {"passed": regime.get("passed"), "checked": regime.get("checked")}
        write_json(out_dir / "study.json", info)
        if rc_regime is not None:
            return rc_regime
    runs = [r for r in every if r.method in only[0] and r.seed in only[1]]
    if len(runs) < len(every):
        print(f"study {study.name}: --methods/--seeds: {len(runs)} of {len(every)} runs selected")
    todo = [r for r in runs if not r.done]
    for r in runs:
        if r.done and ran_with_other_args(r):
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
    return _finish(study, runs, run_all(study, todo, backend, address, jobs), out_dir)


def _names(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def main(argv: list[str] | None = None) -> None:
    from salvage.commands import study as package  # its docstring is the help

    p = argparse.ArgumentParser(
        prog="salvage study",
        description=package.__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("study", help="the study YAML")
    p.add_argument("--out", default=None, help="study dir (default runs/studies/<name>)")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="local backend: runs at a time, the regime's calibrations too (default 1)",
    )
    p.add_argument(
        "--skip-regime",
        action="store_true",
        help="run and record the regime check, but start the record runs even if it fails",
    )
    p.add_argument(
        "--methods",
        type=_names,
        default=None,
        help="comma-separated methods: run only their record runs (default: every method)",
    )
    p.add_argument(
        "--seeds",
        type=_ints,
        default=None,
        help="comma-separated seeds: run only their record runs (default: every seed)",
    )
    a = p.parse_args(argv)
    try:
        rc = run_study(
            a.study, a.out, a.backend, a.ray_address, a.jobs, a.skip_regime, a.methods, a.seeds
        )
    except ValueError as e:  # Busy included: exit 2 naming the holder
        p.exit(EXIT_BUSY, f"salvage study: error: {' '.join(str(e).split())}\n")
    sys.exit(rc)
