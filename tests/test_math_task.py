"""Math reward (real math-verify) and math data loading."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import shared_data

from salvage.tasks.math import (
    PROMPT_SUFFIX,
    MathData,
    MathVerifyReward,
    last_boxed,
    load_math_tasks,
)


def test_last_boxed_takes_the_last_and_balances_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("no answer") is None
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("\\boxed {42}") == "42"


@pytest.mark.parametrize(
    ("response", "gold", "expected"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{27}", "27", 1.0),
        ("first \\boxed{3} then corrected \\boxed{4}", "4", 1.0),
        ("first \\boxed{4} then corrected \\boxed{3}", "4", 0.0),
        ("the answer is 4", "4", 0.0),  # no \boxed{} -> 0
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{}", "1", 0.0),
    ],
)
def test_math_verify_reward(response, gold, expected):
    r = MathVerifyReward()(response, gold)
    assert r.reward == expected
    assert r.success is (expected == 1.0)


def test_verifier_timeout_scores_zero_and_is_counted():
    reward = MathVerifyReward(timeout_s=1)
    r = reward("\\boxed{9^{9^{9^{9}}}}", "3")
    assert (r.reward, r.success, r.timed_out) == (0.0, False, True)
    assert reward.timeouts == 1
    # the verifier still works afterwards
    assert reward("\\boxed{3}", "3").success


def test_jsonl_loading_skips_malformed_rows_and_reports_them(tmp_path, caplog):
    p = tmp_path / "mini.jsonl"
    rows = [
        json.dumps({"problem": "What is 1+1?", "answer": "2", "unique_id": "a"}),
        "{not json",
        json.dumps({"problem": "", "answer": "3"}),
        json.dumps({"problem": "What is 2+2?", "answer": None}),
        json.dumps({"problem": "AMC-style", "answer": 27.0}),
        json.dumps({"problem": "Minerva-style", "solution": "so \\boxed{5}"}),
    ]
    p.write_text("\n".join(rows) + "\n")
    tasks, report = load_math_tasks(MathData(source=str(p)))
    assert [t.answer for t in tasks] == ["2", "27", "5"]
    assert tasks[0].id == "mini/a"
    assert tasks[0].messages[0]["content"].endswith(PROMPT_SUFFIX)
    assert report["rows"] == 6 and report["skipped"] == 3
    assert "invalid JSON" in report["examples"][0]
    assert "skipped 3 malformed rows" in caplog.text


def test_parquet_verl_layout_skips_empty_ground_truth(tmp_path):
    msgs = [{"role": "user", "content": "Find x. " + PROMPT_SUFFIX}]
    table = pa.Table.from_pylist(
        [
            {
                "prompt": msgs,
                "reward_model": {"ground_truth": "7", "style": "rule"},
                "level": "Level 1",
            },
            {
                "prompt": msgs,
                "reward_model": {"ground_truth": "", "style": "rule"},
                "level": "Level 2",
            },
        ]
    )
    p = tmp_path / "train.parquet"
    pq.write_table(table, p)
    tasks, report = load_math_tasks(MathData(source=str(p)))
    assert len(tasks) == 1 and tasks[0].answer == "7" and report["skipped"] == 1
    assert tasks[0].messages == msgs  # the suffix is already there: not added twice


def test_bad_sources_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        MathData(source=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="expected reasoning_gym"):
        MathData(source=str(tmp_path / "x.csv"))
    with pytest.raises(ValueError, match="reasoning-gym cannot build"):
        load_math_tasks(MathData(source="reasoning_gym:no_such_task"))


def test_reasoning_gym_tasks_are_verifiable_offline():
    tasks, _ = load_math_tasks(MathData(source="reasoning_gym:basic_arithmetic", size=20, seed=3))
    assert len(tasks) == 20
    again, _ = load_math_tasks(MathData(source="reasoning_gym:basic_arithmetic", size=20, seed=3))
    assert [t.messages for t in tasks] == [t.messages for t in again]
    reward = MathVerifyReward()
    for t in tasks[:5]:
        assert reward(f"\\boxed{{{t.answer}}}", t.answer).success


@pytest.mark.parametrize(
    ("name", "n"),
    [
        ("math500.jsonl", 500),
        ("aime24.jsonl", 30),
        ("aime25.jsonl", 30),
        ("amc23.jsonl", 40),
        ("minerva_math.jsonl", 272),
        ("math_train.parquet", 7497),  # 7500 rows, 2 without an answer, 1 repeated problem
    ],
)
def test_shared_math_files_load_as_they_are(name, n):
    p = shared_data(f"math/{name}")
    tasks, _ = load_math_tasks(MathData(source=str(p)))
    assert len(tasks) == n
    assert all(t.answer for t in tasks)


def test_eval_harness_on_a_slice_of_each_benchmark_prints_the_table(tmp_path):
    """`salvage test` with `tiny` on 5 problems of each of the 5 benchmarks (numbers ~0)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    shared_data("math/math500.jsonl")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "salvage",
            "test",
            "--config",
            "configs/grpo/math_tiny.yaml",
            "--config",
            "configs/eval/math5_slice.yaml",
            "--data.init_args.val_samples",
            "2",
            "--data.init_args.engine.max_new_tokens",
            "16",
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.enable_progress_bar",
            "false",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.replace("│", " ")
    for name in ("math500", "aime2024", "aime2025", "amc23", "minerva"):
        assert f"eval/success/{name}" in out, name
    assert "eval/aggregate" in out


# ---------------------------------------------------------------- task identity


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rollout_prompts(dm, tasks, tiny):
    """The prompt text each task's group was sampled from, through the datamodule."""
    from salvage.rollout.config import EngineConfig, build_engine

    model, tok = tiny
    engine = build_engine(EngineConfig(max_new_tokens=2), model, tok)
    batch = dm.rollout(tasks, n=2, seed=0, engine=engine, tokenizer=tok, advantages=False)
    return {
        g.task_id: (tok.decode(g.trajectories[0].turns[0].prompt_ids), g.task["answer"])
        for g in batch.groups
    }


def test_duplicate_row_ids_in_one_file_are_refused_naming_file_and_rows(tmp_path):
    from salvage.datamodules.rlvr import RLVRDataModule
    from salvage.errors import DataError

    p = _jsonl(
        tmp_path / "dup.jsonl",
        [
            {"id": 1, "problem": "What is 2+2?", "answer": "4"},
            {"id": 1, "problem": "What is 10*10?", "answer": "100"},
        ],
    )
    dm = RLVRDataModule(train=MathData(source=str(p)), prompts_per_step=1, group_size=2)
    with pytest.raises(DataError) as e:
        dm.setup("fit")
    msg = str(e.value)
    assert str(p) in msg and "line 2" in msg and "line 1" in msg and "'dup/1'" in msg
    # an id of 0 is an id: it cannot collide with a row that has no id at position 0
    q = _jsonl(
        tmp_path / "zero.jsonl",
        [
            {"problem": "What is 3+3?", "answer": "6"},
            {"id": 0, "problem": "What is 5+5?", "answer": "10"},
        ],
    )
    with pytest.raises(DataError, match="line 2 repeats the id of line 1"):
        load_math_tasks(MathData(source=str(q)))


def test_sources_sharing_a_file_stem_keep_their_own_prompts(tmp_path, tiny):
    """aime/test.jsonl and amc/test.jsonl: same stem, same row ids, different problems."""
    from salvage.datamodules.rlvr import RLVRDataModule

    aime = _jsonl(
        tmp_path / "aime" / "test.jsonl", [{"id": 1, "problem": "What is 2+2?", "answer": "4"}]
    )
    amc = _jsonl(
        tmp_path / "amc" / "test.jsonl", [{"id": 1, "problem": "What is 10*10?", "answer": "100"}]
    )
    # two sources of one split
    dm = RLVRDataModule(val=[MathData(source=str(aime)), MathData(source=str(amc))])
    dm.setup("validate")
    tasks = dm.tasks["val"]
    assert [t.id for t in tasks] == ["aime/test/1", "amc/test/1"]
    assert dm.benchmarks("val") == ["aime/test", "amc/test"]  # not merged into one "test"
    got = _rollout_prompts(dm, tasks, tiny)
    assert "What is 2+2?" in got["aime/test/1"][0] and got["aime/test/1"][1] == "4"
    assert "What is 10*10?" in got["amc/test/1"][0] and got["amc/test/1"][1] == "100"
    # one file per split: both tasks are "test/1", yet the prompt cache (shared across
    # splits) serves each its own prompt
    dm = RLVRDataModule(
        train=MathData(source=str(aime)), val=MathData(source=str(amc)), prompts_per_step=1
    )
    dm.setup("fit")
    train, val = dm.tasks["train"][0], dm.tasks["val"][0]
    assert train.id == val.id == "test/1"
    assert "What is 2+2?" in _rollout_prompts(dm, [train], tiny)["test/1"][0]
    prompt, answer = _rollout_prompts(dm, [val], tiny)["test/1"]
    assert "What is 10*10?" in prompt and "2+2" not in prompt and answer == "100"


def test_sources_nothing_tells_apart_are_refused_unless_named(tmp_path):
    from salvage.datamodules.rlvr import RLVRDataModule
    from salvage.errors import ConfigError

    same = MathData(source="reasoning_gym:basic_arithmetic", size=4)
    dm = RLVRDataModule(val=[same, MathData(source="reasoning_gym:basic_arithmetic", size=4)])
    with pytest.raises(ConfigError, match=r"data\.val\[0\].*data\.val\[1\].*distinct `name`"):
        dm.setup("validate")
    named = [
        MathData(source="reasoning_gym:basic_arithmetic", size=4, name="easy"),
        MathData(
            source="reasoning_gym:basic_arithmetic", size=4, name="hard", rg_kwargs={"min_terms": 4}
        ),
    ]
    dm = RLVRDataModule(val=named)
    dm.setup("validate")
    ids = [t.id for t in dm.tasks["val"]]
    assert ids[:4] == [f"easy/0-{i}" for i in range(4)] and ids[4:] == [
        f"hard/0-{i}" for i in range(4)
    ]


def test_source_labels_take_as_much_of_the_path_as_tells_files_apart(tmp_path):
    from salvage.tasks.math import source_labels

    paths = ["a/x/test.jsonl", "b/x/test.jsonl", "c/train.jsonl", "math500.jsonl"]
    for p in paths:
        _jsonl(tmp_path / p, [{"problem": "1+1?", "answer": "2"}])
    sources = [MathData(source=str(tmp_path / p)) for p in paths]
    assert source_labels(sources) == ["a/x/test", "b/x/test", "train", "math500"]
    # the same file twice: only names tell them apart
    twice = [MathData(source=str(tmp_path / "math500.jsonl"), name=n) for n in ("x", "y")]
    assert source_labels(twice) == ["x", "y"]


def test_lone_surrogates_and_non_finite_answers_are_refused_at_load_naming_the_row(tmp_path):
    from salvage.errors import DataError

    good = json.dumps({"id": 1, "problem": "What is 2+2?", "answer": "4"})
    for n, (line, what) in enumerate(
        [
            ('{"id": 2, "problem": "What is \\ud800?", "answer": "6"}', "lone surrogate"),
            ('{"id": 2, "problem": "What is 1+1?", "answer": "\\udfff"}', "lone surrogate"),
            ('{"id": 2, "problem": "What is 0/0?", "answer": NaN}', "'nan'"),
            ('{"id": 2, "problem": "What is 1/0?", "answer": Infinity}', "'inf'"),
            ('{"id": 2, "problem": "What is 1/0?", "answer": "-inf"}', "'-inf'"),
        ]
    ):
        p = tmp_path / f"bad{n}.jsonl"
        p.write_text(good + "\n" + line + "\n", encoding="utf-8")
        with pytest.raises(DataError, match="line 2") as e:
            load_math_tasks(MathData(source=str(p)))
        assert str(p) in str(e.value) and what in str(e.value)
    # LaTeX infinity is a math answer, not a float: it loads and scores
    p = tmp_path / "infty.jsonl"
    p.write_text(json.dumps({"problem": "lim 1/x^2 at 0?", "answer": "\\infty"}) + "\n")
    tasks, _ = load_math_tasks(MathData(source=str(p)))
    assert MathVerifyReward()("\\boxed{\\infty}", tasks[0].answer).success


@pytest.mark.parametrize("gold", ["4", "nan", "NaN"])
def test_a_nan_answer_never_scores(gold):
    reward = MathVerifyReward()
    for response in ("\\boxed{nan}", "\\boxed{NaN}", "\\boxed{-nan}", "\\boxed{\\text{nan}}"):
        r = reward(response, gold)
        assert (r.reward, r.success) == (0.0, False), response


def test_a_gold_answer_whose_parse_times_out_is_parsed_once(monkeypatch):
    from math_verify.errors import TimeoutException

    reward = MathVerifyReward(timeout_s=1)
    calls: list[str] = []
    real = reward._parse

    def parse(latex: str):
        calls.append(latex)
        if latex == "slow":
            raise TimeoutException("parse timed out")
        return real(latex)

    monkeypatch.setattr(reward, "_parse", parse)
    results = [reward(f"\\boxed{{{k}}}", "slow") for k in range(5)]
    assert calls.count("slow") == 1  # parsed once, cached as failed
    assert results[0].timed_out and all(r.reward == 0.0 for r in results)
    assert reward.timeouts == 1 and reward.errors == 4
    assert reward("\\boxed{3}", "3").success  # other answers are unaffected
