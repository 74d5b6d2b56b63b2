"""``salvage study`` and ``salvage compare``: study files, run commands, resume, tables, plots."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from salvage.compare import compare, heldout_keys, read_run
from salvage.study import execute, load_study, plan, ray_resources, run_env, run_study

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs/grpo/math_tiny.yaml"


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- study files and commands


def test_study_file_errors_name_the_file_key_and_value(tmp_path):
    f = tmp_path / "s.yaml"
    _write(f, f"base: {TINY}\nseeds: [0]\nmethods: {{grpo: []}}\nbaseline: nope\n")
    with pytest.raises(ValueError, match=r"s.yaml: baseline='nope' is not one of the methods"):
        load_study(f)
    _write(f, "base: missing.yaml\nseeds: [0]\nmethods: {grpo: []}\n")
    with pytest.raises(ValueError, match=r"base='missing.yaml' is not a file"):
        load_study(f)
    _write(f, f"base: {TINY}\nseeds: [0, 0]\nmethods: {{grpo: []}}\n")
    with pytest.raises(ValueError, match=r"seeds=\[0, 0\] must be a non-empty list of distinct"):
        load_study(f)
    _write(f, f"base: {TINY}\nseeds: [0]\nmethods: {{grpo: []}}\nseed: 3\n")
    with pytest.raises(ValueError, match=r"seed=3 is not a study key"):
        load_study(f)
    _write(f, f"base: {TINY}\nseeds: [0]\nmethods: {{grpo: [42]}}\n")
    with pytest.raises(ValueError, match=r"methods.grpo=42 must be a"):
        load_study(f)
    with pytest.raises(ValueError, match="does not exist"):
        load_study(tmp_path / "absent.yaml")


@pytest.mark.parametrize("path", sorted((ROOT / "studies").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_studies_load(path, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # paths resolve relative to the study file, not the cwd
    study = load_study(path)
    assert study.baseline in study.methods and len(study.seeds) >= 3
    assert all(
        c.is_file() for r in plan(study, tmp_path) for c in map(Path, r.args) if c.suffix == ".yaml"
    )


def test_plan_builds_one_fit_per_method_and_seed(tmp_path, monkeypatch):
    # base relative to the current directory; the fragment relative to the study file
    monkeypatch.chdir(ROOT)
    study_dir = tmp_path / "studies"
    frag = _write(study_dir / "frag.yaml", "model:\n  init_args:\n    lr: 1.0e-3\n")
    f = _write(
        study_dir / "s.yaml",
        "base: configs/grpo/math_tiny.yaml\n"
        "baseline: grpo\n"
        "seeds: [3, 5]\n"
        "overrides: {trainer.max_steps: 2, trainer.enable_progress_bar: false}\n"
        "methods:\n"
        "  grpo: []\n"
        "  other:\n"
        "    - frag.yaml\n"
        "    - {data.init_args.advantage: drgrpo, data.init_args.val: {size: 4}}\n"
        "    - '--model.init_args.kl_coef 0.0'\n",
    )
    study = load_study(f)
    assert study.name == "s" and study.baseline == "grpo"
    runs = plan(study, tmp_path / "out")
    assert [(r.method, r.seed) for r in runs] == [
        ("grpo", 3),
        ("grpo", 5),
        ("other", 3),
        ("other", 5),
    ]
    r = runs[3]
    assert r.dir == tmp_path / "out" / "other" / "seed5"
    assert r.args == [
        "--config",
        str(TINY),
        "--trainer.max_steps",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--config",
        str(frag.resolve()),
        "--data.init_args.advantage",
        "drgrpo",
        "--data.init_args.val",
        '{"size": 4}',
        "--model.init_args.kl_coef",
        "0.0",
        "--seed_everything",
        "5",
        "--data.init_args.seed",
        "5",
        "--model.init_args.seed",
        "5",
        "--trainer.default_root_dir",
        str(r.dir),
    ]
    # fresh run: no resume; a last.ckpt in either layout -> resume through --ckpt_path last
    cmd = r.command()
    assert cmd[:4] == [sys.executable, "-m", "salvage.cli", "fit"] and "--ckpt_path" not in cmd
    for layout in ("checkpoints/last.ckpt", "version_1/checkpoints/last.ckpt"):
        ck = _write(r.dir / layout, "x")
        assert r.command()[-2:] == ["--ckpt_path", "last"], layout
        ck.unlink()
    assert not r.done
    _write(r.dir / "done.json", "{}")
    assert r.done
    env = run_env(study, r)
    assert (env["WANDB_RUN_GROUP"], env["WANDB_JOB_TYPE"], env["WANDB_NAME"]) == (
        "s",
        "other",
        "other-seed5",
    )


def test_finished_runs_are_skipped_and_changed_ones_flagged(tmp_path, capsys):
    f = _write(tmp_path / "s.yaml", f"base: {TINY}\nseeds: [0, 1]\nmethods: {{grpo: []}}\n")
    out = tmp_path / "o"
    same, changed = plan(load_study(f), out)
    for r, args in ((same, [*same.args, "--ckpt_path", "last"]), (changed, ["--other"])):
        _write(
            r.dir / "done.json", json.dumps({"command": ["py", "-m", "salvage.cli", "fit", *args]})
        )
    assert run_study(f, out) == 0  # nothing to run: no fit is started
    got = capsys.readouterr()
    assert "2 runs, 2 done, 0 to run" in got.out
    assert "grpo/seed1 is done but was run with other arguments" in got.err
    assert "grpo/seed0" not in got.err
    info = json.loads((out / "study.json").read_text())
    assert info["methods"] == ["grpo"] and info["seeds"] == [0, 1]


def test_jobs_run_local_runs_side_by_side(tmp_path, monkeypatch):
    # each "fit" records when it starts and ends and sleeps 1.5 s: with --jobs 2 the two runs
    # overlap in time (sequentially the second starts after the first ended), both end done
    from salvage import study as study_mod

    f = _write(tmp_path / "s.yaml", f"base: {TINY}\nseeds: [0, 1]\nmethods: {{grpo: []}}\n")
    script = (
        "import sys, time; p = sys.argv[1]; open(p + '/t', 'w').write(str(time.time()) + ' ');"
        "time.sleep(1.5); open(p + '/t', 'a').write(str(time.time()))"
    )
    monkeypatch.setattr(
        study_mod.Run, "command", lambda self: [sys.executable, "-c", script, str(self.dir)]
    )
    out = tmp_path / "o"
    assert run_study(f, out, jobs=2) == 0
    (s0, e0), (s1, e1) = (
        map(float, (out / "grpo" / f"seed{k}" / "t").read_text().split()) for k in (0, 1)
    )
    assert max(s0, s1) < min(e0, e1)  # the runs overlapped
    assert all((out / "grpo" / f"seed{k}" / "done.json").is_file() for k in (0, 1))
    with pytest.raises(ValueError, match="--jobs must be >= 1, got 0"):
        run_study(f, out, jobs=0)


def test_execute_marks_only_a_clean_exit_done(tmp_path):
    run = tmp_path / "m" / "seed0"
    fail = [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    assert execute(fail, str(run), dict(os.environ)) == 3
    assert not (run / "done.json").exists()
    ok = [sys.executable, "-c", "print('fine')"]
    assert execute(ok, str(run), dict(os.environ)) == 0
    done = json.loads((run / "done.json").read_text())
    assert done["command"] == ok and done["returncode"] == 0
    log = (run / "fit.log").read_text()  # both attempts, appended
    assert "boom" in log and "fine" in log and log.count("$ ") == 2


def test_ray_task_resources_come_from_the_config(tmp_path):
    _write(tmp_path / "gpu.yaml", "trainer: {accelerator: gpu, devices: 4}\n")
    f = _write(
        tmp_path / "s.yaml",
        f"base: {TINY}\nseeds: [0]\n"
        "methods:\n  cpu: []\n  gpu: [gpu.yaml]\n  two: [gpu.yaml, '--trainer.devices 2']\n",
    )
    study = load_study(f)
    runs = {r.method: r for r in plan(study, tmp_path / "o")}
    assert ray_resources(study, runs["cpu"]) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert ray_resources(study, runs["gpu"]) == {"num_cpus": 1.0, "num_gpus": 4.0}
    assert ray_resources(study, runs["two"]) == {"num_cpus": 1.0, "num_gpus": 2.0}
    _write(tmp_path / "gpu.yaml", "trainer: {accelerator: auto, devices: [0, 1, 2]}\n")
    assert ray_resources(study, runs["gpu"]) == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert ray_resources(study, runs["gpu"], cluster_gpus=8) == {"num_cpus": 1.0, "num_gpus": 3.0}
    _write(f, f.read_text() + "ray_resources: {num_gpus: 1, num_cpus: 8}\n")
    study = load_study(f)
    assert ray_resources(study, runs["cpu"]) == {"num_gpus": 1, "num_cpus": 8}


# ---------------------------------------------------------------- compare on written metrics


def _metrics(path: Path, rows: list[dict[str, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _run(study: Path, method: str, seed: int, val: list[float], wall: float) -> None:
    rows = [{"step": s, "val/success": v} for s, v in zip((0, 2, 4), val, strict=True)]
    rows += [{"step": s, "rollout/success_rate": 0.1 * s, "cost/wall_s": wall} for s in range(5)]
    _metrics(study / method / f"seed{seed}" / "version_0" / "metrics.csv", rows)


def _colours(png: Path) -> int:
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png)
    return len(np.unique(img.reshape(-1, img.shape[-1]), axis=0))


def test_compare_table_and_plots_on_hand_numbers(tmp_path):
    s = tmp_path / "study"
    # grpo seed 0 first logs 0.9 at update 4, then a resumed run (version_1) logs 0.4 at
    # update 4 again (later versions win) and continues to update 6
    for seed, val in enumerate(([0.0, 0.2, 0.9], [0.1, 0.1, 0.1], [0.0, 0.4, 0.2])):
        _run(s, "grpo", seed, val, 10.0)
    _metrics(
        s / "grpo" / "seed0" / "version_1" / "metrics.csv",
        [{"step": 4, "val/success": 0.4}, {"step": 6, "val/success": 0.4}],
    )
    for seed, val in enumerate(([0.0, 0.4, 0.6], [0.1, 0.3, 0.3], [0.0, 0.4, 0.5])):
        _run(s, "vh", seed, val, 20.0)
    assert read_run(s / "grpo" / "seed0")["val/success"] == {0: 0.0, 2: 0.2, 4: 0.4, 6: 0.4}
    _write(s / "study.json", json.dumps({"baseline": "grpo", "methods": ["grpo", "vh"]}))

    md = compare([s], s / "compare", None, None)
    assert (s / "compare" / "compare.md").read_text() == md
    # finals: grpo 0.4, 0.1, 0.2; vh 0.6, 0.3, 0.5 -> differences 0.2, 0.2, 0.3:
    # mean 0.233333, s = sqrt((2 * 0.033333^2 + 0.066667^2) / 2) = 0.057735,
    # s.e. = 0.057735 / sqrt(3) = 0.033333, t_{0.975,2} = 4.3027 -> half-width 0.143423
    assert "| vh | 3 | 0.233 ± 0.143 |" in md
    assert "s0: +0.200, s1: +0.200, s2: +0.300" in md
    # vh finals mean (0.6 + 0.3 + 0.5) / 3 = 0.467; wall 20 s vs 10 s -> 2.00x
    vh_row = next(line for line in md.splitlines() if line.startswith("| vh | 3 | 0.467"))
    assert "2.00x" in vh_row
    # AUC / range, vh: seed 0 (2 * (0 + 0.4) / 2 + 2 * (0.4 + 0.6) / 2) / 4 = 0.35,
    # seed 1 (0.4 + 0.6) / 4 = 0.25, seed 2 (0.4 + 0.9) / 4 = 0.325 -> mean 0.308
    assert "| 0.308 ± " in vh_row
    # grpo: seed 0 (0.2 + 0.6 + 0.8) / 6 = 0.266667, seed 1 0.1, seed 2 (0.4 + 0.6) / 4 = 0.25;
    # paired AUC differences 0.083333, 0.15, 0.075 -> mean 0.103
    paired_row = next(line for line in md.splitlines() if line.startswith("| vh | 3 | 0.233"))
    assert "| 0.103 ± " in paired_row
    # power of Δ final: paired SD 0.057735; MDD = (t_{0.975,2} + t_{0.8,2}) * SD / sqrt(3)
    # = (4.3027 + 1.0607) * 0.057735 / 1.7321 = 0.179; seeds for +0.1:
    # n = 4: (3.1824 + 0.9785) * 0.057735 / 2 = 0.1201 > 0.1,
    # n = 5: (2.7764 + 0.9410) * 0.057735 / 2.2361 = 0.0960 <= 0.1 -> 5
    assert "| paired SD | MDD (80%) | seeds for +0.1 |" in md
    assert paired_row.endswith("| s0: +0.200, s1: +0.200, s2: +0.300 | 0.058 | 0.179 | 5 |")
    assert "MDD (80%) = (t_{0.975,n-1} + t_{0.8,n-1}) · SD / sqrt(n)" in md
    assert heldout_keys([]) == []
    assert "| grpo | 3 |" in md
    assert md.index("| grpo | 3 |") < md.index("| vh | 3 |")  # the study's method order
    # grpo seed 0 ends at update 6, the others at 4: reported
    assert "grpo: val/success ends at different updates over seeds: [4, 6]" in md
    for name in ("val_success.png", "rollout_success_rate.png"):
        assert _colours(s / "compare" / name) > 10, name
    assert "Not logged by any run: zero-signal fraction, extra-token ratio, GPU-hours" in md


def test_compare_warns_when_seed_sets_differ(tmp_path):
    s = tmp_path / "study"
    _run(s, "grpo", 0, [0.0, 0.1, 0.2], 1.0)
    _run(s, "grpo", 1, [0.0, 0.1, 0.2], 1.0)
    _run(s, "vh", 0, [0.0, 0.1, 0.3], 1.0)
    _run(s, "vh", 2, [0.0, 0.1, 0.3], 1.0)
    md = compare(
        [s / "grpo" / "seed0", s / "grpo" / "seed1", s / "vh"], tmp_path / "c", "grpo", None
    )
    assert "methods have different seed sets" in md
    assert "seeds only in vh: [2], only in grpo: [1] (paired on [0])" in md


def test_compare_power_columns_one_seed_sd_zero_and_the_effect_flag(tmp_path, capsys):
    from salvage.compare import main

    s = tmp_path / "study"
    for seed, (g, v, d) in enumerate(((0.1, 0.4, 0.2), (0.3, 0.5, 0.4), (0.2, 0.6, 0.3))):
        _run(s, "grpo", seed, [0.0, 0.0, g], 1.0)
        _run(s, "vh", seed, [0.0, 0.0, v], 1.0)  # differences 0.3, 0.2, 0.4: mean 0.3, sd 0.1
        _run(s, "drgrpo", seed, [0.0, 0.0, d], 1.0)  # grpo + 0.1 on every seed: sd 0
    _run(s, "one", 0, [0.0, 0.0, 0.5], 1.0)  # a single seed
    main([str(s), "--baseline", "grpo", "--effect", "0.05", "--out", str(tmp_path / "c")])
    md = capsys.readouterr().out
    assert "| paired SD | MDD (80%) | seeds for +0.05 |" in md
    # vh: sd 0.1, MDD (4.3027 + 1.0607) * 0.1 / sqrt(3) = 0.310; seeds for +0.05 at sd 0.1:
    # the smallest n with (t_{0.975,n-1} + t_{0.8,n-1}) / sqrt(n) <= 0.5: 34 (as at sd 0.2
    # for +0.1, test_stats)
    vh = next(x for x in md.splitlines() if x.startswith("| vh | 3 | 0.300"))
    assert vh.endswith("| 0.100 | 0.310 | 34 |")
    dr = next(x for x in md.splitlines() if x.startswith("| drgrpo | 3 |") and "s0:" in x)
    assert dr.endswith("| 0.000 | n/a (SD 0) | n/a (SD 0) |")
    one = next(x for x in md.splitlines() if x.startswith("| one | 1 |") and "s0:" in x)
    assert one.endswith("| n/a (1 seed) | n/a (1 seed) | n/a (1 seed) |")
    with pytest.raises(SystemExit):
        main([str(s), "--effect", "0", "--out", str(tmp_path / "c")])
    assert "--effect must be > 0" in capsys.readouterr().err


# ---------------------------------------------------------------- end to end, killed and resumed


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_PROGRESS="0",
    )
    return env


@pytest.mark.slow
def test_micro_study_killed_resumed_and_compared(tmp_path):
    """2 methods x 2 seeds x 1 update of the tiny GRPO config through ``salvage study``: the
    study process group is SIGKILLed while the second run is going, a finished run loses its
    marker (a crash after its checkpoint), and the next call finishes the study."""
    f = _write(
        tmp_path / "micro.yaml",
        f"base: {TINY}\n"
        "baseline: grpo\n"
        "seeds: [0, 1]\n"
        "overrides:\n"
        "  trainer.max_steps: 1\n"
        "  trainer.val_check_interval: 1\n"
        "  trainer.enable_progress_bar: false\n"
        "  data.init_args.val: {source: 'reasoning_gym:basic_arithmetic', size: 2, seed: 1}\n"
        "  data.init_args.prompts_per_step: 2\n"
        "  data.init_args.engine.max_new_tokens: 8\n"
        "methods:\n"
        "  grpo: []\n"
        "  drgrpo: [{data.init_args.advantage: drgrpo}]\n",
    )
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "salvage.cli", "study", str(f), "--out", str(out)]
    proc = subprocess.Popen(
        cmd, env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    first, second = out / "grpo" / "seed0", out / "grpo" / "seed1"
    deadline = time.time() + 300
    while not (first / "done.json").exists() or not (second / "fit.log").exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.time() < deadline
        time.sleep(0.2)
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGKILL)  # the study and the fit it is running
    proc.wait()
    assert not (second / "done.json").exists()
    assert first.glob("**/last.ckpt")
    (first / "done.json").unlink()  # crashed after writing its checkpoint, before the marker

    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 runs, 0 done, 4 to run" in res.stdout
    assert "resuming grpo seed 0" in res.stdout
    for m in ("grpo", "drgrpo"):
        for k in (0, 1):
            done = json.loads((out / m / f"seed{k}" / "done.json").read_text())
            assert done["returncode"] == 0
    resumed = json.loads((first / "done.json").read_text())["command"]
    assert resumed[-2:] == ["--ckpt_path", "last"]
    # a third call has nothing left to do
    res3 = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert res3.returncode == 0 and "4 runs, 4 done, 0 to run" in res3.stdout

    res = subprocess.run(
        [sys.executable, "-m", "salvage.cli", "compare", str(out)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    md = (out / "compare" / "compare.md").read_text()
    assert "Baseline: grpo" in md
    assert "| grpo | 2 |" in md and "| drgrpo | 2 |" in md
    assert "| drgrpo | 2 |" in md.split("Paired with the baseline")[1]
    for name in ("val_success.png", "rollout_success_rate.png", "cost_gpu_hours.png"):
        assert _colours(out / "compare" / name) > 10, name


@pytest.mark.slow
def test_ray_backend_runs_each_run_as_a_task(tmp_path):
    """One tiny run through ``--backend ray`` (a local Ray instance): done marker, metrics."""
    pytest.importorskip("ray")
    f = _write(
        tmp_path / "ray1.yaml",
        f"base: {TINY}\nseeds: [0]\n"
        "overrides: {trainer.max_steps: 1, trainer.enable_progress_bar: false, "
        "data.init_args.prompts_per_step: 2, data.init_args.engine.max_new_tokens: 8}\n"
        "methods: {grpo: []}\n",
    )
    out = tmp_path / "study"
    env = _env() | {"RAY_USAGE_STATS_ENABLED": "0"}
    cmd = [sys.executable, "-m", "salvage.cli", "study", str(f), "--out", str(out)]
    res = subprocess.run([*cmd, "--backend", "ray"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "'num_cpus': 1.0, 'num_gpus': 0.0" in res.stdout
    run = out / "grpo" / "seed0"
    assert json.loads((run / "done.json").read_text())["returncode"] == 0
    assert (run / "version_0" / "metrics.csv").is_file()


def test_prepare_steps_run_once_before_the_runs_and_a_failure_stops_the_study(
    tmp_path, monkeypatch, capsys
):
    # real `salvage` subcommands as set-up steps (compare on a tiny hand-made run dir, then an
    # export that must fail); the fits themselves are a quick stand-in
    from salvage import study as study_mod

    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "made_from/version_0/metrics.csv", "step,val/success\n0,0.5\n1,0.75\n")
    quick = [sys.executable, "-c", "print('fit')"]
    monkeypatch.setattr(study_mod.Run, "command", lambda self: quick)
    body = f"base: {TINY}\nseeds: [0]\nmethods: {{grpo: []}}\n"
    f = _write(
        tmp_path / "s.yaml",
        body + "prepare:\n  - {creates: made, run: compare made_from --out made}\n",
    )
    assert run_study(f, "o") == 0
    assert (tmp_path / "made" / "compare.md").is_file()
    assert "[prepare 1/1] salvage compare made_from --out made" in capsys.readouterr().out
    assert run_study(f, "o2") == 0  # `made` exists: the step is skipped
    assert "[prepare" not in capsys.readouterr().out
    bad = _write(
        tmp_path / "b.yaml",
        body + "prepare:\n  - {creates: nope, run: [export, no_such_run, out]}\n",
    )
    assert run_study(bad, "o3") == 1
    err = capsys.readouterr().err
    assert "prepare step 1 (salvage export no_such_run out) exited 2" in err
    assert not (tmp_path / "o3" / "grpo" / "seed0" / "done.json").exists()  # no run started
    wrong = _write(tmp_path / "w.yaml", body + "prepare:\n  - {creates: x}\n")
    with pytest.raises(ValueError, match=r"prepare\[0\].*exactly 'creates' and 'run'"):
        load_study(wrong)
