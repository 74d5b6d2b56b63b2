"""The sweep table of docs/scale_models.md, from a scale-model study's runs.

    .venv/bin/python scripts/scale_table.py runs/studies/scale_twx [--k 5] [--json OUT]

For every ``<method>/seed<k>`` run under the study dir (finished or not: a row says how many
updates it logged): the student's parameters and prompt tokens (from the run's
``config.yaml`` policy, built in-process), seconds per update (``perf/step_s``), training
success over the first k and last k logged updates and their difference (the study gate's
``gain``), the same per family (``rollout/success/<family>``), and held-out success
(``val/success`` and per ``val/success/<label>``) at the first and last validation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from salvage.commands.compare import read_run


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def _policy(run: Path, prefix: str) -> dict[str, Any]:
    """The run's policy spec (``policy``; ``policy_a`` / ``policy_b`` for prefix a/, b/)."""
    key = "policy" if not prefix else f"policy_{prefix.rstrip('/')}"
    for cfg in sorted(run.glob("version_*/config.yaml")):
        conf = yaml.safe_load(cfg.read_text(encoding="utf-8"))
        return dict(conf["model"]["init_args"].get(key) or {})
    return {}


def _size(policy: dict[str, Any], sample: str) -> tuple[int | None, int | None]:
    """(parameters, tokens of ``sample``) of a built-in policy; (None, None) otherwise."""
    from salvage.models import BUILT_FROM_CONFIG, PolicySpec, load_model, load_tokenizer

    if policy.get("name_or_path", "tiny") not in BUILT_FROM_CONFIG:
        return None, None
    spec = PolicySpec(**{k: v for k, v in policy.items() if k in PolicySpec.__dataclass_fields__})
    tok = load_tokenizer(spec)
    n = sum(p.numel() for p in load_model(spec, tok).parameters())
    return n, len(tok(sample).input_ids)


def row(run: Path, k: int, sample: str, prefix: str = "") -> dict[str, Any]:
    """One run's row; ``prefix`` (``a/``, ``b/``): one model of a two-model run (GRAFT)."""
    full = read_run(run)
    m = {key[len(prefix) :]: v for key, v in full.items() if key.startswith(prefix)}
    m.setdefault("perf/step_s", full.get("perf/step_s", {}))
    succ = [v for _, v in sorted(m.get("rollout/success_rate", {}).items())]
    out: dict[str, Any] = {"run": prefix + run.parent.name, "updates": len(succ)}
    out["params"], out["prompt_tokens"] = _size(_policy(run, prefix), sample)
    steps = [v for _, v in sorted(m.get("perf/step_s", {}).items())]
    out["s_per_update"] = _mean(steps) if steps else None
    if len(succ) >= 2 * k:
        out["first_k"], out["last_k"] = _mean(succ[:k]), _mean(succ[-k:])
        out["gain"] = out["last_k"] - out["first_k"]
    for key in sorted(m):
        if key.startswith("rollout/success/"):
            v = [x for _, x in sorted(m[key].items())]
            if len(v) >= 2 * k:
                out[f"gain/{key.rsplit('/', 1)[1]}"] = _mean(v[-k:]) - _mean(v[:k])
        if key == "val/success" or key.startswith("val/success/"):
            v = [x for _, x in sorted(m[key].items())]
            if v:
                name = key[len("val/") :]
                out[f"{name}@first"], out[f"{name}@last"] = v[0], v[-1]
    return out


def _fmt(v: Any, col: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:+.3f}" if col.startswith("gain") else f"{v:.3g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study_dir", type=Path)
    ap.add_argument("--k", type=int, default=5, help="updates each end's mean is over")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument(
        "--prefix",
        action="append",
        default=None,
        help="a model's metric prefix in two-model runs (a/, b/; repeatable; default none)",
    )
    ap.add_argument(
        "--sample",
        default="You are in the kitchen. In one part of the room you see a fridge that is "
        "closed. There is also a counter that has a red apple on it.",
        help="text whose token count the table shows (a prompt of the study's domain)",
    )
    args = ap.parse_args(argv)
    runs = sorted(p for p in args.study_dir.glob("*/seed*") if p.is_dir())
    if not runs:
        print(f"no <method>/seed<k> runs under {args.study_dir}", file=sys.stderr)
        return 2
    rows = [row(r, args.k, args.sample, p) for r in runs for p in (args.prefix or [""])]
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(_fmt(r.get(c), c) for c in cols) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
