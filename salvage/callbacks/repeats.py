"""``salvage test --repeats N``: evaluate one checkpoint N times and report mean ± std.

The GRAFT paper evaluates each selected checkpoint in five independent runs and reports
their mean and standard deviation (SPEC §3.4). ``--repeats N`` is shorthand for
``--data.init_args.test_repeats N`` (``RLVRDataModule`` / ``GraftDataModule``): the test
benchmarks are sampled N times with different seeds; the module logs
``eval/repeat_<r>/...`` per repeat, ``eval/success/<bench>`` / ``eval/aggregate`` as the
mean over repeats and ``..._std`` as the sample standard deviation (GRAFT: ``a/eval/...``,
``b/eval/...``); ``RepeatTable`` prints them as one table.
"""

from __future__ import annotations

import re

import lightning as L


def repeats_argv(argv: list[str]) -> list[str]:
    """``test ... --repeats N ...`` -> ``test ... --data.init_args.test_repeats N`` (last, so a
    config given later on the line does not reset it); other lines are returned unchanged."""
    if not argv or argv[0] != "test":
        return argv
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--repeats":
            if i + 1 >= len(argv):
                raise SystemExit("salvage test: --repeats needs a number (e.g. --repeats 5)")
            value, i = argv[i + 1], i + 2
            continue
        if a.startswith("--repeats="):
            value, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    if value is None:
        return argv
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(f"salvage test: --repeats must be a whole number >= 1, got {value!r}")
    return [*out, "--data.init_args.test_repeats", value]


_STD = re.compile(r"^(?P<base>.*?)(?P<what>aggregate|success/[^/]+)_std$")


def repeat_rows(metrics: dict[str, float]) -> list[tuple[str, float, float, list[float]]]:
    """(metric, mean, std, per-repeat values) for every ``..._std`` metric of a repeated test."""
    rows = []
    for key in sorted(metrics):
        m = _STD.match(key)
        if not m or key[: -len("_std")] not in metrics:
            continue
        base, what = m["base"], m["what"]
        per = []
        r = 0
        while f"{base}repeat_{r}/{what}" in metrics:
            per.append(float(metrics[f"{base}repeat_{r}/{what}"]))
            r += 1
        rows.append(
            (key[: -len("_std")], float(metrics[key[: -len("_std")]]), float(metrics[key]), per)
        )
    return rows


class RepeatTable(L.Callback):
    """Prints ``mean ± std (per-repeat values)`` per benchmark and aggregate after a repeated test."""

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank != 0:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
        rows = repeat_rows(metrics)
        if not rows:
            return
        from rich.console import Console
        from rich.table import Table

        n = len(rows[0][3])
        table = Table(title=f"evaluation over {n} repeats (mean ± sample std)")
        for col in ("metric", "mean ± std", "per repeat"):
            table.add_column(col, justify="left" if col == "metric" else "right")
        for key, mean, std, per in rows:
            table.add_row(key, f"{mean:.4f} ± {std:.4f}", " ".join(f"{v:.4f}" for v in per))
        Console().print(table)
