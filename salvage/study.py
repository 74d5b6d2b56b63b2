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

The study dir (``--out``; default ``runs/studies/<name>``) holds ``study.json`` (the study as
run) and one run dir per (method, seed). A run that exited 0 has ``done.json`` (its command
and exit code) and is skipped on later calls; a run without it is started again, resuming
through ``--ckpt_path last`` when the run dir holds a ``last.ckpt``, so a study interrupted at
any point finishes on the next call. Runs go one after another (``--backend local``; ``--jobs
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
import datetime
import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

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
}


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


@dataclass
class Run:
    """One (method, seed) run: its dir and the ``salvage fit`` arguments (without resume)."""

    method: str
    seed: int
    dir: Path
    args: list[str]

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
    return ValueError(f"{file}: {key}={value!r} {why}")


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
        raise ValueError(f"study file {str(path)!r} does not exist")
    spec = yaml.safe_load(file.read_text(encoding="utf-8"))
    if not isinstance(spec, dict):
        raise ValueError(f"{file}: a study file must be a YAML mapping")
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
    common_raw = spec.get("overrides") or []
    common_items = [common_raw] if isinstance(common_raw, dict) else common_raw
    if not isinstance(common_items, list):
        raise _err(file, "overrides", common_raw, "must be a mapping or a list")
    overrides = [t for it in common_items for t in _override_tokens(file, "overrides", it)]
    methods_raw = spec.get("methods")
    if not isinstance(methods_raw, dict) or not methods_raw:
        raise _err(file, "methods", methods_raw, "must be a non-empty mapping name -> list")
    methods: dict[str, tuple[list[Path], list[str]]] = {}
    for m, items in methods_raw.items():
        key = f"methods.{m}"
        if not isinstance(m, str) or not m or "/" in m:
            raise _err(file, "methods", m, "method names must be non-empty, without '/'")
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
    )


def plan(study: Study, out: Path) -> list[Run]:
    """Every (method, seed) run of the study: methods in file order, then seeds (``order:
    seeds``: seeds in file order, then methods)."""
    runs = []
    pairs = [(m, s) for m in study.methods for s in study.seeds]
    if study.order == "seeds":
        pairs = [(m, s) for s in study.seeds for m in study.methods]
    for m, s in pairs:
        configs, toks = study.methods[m]
        d = out / m / f"seed{s}"
        args = [a for c in study.base for a in ("--config", str(c))] + study.overrides
        args += [a for c in configs for a in ("--config", str(c))] + toks
        for k in study.seed_keys:
            args += [f"--{k}", str(s)]
        args += ["--trainer.default_root_dir", str(d)]
        runs.append(Run(m, s, d, args))
    return runs


def run_env(study: Study, run: Run) -> dict[str, str]:
    """The run's environment: W&B group = study, job type = method, name = method-seed."""
    env = dict(os.environ)
    env["WANDB_RUN_GROUP"] = study.name
    env["WANDB_JOB_TYPE"] = run.method
    env["WANDB_NAME"] = f"{run.method}-seed{run.seed}"
    # from a source checkout, the child imports the same salvage as this process
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a marker is whole or absent


def execute(cmd: list[str], run_dir: str, env: dict[str, str]) -> int:
    """Run one fit, its output appended to ``RUN/fit.log``; write ``done.json`` on exit 0.
    Module-level so a Ray worker can call it."""
    d = Path(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    with (d / "fit.log").open("a", encoding="utf-8") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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
        loaded = yaml.safe_load(c.read_text(encoding="utf-8")) or {}
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


def _run_local(study: Study, todo: list[Run], jobs: int = 1) -> list[Run]:
    """Run ``todo`` in plan order, ``jobs`` runs at a time (each its own process)."""

    def one(i: int, r: Run) -> Run | None:
        cmd = r.command()
        how = "resuming" if "--ckpt_path" in cmd else "starting"
        print(f"[{i}/{len(todo)}] {how} {r.method} seed {r.seed} -> {r.dir}", flush=True)
        rc = execute(cmd, str(r.dir), run_env(study, r))
        if rc == 0:
            return None
        print(
            f"  {r.method} seed {r.seed}: exit code {rc}; last lines of {r.dir / 'fit.log'}:\n"
            + _tail(r.dir / "fit.log"),
            file=sys.stderr,
        )
        return r

    if jobs <= 1:
        res = [one(i, r) for i, r in enumerate(todo, 1)]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            res = list(pool.map(one, range(1, len(todo) + 1), todo))
    return [r for r in res if r is not None]


def _run_ray(study: Study, todo: list[Run], address: str | None) -> list[Run]:
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
        print(f"submitting {r.method} seed {r.seed} ({opts}) -> {r.dir}", flush=True)
        refs[task.options(**opts).remote(r.command(), str(r.dir), run_env(study, r))] = r
    failed = []
    for ref, r in refs.items():
        rc = ray.get(ref)
        if rc != 0:
            print(f"{r.method} seed {r.seed}: exit code {rc} (see {r.dir / 'fit.log'})")
            failed.append(r)
    return failed


def run_study(
    path: str | Path,
    out: str | Path | None = None,
    backend: str = "local",
    address: str | None = None,
    jobs: int = 1,
) -> int:
    """Run the study's unfinished runs; 0 when every run is done, else 1. ``jobs``: runs at a
    time on the local backend."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    study = load_study(path)
    out_dir = Path(out) if out is not None else Path("runs") / "studies" / study.name
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = plan(study, out_dir)
    _write_json(
        out_dir / "study.json",
        {
            "name": study.name,
            "file": str(study.file),
            "baseline": study.baseline,
            "seeds": study.seeds,
            "methods": list(study.methods),
            "runs": {f"{r.method}/seed{r.seed}": r.args for r in runs},
        },
    )
    for i, (creates, args) in enumerate(study.prepare):
        if creates.exists():
            continue
        cmd = [sys.executable, "-m", "salvage.cli", *args]
        print(f"[prepare {i + 1}/{len(study.prepare)}] salvage {shlex.join(args)}", flush=True)
        rc = execute(cmd, str(out_dir / "prepare" / str(i)), dict(os.environ))
        if rc != 0:
            log = out_dir / "prepare" / str(i) / "fit.log"
            print(
                f"study {study.name}: prepare step {i + 1} (salvage {shlex.join(args)}) exited "
                f"{rc}; see {log}:\n{_tail(log)}",
                file=sys.stderr,
            )
            return 1
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
    failed = _run_ray(study, todo, address) if backend == "ray" else _run_local(study, todo, jobs)
    if failed:
        names = ", ".join(f"{r.method}/seed{r.seed}" for r in failed)
        print(f"study {study.name}: {len(failed)} run(s) failed: {names}", file=sys.stderr)
        return 1
    print(f"study {study.name}: all {len(runs)} runs done; next: salvage compare {out_dir}")
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="salvage study", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("study", help="the study YAML")
    p.add_argument("--out", default=None, help="study dir (default runs/studies/<name>)")
    p.add_argument("--backend", choices=("local", "ray"), default="local")
    p.add_argument("--ray-address", default=None, help="Ray cluster address (default: local)")
    p.add_argument("--jobs", type=int, default=1, help="local backend: runs at a time (default 1)")
    a = p.parse_args(argv)
    try:
        rc = run_study(a.study, a.out, a.backend, a.ray_address, a.jobs)
    except ValueError as e:
        p.exit(2, f"salvage study: error: {e}\n")
    sys.exit(rc)
