"""Bad inputs, as a new user would give them, through the real ``salvage`` CLI.

Each row of ``CASES`` builds one bad input under a temporary dir and runs
``python -m salvage ...`` on it as a subprocess; the run must end with the row's exit
status (2: a user error), print at most 3 lines (stdout and stderr together) and name the
file or key and the value in its message. The rows run side by side once per module
(``results``), so the file stays short although every row starts a Python; rows that need a
finished run share one tiny run (``finished_run``, built once). Add a row for every bad
input a probe finds.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shutil
import struct
import subprocess
import sys
import types
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests import forked_cli

ROOT = Path(__file__).resolve().parents[1]
MATH_TINY = str(ROOT / "configs" / "grpo" / "math_tiny.yaml")
GRAFT_TINY_A = str(ROOT / "configs" / "grpo" / "graft_tiny_a.yaml")
QUIET = ["--trainer.enable_progress_bar", "false"]
MAX_LINES = 3


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        WANDB_MODE="offline",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _cli(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``python -m salvage ARGS``, a process of its own forked after the imports
    (``tests/forked_cli.py``: ~8 s of imports a command saved)."""
    return forked_cli.run(args, cwd, _env(), timeout=timeout)


# ---------------------------------------------------------------- bad inputs, built in t


def _fit(t: Path, *extra: str, sub: str = "fit") -> list[str]:
    return [
        sub,
        "--config",
        MATH_TINY,
        "--trainer.default_root_dir",
        str(t / "run"),
        *QUIET,
        *extra,
    ]


def _copy_ckpt(run: Path, t: Path, name: str, cut: float | None) -> Path:
    src = run / "version_0" / "checkpoints" / "last.ckpt"
    data = src.read_bytes()
    out = t / name
    out.write_bytes(data if cut is None else data[: int(len(data) * cut)])
    return out


def _unsafe_ckpt(t: Path) -> Path:
    p = t / "unsafe.ckpt"
    torch.save({"state_dict": {}, "when": datetime.timedelta(days=1)}, p)  # not weights-only
    return p


def _model_dir(t: Path, kind: str) -> Path:
    d = t / f"model_{kind}"
    d.mkdir()
    if kind == "empty":
        return d
    (d / "config.json").write_text(
        "{not json" if kind == "bad_config" else '{"model_type": "llama"}'
    )
    if kind == "truncated":
        header = json.dumps(
            {"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 64 * 64 * 4]}}
        ).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    return d


def _jsonl(t: Path, name: str, text: str) -> Path:
    p = t / name
    p.write_text(text, encoding="utf-8")
    return p


def _metrics(path: Path, rows: list[dict[str, float]]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r if k != "step"})
    lines = [",".join(["step", *keys])]
    lines += [",".join([str(r["step"]), *(str(r.get(k, "")) for k in keys)]) for r in rows]
    (path / "metrics.csv").write_text("\n".join(lines) + "\n")


def _study_with_bad_json(t: Path) -> Path:
    s = t / "study"
    _metrics(s / "grpo" / "seed0" / "version_0", [{"step": 0, "val/success": 0.5}])
    (s / "study.json").write_text('{"baseline": "grpo", "methods": ["grp')
    return s


def _negative_cost_run(t: Path) -> Path:
    r = t / "negrun"
    _metrics(
        r / "version_0",
        [
            {"step": 0, "cost/gpu_hours": 0.1, "val/aggregate": 0.2},
            {"step": 1, "cost/gpu_hours": -0.5, "val/aggregate": 0.4},
        ],
    )
    return r


def _latin1_metrics_run(t: Path) -> Path:
    r = t / "latin1run"
    (r / "version_0").mkdir(parents=True)
    (r / "version_0" / "metrics.csv").write_bytes("step,note\n0,caf\xe9\n".encode("latin-1"))
    return r


def _tiny_study(t: Path, head: str = "", methods: str = "{grpo: []}") -> Path:
    return _jsonl(t, "s.yaml", f"{head}base: {MATH_TINY}\nseeds: [0]\nmethods: {methods}\n")


@dataclass
class Case:
    id: str
    build: Callable[[Path, Path], list[str]]
    """(the row's temporary dir, the shared finished run) -> the CLI arguments."""
    expect: Callable[[Path, Path], list[str]]
    """Strings the output must hold: the file or key, the value, what is wrong."""
    code: int = 2
    max_lines: int = MAX_LINES


def _here(*names: str) -> Callable[[Path, Path], list[str]]:
    return lambda t, run: [str(t / n) for n in names]


CASES = [
    # ---- checkpoints (fit / test / validate --ckpt_path, --ckpt_path last, export)
    Case(
        "ckpt_truncated_fit",
        lambda t, run: _fit(t, "--ckpt_path", str(_copy_ckpt(run, t, "cut.ckpt", 0.5))),
        lambda t, run: [str(t / "cut.ckpt"), "--ckpt_path", "truncated or corrupt"],
    ),
    Case(
        "ckpt_empty_test",
        lambda t, run: _fit(t, "--ckpt_path", str(_copy_ckpt(run, t, "e.ckpt", 0)), sub="test"),
        lambda t, run: [str(t / "e.ckpt"), "empty"],
    ),
    Case(
        "ckpt_garbage_validate",
        lambda t, run: _fit(
            t, "--ckpt_path", str(_jsonl(t, "g.ckpt", "not a checkpoint")), sub="validate"
        ),
        lambda t, run: [str(t / "g.ckpt"), "not a readable checkpoint"],
    ),
    Case(
        "ckpt_not_weights_only",
        lambda t, run: _fit(t, "--ckpt_path", str(_unsafe_ckpt(t))),
        lambda t, run: [str(t / "unsafe.ckpt"), "weights_only=True"],
    ),
    Case(
        "ckpt_last_truncated",
        lambda t, run: (
            shutil.copytree(run, t / "run"),
            _copy_ckpt(run, t / "run" / "version_0" / "checkpoints", "last.ckpt", 0.3),
            _fit(t, "--ckpt_path", "last"),
        )[-1],
        lambda t, run: [str(t / "run" / "version_0" / "checkpoints" / "last.ckpt"), "truncated"],
    ),
    Case(
        "export_truncated",
        lambda t, run: ["export", str(_copy_ckpt(run, t, "cut.ckpt", 0.5)), str(t / "out")],
        lambda t, run: [str(t / "cut.ckpt"), "truncated or corrupt"],
    ),
    # ---- model directories
    Case(
        "model_dir_empty",
        lambda t, run: _fit(
            t, "--model.init_args.policy.name_or_path", str(_model_dir(t, "empty"))
        ),
        lambda t, run: [str(t / "model_empty"), "empty directory"],
    ),
    Case(
        "model_bad_config_json",
        lambda t, run: _fit(
            t, "--model.init_args.policy.name_or_path", str(_model_dir(t, "bad_config"))
        ),
        lambda t, run: [str(t / "model_bad_config" / "config.json"), "not valid JSON", "line 1"],
    ),
    Case(
        "model_no_weights",
        lambda t, run: _fit(
            t, "--model.init_args.policy.name_or_path", str(_model_dir(t, "no_weights"))
        ),
        lambda t, run: [str(t / "model_no_weights"), "no weights"],
    ),
    Case(
        "model_truncated_safetensors",
        lambda t, run: _fit(
            t, "--model.init_args.policy.name_or_path", str(_model_dir(t, "truncated"))
        ),
        lambda t, run: [str(t / "model_truncated" / "model.safetensors"), "truncated", "178 bytes"],
    ),
    # ---- data
    Case(
        "data_source_is_a_directory",
        lambda t, run: (
            (t / "dir.jsonl").mkdir(),
            _fit(t, "--data.init_args.train.source", str(t / "dir.jsonl")),
        )[-1],
        lambda t, run: [str(t / "dir.jsonl"), "is a directory"],
    ),
    Case(
        "data_lone_surrogate",
        lambda t, run: _fit(
            t,
            "--data.init_args.train.source",
            str(
                _jsonl(
                    t,
                    "sur.jsonl",
                    '{"problem": "What is 2+2?", "answer": "4"}\n'
                    '{"problem": "What is 3+3? \\ud800", "answer": "6"}\n',
                )
            ),
        ),
        lambda t, run: [str(t / "sur.jsonl"), "line 2", "lone surrogate", "\\ud800"],
    ),
    Case(
        "data_nan_answer",
        lambda t, run: _fit(
            t,
            "--data.init_args.train.source",
            str(_jsonl(t, "nan.jsonl", '{"problem": "What is 0/0?", "answer": NaN}\n')),
        ),
        lambda t, run: [str(t / "nan.jsonl"), "line 1", "'nan'"],
    ),
    Case(
        "data_infinity_answer",
        lambda t, run: _fit(
            t,
            "--data.init_args.train.source",
            str(_jsonl(t, "inf.jsonl", '{"problem": "What is 1/0?", "answer": "Infinity"}\n')),
        ),
        lambda t, run: [str(t / "inf.jsonl"), "line 1", "'Infinity'"],
    ),
    # ---- numeric knobs (each refused before anything loads, naming the key and the value)
    Case(
        "lr_zero",
        lambda t, run: _fit(t, "--model.init_args.lr", "0"),
        lambda t, run: ["model.lr", "0.0", "must be > 0"],
    ),
    Case(
        "num_minibatches_zero",
        lambda t, run: _fit(t, "--model.init_args.num_minibatches", "0"),
        lambda t, run: ["model.num_minibatches", "=0"],
    ),
    Case(
        "micro_batch_size_zero",
        lambda t, run: _fit(t, "--model.init_args.micro_batch_size", "0"),
        lambda t, run: ["model.micro_batch_size", "=0"],
    ),
    Case(
        "group_size_one",
        lambda t, run: _fit(t, "--data.init_args.group_size", "1"),
        lambda t, run: ["data.group_size", "got 1"],
    ),
    Case(
        "prompts_per_step_zero",
        lambda t, run: _fit(t, "--data.init_args.prompts_per_step", "0"),
        lambda t, run: ["data.prompts_per_step", "got 0"],
    ),
    Case(
        "prompts_per_step_above_the_tasks",
        lambda t, run: _fit(t, "--data.init_args.prompts_per_step", "500"),
        lambda t, run: ["data.prompts_per_step=500", "200 training tasks"],
    ),
    Case(
        "max_new_tokens_zero",
        lambda t, run: _fit(t, "--data.init_args.engine.max_new_tokens", "0"),
        lambda t, run: ["engine.max_new_tokens", "got 0"],
    ),
    Case(
        "temperature_negative",
        lambda t, run: _fit(t, "--data.init_args.engine.temperature", "-1"),
        lambda t, run: ["engine.temperature", "got -1"],
    ),
    Case(
        "train_size_zero",
        lambda t, run: _fit(t, "--data.init_args.train.size", "0"),
        lambda t, run: ["size", "got 0"],
    ),
    Case(
        "max_prompt_tokens_too_small",
        lambda t, run: _fit(t, "--data.init_args.max_prompt_tokens", "4"),
        lambda t, run: ["data.max_prompt_tokens", "got 4"],
    ),
    # ---- studies, reports, comparisons, joint cost
    Case(
        "study_yaml_malformed",
        lambda t, run: ["study", str(_jsonl(t, "s.yaml", "name: x\nmethods: [a\n"))],
        lambda t, run: [str(t / "s.yaml"), "not valid YAML", "line 3"],
    ),
    Case(
        "study_file_not_utf8",
        lambda t, run: (
            (t / "s.yaml").write_bytes("name: caf\xe9\n".encode("latin-1")),
            ["study", str(t / "s.yaml")],
        )[-1],
        lambda t, run: [str(t / "s.yaml"), "not UTF-8", "0xe9"],
    ),
    Case(
        "compare_bad_study_json",
        lambda t, run: ["compare", str(_study_with_bad_json(t)), "--out", str(t / "cmp")],
        lambda t, run: [str(t / "study" / "study.json"), "not valid JSON"],
    ),
    Case(
        "report_missing_dir",
        lambda t, run: ["report", str(t / "nowhere")],
        lambda t, run: [str(t / "nowhere"), "does not exist"],
    ),
    Case(
        "report_empty_dir",
        lambda t, run: ((t / "empty").mkdir(), ["report", str(t / "empty")])[-1],
        lambda t, run: [str(t / "empty"), "no metrics.csv"],
    ),
    Case(
        "report_metrics_not_utf8",
        lambda t, run: ["report", str(_latin1_metrics_run(t))],
        lambda t, run: [str(t / "latin1run" / "version_0" / "metrics.csv"), "not UTF-8", "0xe9"],
    ),
    Case(
        "joint_cost_negative_gpu_hours",
        lambda t, run: ["joint-cost", str(_negative_cost_run(t))],
        lambda t, run: [str(t / "negrun"), "cost/gpu_hours", "-0.5", "step 1"],
    ),
    Case(
        "joint_cost_missing_run",
        lambda t, run: ["joint-cost", str(t / "nowhere")],
        lambda t, run: [str(t / "nowhere"), "does not exist"],
    ),
    # ---- parse errors: one line naming the key, the value, the reason (not the usage text)
    Case(
        "parse_unknown_key",
        lambda t, run: _fit(t, "--model.init_args.no_such_knob", "3"),
        lambda t, run: ["unknown key model.init_args.no_such_knob", "'3'", "--help"],
    ),
    Case(
        "parse_typo_names_the_nearest_key",
        lambda t, run: _fit(t, "--model.init_args.lrr", "3"),
        lambda t, run: ["model.init_args.lrr", "did you mean model.init_args.lr?"],
    ),
    Case(
        "parse_wrong_type",
        lambda t, run: _fit(t, "--model.init_args.lr", "fast"),
        lambda t, run: ["model.init_args.lr: expected a float, got 'fast'"],
    ),
    Case(
        "parse_not_finite",
        lambda t, run: _fit(t, "--model.init_args.lr", "nan"),
        lambda t, run: ["model.init_args.lr", "'nan' (not a finite number)"],
    ),
    Case(
        "parse_unknown_trainer_key",
        lambda t, run: _fit(t, "--trainer.max_stepz", "1"),
        lambda t, run: ["unknown key trainer.max_stepz", "did you mean trainer.max_steps"],
    ),
    Case(
        "parse_nested_value",
        lambda t, run: _fit(t, "--data.init_args.engine.temperature", "hot"),
        lambda t, run: ["data.init_args.engine.temperature: expected a float, got 'hot'"],
    ),
    # ---- run directories, paths and machine settings (refused before any model loads)
    Case(
        "root_dir_is_a_file",
        lambda t, run: _fit(t, "--trainer.default_root_dir", str(_jsonl(t, "afile", "x"))),
        lambda t, run: ["trainer.default_root_dir", str(t / "afile"), "is a file"],
    ),
    Case(
        "root_dir_under_a_file",
        lambda t, run: (
            _jsonl(t, "afile", "x"),
            _fit(t, "--trainer.default_root_dir", str(t / "afile" / "run")),
        )[-1],
        lambda t, run: [str(t / "afile" / "run"), f"{str(t / 'afile')!r} is a file"],
    ),
    Case(
        "ckpt_path_is_a_directory",
        lambda t, run: ((t / "d").mkdir(), _fit(t, "--ckpt_path", str(t / "d")))[-1],
        lambda t, run: ["--ckpt_path", str(t / "d"), "is a directory"],
    ),
    Case(
        "config_is_a_directory",
        lambda t, run: ((t / "cfg").mkdir(), ["fit", "--config", str(t / "cfg")])[-1],
        lambda t, run: ["--config", str(t / "cfg"), "is a directory"],
    ),
    Case(
        "seed_too_large",
        lambda t, run: _fit(t, "--seed_everything", "99999999999999999999"),
        lambda t, run: ["seed_everything", "99999999999999999999", "4294967295"],
    ),
    Case(
        "webshop_data_files_missing",
        lambda t, run: (
            (t / "ws").mkdir(),
            [
                "fit",
                "--config",
                str(ROOT / "configs" / "agent" / "webshop_tiny.yaml"),
                "--trainer.default_root_dir",
                str(t / "run"),
                "--data.init_args.env.train_tasks.data_dir",
                str(t / "ws"),
                *QUIET,
            ],
        )[-1],
        lambda t, run: [str(t / "ws"), "items_shuffle.json"],
    ),
    Case(
        "study_out_is_a_file",
        lambda t, run: ["study", str(_tiny_study(t)), "--out", str(_jsonl(t, "afile", "x"))],
        lambda t, run: ["--out", str(t / "afile"), "is a file"],
    ),
    Case(
        "study_named_dotdot",
        lambda t, run: ["study", str(_tiny_study(t, "name: '..'\n"))],
        lambda t, run: [str(t / "s.yaml"), "name='..'", "plain name"],
    ),
    Case(
        "study_method_maps_to_a_string",
        lambda t, run: ["study", str(_tiny_study(t, methods="{grpo: hello}"))],
        lambda t, run: [str(t / "s.yaml"), "methods.grpo='hello'", "not a file"],
    ),
    # ---- --debug: the traceback instead of the one line
    Case(
        "debug_shows_the_traceback",
        lambda t, run: ["--debug", *_fit(t, "--model.init_args.lr", "0")],
        lambda t, run: ["Traceback", "model.lr=0.0 must be > 0"],
        code=1,
        max_lines=10_000,
    ),
]


if not torch.cuda.is_available():  # the machines CI runs on
    CASES.append(
        Case(
            "accelerator_gpu_without_one",
            lambda t, run: _fit(t, "--trainer.accelerator", "gpu"),
            lambda t, run: ["trainer.accelerator 'gpu'", "no CUDA GPU"],
        )
    )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-update GRPO run with validation (``graft_tiny_a``), built once."""
    run = tmp_path_factory.mktemp("finished") / "run"
    proc = _cli(
        [
            "fit",
            "--config",
            GRAFT_TINY_A,
            "--trainer.max_steps",
            "2",
            "--trainer.default_root_dir",
            str(run),
            "--data.init_args.val.limit",
            "2",
            *QUIET,
        ],
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def results(
    tmp_path_factory, finished_run
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Every row, run side by side: id -> (its dir, the finished process)."""
    base = tmp_path_factory.mktemp("bad")

    def one(case: Case) -> tuple[Path, subprocess.CompletedProcess[str]]:
        t = base / case.id
        t.mkdir()
        return t, _cli(case.build(t, finished_run), t)

    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip([c.id for c in CASES], pool.map(one, CASES), strict=True))
    return done


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_naming_it(case, results, finished_run):
    t, proc = results[case.id]
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert proc.returncode == case.code, out[-3000:]
    assert len(lines) <= case.max_lines, out[-3000:]
    if case.max_lines == MAX_LINES:
        assert "Traceback" not in out and "Namespace(" not in out, out[-3000:]
    for want in case.expect(t, finished_run):
        assert want in out, f"{want!r} not in: {out[-3000:]}"


# ---------------------------------------------------------------- in-process cases


def test_disk_full_during_a_checkpoint_names_the_path_and_keeps_the_last_one(tmp_path, monkeypatch):
    from salvage import checkpointing
    from salvage.checkpointing import CheckpointWriteError, SafeCheckpointIO
    from salvage.errors import user_error

    target = tmp_path / "checkpoints" / "last.ckpt"
    io = SafeCheckpointIO()
    io.save_checkpoint({"global_step": 1}, target)
    before = target.read_bytes()

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpointing.os, "write", full)
    with pytest.raises(CheckpointWriteError) as e:
        io.save_checkpoint({"global_step": 2}, target)
    msg = str(e.value)
    assert str(target) in msg and "previous checkpoint is intact" in msg
    assert "No space left on device" in msg
    assert user_error(RuntimeError("wrapped")) is None
    assert user_error(e.value) is e.value  # the CLI prints it as one line, exit 2
    assert target.read_bytes() == before  # the previous checkpoint, whole
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]  # no partial left


def test_partials_of_a_live_writer_survive_a_new_run_in_the_same_dir(tmp_path):
    from salvage.checkpointing import RunConfigRecorder, remove_partials

    ck = tmp_path / "RUN" / "version_0" / "checkpoints"
    ck.mkdir(parents=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        alive_partial = ck / f".last.ckpt.partial-{live.pid}"
        dead_partial = ck / f".last.ckpt.partial-{dead.pid}"
        mine = ck / f".last.ckpt.partial-{os.getpid()}"
        for p in (alive_partial, dead_partial, mine):
            p.write_bytes(b"x")
        trainer = types.SimpleNamespace(
            checkpoint_callbacks=[types.SimpleNamespace(dirpath=str(ck))],
            is_global_zero=True,
            default_root_dir=str(tmp_path / "RUN"),
            loggers=[],
        )
        RunConfigRecorder("").setup(trainer, None, "fit")  # type: ignore[arg-type]
        assert alive_partial.exists()  # another run's write in flight
        assert not dead_partial.exists() and not mine.exists()
        live.kill()
        live.wait()
        assert remove_partials(ck) == [alive_partial]  # its writer is gone now
    finally:
        if live.poll() is None:
            live.kill()
            live.wait()


def test_a_salvage_test_into_a_copied_run_leaves_its_fit_history_readable(finished_run, tmp_path):
    """joint-cost and report read the fit versions of a run dir moved elsewhere, past the
    version a `salvage test` wrote into it."""
    from salvage.commands.joint_cost import run_checkpoint_cost
    from salvage.history import load_run, run_lineage

    run = tmp_path / "moved"
    shutil.copytree(finished_run, run)
    proc = _cli(
        [
            "test",
            "--config",
            GRAFT_TINY_A,
            "--trainer.default_root_dir",
            str(run),
            "--ckpt_path",
            "last",
            "--data.init_args.test",
            "{source: reasoning_gym:basic_arithmetic, size: 250, split_frac: 0.2, "
            "split_part: heldout, limit: 2, name: arith}",
            *QUIET,
        ],
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "version_1" / "stage.txt").read_text().strip() == "test"
    assert [v.name for v in run_lineage(run)] == ["version_0"]
    cost = run_checkpoint_cost(run)
    assert cost.step >= 1 and cost.gpu_hours > 0
    series, _, files = load_run(run)
    assert [f.parent.name for f in files] == ["version_0"]
    assert "val/aggregate" in series and not any(k.startswith("eval/") for k in series)


def test_a_run_dir_nobody_can_write_is_refused_naming_the_key():
    """Read-only run dirs (issue 47 item 3): chmod does not stop root, so the check is a real
    write probe; a dir under /proc refuses every writer, root included."""
    from pathlib import Path

    from salvage.commands.fit import check_run_dir
    from salvage.errors import ConfigError

    if not Path("/proc/1").is_dir():
        pytest.skip("no /proc here")
    with pytest.raises(
        ConfigError, match=r"trainer.default_root_dir '/proc/1/run' is not writable"
    ):
        check_run_dir("/proc/1/run")
