"""User errors: one line naming the file or key, through the ``salvage`` CLI.

Each case runs ``salvage.commands.cli.main`` in-process with the real config and the `tiny` model;
the error must come before any training, as ``salvage: error: ...`` (exit status 2), with
no traceback and no jsonargparse namespace dump; ``--debug`` shows the exception.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from salvage.commands.cli import main
from salvage.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[1]
MATH_TINY = str(ROOT / "configs" / "grpo" / "math_tiny.yaml")


def _cli_error(capsys, args):
    """Run the CLI, expect exit status 2; the one stderr line of the error."""
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Namespace(" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("salvage: error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def _fit_args(tmp_path, *extra):
    return [
        "fit",
        "--config",
        MATH_TINY,
        "--trainer.default_root_dir",
        str(tmp_path / "run"),
        "--trainer.enable_progress_bar",
        "false",
        *extra,
    ]


def test_yaml_error_in_the_second_config_file_names_it(tmp_path, capsys):
    bad = tmp_path / "second.yaml"
    bad.write_text("trainer:\n  max_steps: [1\n")
    line = _cli_error(capsys, ["fit", "--config", MATH_TINY, "--config", str(bad)])
    assert str(bad) in line and "not valid YAML" in line and "line 3" in line
    assert MATH_TINY not in line


@pytest.mark.parametrize(
    ("name", "content", "what"),
    [
        ("binary.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not a text file"),
        (
            "latin1.jsonl",
            '{"id": 1, "problem": "café?", "answer": "4"}\n'.encode("latin-1"),
            "not UTF-8",
        ),
        ("corrupt.parquet", b"PAR1 this is not a parquet body", "not a readable parquet file"),
    ],
)
def test_unreadable_math_file_is_named(tmp_path, capsys, name, content, what):
    p = tmp_path / name
    p.write_bytes(content)
    line = _cli_error(capsys, _fit_args(tmp_path, "--data.init_args.train.source", str(p)))
    assert str(p) in line and what in line


def test_duplicate_task_ids_are_one_line_naming_the_file(tmp_path, capsys):
    p = tmp_path / "dup.jsonl"
    p.write_text(
        json.dumps({"id": 1, "problem": "What is 2+2?", "answer": "4"})
        + "\n"
        + json.dumps({"id": 1, "problem": "What is 10*10?", "answer": "100"})
        + "\n"
    )
    line = _cli_error(capsys, _fit_args(tmp_path, "--data.init_args.train.source", str(p)))
    assert str(p) in line and "line 2 repeats the id of line 1" in line


def test_missing_local_model_path_is_named(tmp_path, capsys):
    missing = tmp_path / "models" / "my-qwen"
    line = _cli_error(
        capsys, _fit_args(tmp_path, "--model.init_args.policy.name_or_path", str(missing))
    )
    assert str(missing) in line and "does not exist" in line and "Repo id" not in line


def test_max_steps_zero_is_refused_before_anything_loads(tmp_path, capsys):
    # the model path does not exist either: the max_steps refusal comes first
    line = _cli_error(
        capsys,
        _fit_args(
            tmp_path,
            "--trainer.max_steps",
            "0",
            "--model.init_args.policy.name_or_path",
            str(tmp_path / "nope"),
        ),
    )
    assert "trainer.max_steps" in line and "got 0" in line
    assert not (tmp_path / "run").exists()


def test_malformed_webshop_json_is_named(tmp_path, capsys):
    pytest.importorskip("bm25s", reason="the webshop extra is not installed")
    d = tmp_path / "webshop"
    d.mkdir()
    (d / "items_shuffle_1000.json").write_text(json.dumps({"asin": "B0001"}))  # not a list
    (d / "items_ins_v2_1000.json").write_text("{}")
    (d / "items_human_ins.json").write_text("{}")
    line = _cli_error(
        capsys,
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "agent" / "webshop_tiny.yaml"),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--data.init_args.env.train_tasks.data_dir",
            str(d),
        ],
    )
    assert str(d / "items_shuffle_1000.json") in line and "expected a list of products" in line


def test_stored_log_with_nan_logprobs_is_named(tmp_path, capsys):
    log_dir = tmp_path / "partner" / "rollouts"
    log_dir.mkdir(parents=True)
    bad = log_dir / "step_000000.json"
    response = {"text": "\\boxed{1}", "logprobs": [-0.5, float("nan")], "finish_reason": "stop"}
    bad.write_text(
        json.dumps({"step": 0, "prompts": [{"task_id": "x/1", "responses": [response]}]})
    )
    line = _cli_error(
        capsys,
        _fit_args(
            tmp_path,
            "--config",
            str(ROOT / "configs" / "graft" / "stored_receiver.yaml"),
            "--trainer.callbacks.init_args.dirpath",
            str(log_dir),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ),
    )
    assert str(bad) in line and "nan" in line and "learning rate" not in line


def test_debug_shows_the_exception(tmp_path):
    bad = tmp_path / "second.yaml"
    bad.write_text("trainer: {max_steps: 1\n")
    with pytest.raises(ConfigError, match="second.yaml"):
        main(["fit", "--config", MATH_TINY, "--config", str(bad), "--debug"])
    p = tmp_path / "latin1.jsonl"
    p.write_bytes('{"problem": "café", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="latin1.jsonl"):
        main(["--debug", *_fit_args(tmp_path, "--data.init_args.train.source", str(p))])


def test_model_source_check_tells_paths_from_hub_ids(tmp_path):
    from salvage.models import check_model_source

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "pytorch_model.bin").write_bytes(b"")
    for ok in ("tiny", "Qwen/Qwen2.5-1.5B-Instruct", "gpt2", str(model)):
        check_model_source(ok)  # builtin, hub ids, a model directory
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty directory"):
        check_model_source(str(tmp_path / "empty"))
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file; expected a Hugging Face model directory"):
        check_model_source(str(f))
    for missing in ("./models/mine", "~/no/such/model", "/abs/no/such/model", "a/b/c"):
        with pytest.raises(ConfigError, match="does not exist"):
            check_model_source(missing)
