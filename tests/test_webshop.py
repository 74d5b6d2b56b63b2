"""WebShop: hand-worked scores, pages and actions, verified restore, the expert, data files, the CLI."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from salvage.core.agent import AgentFormat
from salvage.core.webshop import fuzzy_ratio, normalize_color, title_words, webshop_score
from salvage.datamodules.agent import EnvScoreMetrics
from salvage.envs import RestoreError, make_env
from salvage.envs.base import check_json
from salvage.envs.pool import EnvPool
from salvage.envs.webshop import WebShopEnv
from salvage.envs.webshop_synth import write_catalogue
from salvage.rollout.agent import AgentRunner, OraclePolicy, Start
from salvage.types import Group, RolloutBatch, Trajectory

for _mod in ("bm25s", "Stemmer", "rapidfuzz"):
    pytest.importorskip(
        _mod, reason="the webshop extra (bm25s, PyStemmer, rapidfuzz) is not installed"
    )

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(write_catalogue(tmp_path_factory.mktemp("webshop"), seed=0))


def _tasks(data, split="train", **kw):
    return WebShopEnv.list_tasks(split, data_dir=data, eval_goals=10, dev_goals=10, **kw)


# ---------------------------------------------------------------------- the score, by hand
GOAL = {
    "asin": "B000000001",
    "query": "shampoo",
    "name": "Lumora Tea Tree Shampoo for Dry Hair",
    "product_category": "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
    "attributes": ["sulfate free", "tea tree", "dry hair"],
    "goal_options": ["lavender", "travel bottle"],
    "price_upper": 30.0,
}


def _product(**over):
    p = {
        "query": "shampoo",
        "name": GOAL["name"],
        "Title": GOAL["name"],
        "product_category": GOAL["product_category"],
        "Attributes": ["sulfate free", "tea tree oil", "dry hair"],
        "BulletPoints": ["Gentle formula"],
        "Description": "A gentle everyday shampoo.",
    }
    p.update(over)
    return p


GOAL_OPTIONS = {"scent": "lavender", "size": "travel bottle"}


def test_goal_product_with_goal_options_within_price_scores_one():
    # 3 attributes ("tea tree" vs "tea tree oil": its tokens are a subset -> token_set_ratio 100 > 85),
    # 2 options, price 19.99 <= 30: s = 1.0 * (3 + 2 + 1) / (3 + 2 + 1) = 1
    s, info = webshop_score(_product(), GOAL, 19.99, GOAL_OPTIONS)
    assert (
        s == 1.0
        and info["r_type"] == 1.0
        and info["attr_matches"] == 3
        and info["option_matches"] == 2
    )


def test_each_missing_term_costs_one_sixth():
    # wrong option: coconut does not match lavender (token_set_ratio 13) -> (3 + 1 + 1) / 6
    s, _ = webshop_score(_product(), GOAL, 19.99, {"scent": "coconut", "size": "travel bottle"})
    assert s == pytest.approx(5 / 6)
    # an option left unchosen counts the same
    assert webshop_score(_product(), GOAL, 19.99, {"scent": "lavender"})[0] == pytest.approx(5 / 6)
    # missing attribute: "dry hair" neither among the attributes nor in title / features / description
    no_dry = _product(
        Attributes=["sulfate free", "tea tree"],
        name="Lumora Tea Tree Shampoo",
        Title="Lumora Tea Tree Shampoo",
    )
    assert webshop_score(no_dry, GOAL, 19.99, GOAL_OPTIONS)[0] == pytest.approx(5 / 6)
    # ... but found in the description it counts: back to 6 / 6
    described = dict(no_dry, Description="Made for dry hair.")
    assert webshop_score(described, GOAL, 19.99, GOAL_OPTIONS)[0] == 1.0
    # price over the limit: 30.01 > 30 -> (3 + 2 + 0) / 6
    assert webshop_score(_product(), GOAL, 30.01, GOAL_OPTIONS)[0] == pytest.approx(5 / 6)
    # all three at once: (2 + 1 + 0) / 6
    assert webshop_score(no_dry, GOAL, 31.0, {"scent": "lavender"})[0] == pytest.approx(3 / 6)


def test_wrong_product_type_scales_the_score():
    # goal type words: lumora tea tree shampoo dry hair (6; "for" is a function word)
    assert title_words(GOAL["name"]) == {"lumora", "tea", "tree", "shampoo", "dry", "hair"}
    # another query, 1 shared category level (< 2), 1 of 6 title words (0.167: >= 0.1, not > 0.2)
    # -> no match -> r_type 0.5; everything else matches: s = 0.5 * 6 / 6
    dryer = _product(
        query="hair dryer",
        name="Kestrel Hair Dryer Brush",
        Title="Kestrel Hair Dryer Brush",
        product_category="Beauty & Personal Care › Tools & Accessories › Hair Dryers",
    )
    s, info = webshop_score(dryer, GOAL, 19.99, GOAL_OPTIONS)
    assert (info["query_match"], info["category_match"]) == (False, False)
    assert info["title_score"] == pytest.approx(1 / 6) and info["r_type"] == 0.5 and s == 0.5
    # the same product found by the goal's query keeps r_type 1 (query match rescues it)
    assert webshop_score(dict(dryer, query="shampoo"), GOAL, 19.99, GOAL_OPTIONS)[0] == 1.0
    # 1 of 11 title words (0.09 < 0.1) -> r_type 0.1; none -> 0
    long_goal = dict(
        GOAL, name="Lumora Tea Tree Shampoo Dry Hair Argan Oil Scalp Care Salon Formula"
    )
    assert webshop_score(dryer, long_goal, 19.99, GOAL_OPTIONS)[1]["r_type"] == 0.1
    desk = _product(
        query="desk",
        name="Oakmere Standing Desk",
        Title="Oakmere Standing Desk",
        product_category="Home & Kitchen › Furniture › Desks",
    )
    assert webshop_score(desk, GOAL, 19.99, GOAL_OPTIONS)[0] == 0.0


def test_colour_normalisation_and_fuzzy_rule_as_the_original():
    # normalize_color takes the first listed colour contained: both are "blue", so they match
    assert normalize_color("navy blue") == normalize_color("light blue") == "blue"
    goal = dict(GOAL, goal_options=["navy blue"])
    s, info = webshop_score(_product(), goal, 1.0, {"color": "light blue"})
    assert info["option_matches"] == 1 and s == 1.0  # (3 + 1 + 1) / 5
    assert fuzzy_ratio("Tea-Tree!", "tea tree") == 100 and fuzzy_ratio("", "x") == 0
    # no goal options: denominator 3 + 0 + 1
    assert webshop_score(_product(), dict(GOAL, goal_options=[]), 99.0, {})[0] == pytest.approx(
        3 / 4
    )


# ---------------------------------------------------------------------- data files
def test_generator_writes_official_files_that_the_loader_reads(tmp_path, data):
    a, b = write_catalogue(tmp_path / "a", seed=0), write_catalogue(tmp_path / "b", seed=1)
    names = [
        "items_shuffle_1000.json",
        "items_ins_v2_1000.json",
        "items_human_ins.json",
        "reviews.json",
    ]
    assert sorted(p.name for p in a.iterdir()) == sorted(names)
    assert (a / names[0]).read_bytes() == (
        Path(data) / names[0]
    ).read_bytes()  # deterministic in the seed
    assert (a / names[0]).read_bytes() != (b / names[0]).read_bytes()
    items = json.loads((a / names[0]).read_text())
    human = json.loads((a / names[2]).read_text())
    assert len(items) == 200 and sum(len(v) for v in human.values()) == 50
    assert {
        "asin",
        "name",
        "category",
        "query",
        "product_category",
        "full_description",
        "small_description",
        "pricing",
        "customization_options",
        "images",
    } <= set(items[0])
    assert {"instruction", "instruction_attributes", "instruction_options"} <= set(
        next(iter(human.values()))[0]
    )
    train, val, test = _tasks(data), _tasks(data, "val"), _tasks(data, "test")
    assert len(train) == 30 and len(val) == len(test) == 10
    # the original ranges, scaled: test 0-9, dev 10-19, train 20-49 (disjoint)
    assert {t["goal_index"] for t in test} == set(range(10))
    assert {t["goal_index"] for t in val} == set(range(10, 20))
    assert {t["goal_index"] for t in train} == set(range(20, 50))
    by_asin = {p["asin"]: p for p in items}
    for t in train + val:
        g = t["goal"]
        assert g["asin"] in by_asin and t["family"] == by_asin[g["asin"]]["category"]
        assert g["instruction_text"].endswith(
            f", and price lower than {g['price_upper']:.2f} dollars"
        )
    # goal order: human goals in product order, shuffled with random.seed(233) (as the original)
    order = [p["asin"] for p in items if p["asin"] in human]
    random.Random(233).shuffle(order)
    assert [t["goal"]["asin"] for t in test + val + train] == order
    assert len(_tasks(data, num_tasks=3)) == 3
    assert {t["family"] for t in _tasks(data, families=["grocery"])} == {"grocery"}


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("WEBSHOP_DATA", raising=False)
    with pytest.raises(ValueError, match=r"data_dir.*WEBSHOP_DATA"):
        WebShopEnv.list_tasks("train")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        WebShopEnv.list_tasks("train", data_dir=str(tmp_path / "nowhere"))
    monkeypatch.setenv("WEBSHOP_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="items_shuffle"):
        WebShopEnv.list_tasks("train")
    write_catalogue(tmp_path / "x", seed=0)
    (tmp_path / "x" / "items_human_ins.json").unlink()
    with pytest.raises(FileNotFoundError, match="items_human_ins.json"):
        WebShopEnv.list_tasks("train", data_dir=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="train split is empty"):
        WebShopEnv.list_tasks(
            "train", data_dir=str(write_catalogue(tmp_path / "y"))
        )  # 50 goals < 500


# ---------------------------------------------------------------------- pages and actions
def test_pages_actions_and_invalid_actions(data):
    env = make_env("webshop", step_limit=50)
    task = _tasks(data)[0]
    obs, info = env.reset(task)
    instr = task["goal"]["instruction_text"]
    assert obs == f"WebShop [SEP] Instruction: [SEP] {instr} [SEP] Search"
    assert (
        info["admissible"] == ["search[<your query>]"] and info["score"] == 0.0 and not info["won"]
    )
    for bad in ("click[search]", "buy it", "click[next >]", "search[]"):
        res = env.step(bad)
        assert res.observation == obs and res.info["invalid_action"] and not res.done
    res = env.step("search[black]")  # many products come in black: several pages of results
    page1 = res.observation
    assert page1.startswith(
        f"Instruction: [SEP] {instr} [SEP] Back to Search [SEP] Page 1 (Total results: 50)"
    )
    asins = [a[len("click[") : -1] for a in res.info["admissible"] if a.startswith("click[b0")]
    assert len(asins) == 10 and res.info["admissible"][:2] == [
        "click[back to search]",
        "click[next >]",
    ]
    assert env.step("search[shampoo]").info[
        "invalid_action"
    ]  # the search bar is on the search page only
    res = env.step("click[next >]")
    assert "Page 2 (Total results: 50) [SEP] < Prev [SEP] Next >" in res.observation
    assert "click[< prev]" in res.info["admissible"] and asins[0].upper() not in res.observation
    assert env.step("click[< prev]").observation == page1
    res = env.step(f"click[{asins[0]}]")
    item = res.observation
    product = json.loads((Path(data) / "items_shuffle_1000.json").read_text())
    p = next(q for q in product if q["asin"] == asins[0].upper())
    assert f"[SEP] {p['name']} [SEP] Price: $" in item and item.endswith(
        "[SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
    )
    adm = res.info["admissible"]
    assert adm[:6] == [
        "click[back to search]",
        "click[< prev]",
        "click[description]",
        "click[features]",
        "click[reviews]",
        "click[buy now]",
    ]
    value = adm[6][len("click[") : -1]
    res = env.step(f"click[{value}]")
    assert f"< Prev [SEP] You have clicked {value}. [SEP]" in res.observation
    chosen = res.observation
    res = env.step("click[description]")
    assert res.observation.endswith(p["full_description"]) and res.info["admissible"] == [
        "click[back to search]",
        "click[< prev]",
    ]
    assert env.step("click[< prev]").observation == chosen  # the sub-page keeps the chosen option
    assert env.step("click[features]").observation.endswith(" [SEP] ".join(p["small_description"]))
    env.step("click[< prev]")
    env.step("click[reviews]")
    assert env.step("click[< prev]").observation == chosen
    assert env.step("click[< prev]").observation == page1  # back to the results: options dropped
    assert env.step("click[back to search]").observation == obs
    assert env.depth == 18 and not env._done


def _buy(env, task, asin, options):
    env.reset(task)
    res = env.step(f"search[{env._cat.by_asin[asin]['Title']}]")
    assert f"click[{asin.lower()}]" in res.info["admissible"]
    env.step(f"click[{asin.lower()}]")
    for v in options:
        assert not env.step(f"click[{v}]").info["invalid_action"]
    return env.step("click[buy now]")


def test_buying_in_the_environment_scores_as_worked_out(data):
    env = make_env("webshop")
    task = next(t for t in _tasks(data) if t["goal"]["goal_options"])
    g = task["goal"]
    n = len(g["attributes"]) + len(g["goal_options"]) + 1
    res = _buy(env, task, g["asin"], g["goal_options"])
    assert res.done and res.info["won"] and res.info["score"] == 1.0 == res.reward
    assert (
        "Your score (min 0.0, max 1.0) [SEP] 1.0" in res.observation
        and res.info["admissible"] == []
    )
    # one goal option swapped for another value of its group: one match fewer, (n - 1) / n
    options = env._cat.by_asin[g["asin"]]["options"]
    group = next(k for k, vs in options.items() if g["goal_options"][0] in vs)
    other = next(v for v in options[group] if v != g["goal_options"][0])
    res = _buy(env, task, g["asin"], [other, *g["goal_options"][1:]])
    assert res.info["score"] == pytest.approx((n - 1) / n) and not res.info["won"]
    # a product of another category whose title shares no type word: r_type 0, s = 0
    want = title_words(g["name"])
    wrong = next(
        p
        for p in env._cat.products
        if p["category"] != g["category"] and not title_words(p["name"]) & want
    )
    res = _buy(env, task, wrong["asin"], [])
    assert res.done and res.info["score"] == 0.0 and res.info["reward_info"]["r_type"] == 0.0


def test_episode_ends_at_the_step_cap_with_score_zero(data):
    env = WebShopEnv(step_limit=15)
    env.reset(_tasks(data)[0])
    for t in range(15):
        res = env.step("click[nothing]")
        assert res.done == (t == 14)
    assert res.info["score"] == 0.0 and not res.info["won"]


# ---------------------------------------------------------------------- expert and restore
def _expert_episode(env, task, detour=()):
    env.reset(task)
    snaps = [check_json(env.snapshot())]
    for a in detour:
        env.step(a)
        snaps.append(check_json(env.snapshot()))
    res = None
    while not env._done:
        res = env.step(env.oracle_action())
        snaps.append(check_json(env.snapshot()))
    return res, snaps


def test_expert_wins_every_goal_within_h_and_recovers_from_detours(data):
    env = make_env("webshop")
    tasks = _tasks(data) + _tasks(data, "val")
    for task in tasks:
        res, snaps = _expert_episode(env, task)
        assert res.info["won"] and len(snaps) - 1 <= 8
    # from a wrong item's description page, reached from the second results page, it finds its way
    env.reset(tasks[0])
    env.step("search[black]")
    adm = env.step("click[next >]").info["admissible"]
    wrong = next(
        a
        for a in adm
        if a.startswith("click[b0") and a != f"click[{tasks[0]['goal']['asin'].lower()}]"
    )
    res, snaps = _expert_episode(
        env, tasks[0], ["search[black]", "click[next >]", wrong, "click[description]"]
    )
    assert res.info["won"] and len(snaps) - 1 <= 15
    assert snaps[-1]["actions"][4:7] == ["click[< prev]", "click[< prev]", "click[back to search]"]


def test_restore_verifies_at_every_depth_and_rejects_tampering(data):
    env = make_env("webshop")
    task = next(t for t in _tasks(data) if t["goal"]["goal_options"])
    res, snaps = _expert_episode(env, task, ["search[black]", "click[next >]", "click[< prev]"])
    assert res.info["won"]
    fresh = make_env("webshop")
    for d, s in enumerate(snaps):
        assert len(s["actions"]) == d and fresh.restore(s) == s["observation"] and fresh.depth == d
    assert fresh.info["won"] and fresh.info["score"] == 1.0
    # the expert chose an option at depth k; another value of that group reaches another page
    k = next(
        i for i, a in enumerate(snaps[-1]["actions"]) if a[6:-1] in task["goal"]["goal_options"]
    )
    opts = env._cat.by_asin[task["goal"]["asin"]]["options"]
    chosen = snaps[-1]["actions"][k][6:-1]
    other = next(v for vs in opts.values() if chosen in vs for v in vs if v != chosen)
    bad = dict(
        snaps[k + 1], actions=snaps[k + 1]["actions"][:-1] + [f"click[{other}]"], digest=None
    )
    with pytest.raises(RestoreError, match="does not reproduce"):
        fresh.restore(bad)
    with pytest.raises(RestoreError, match="digest"):
        fresh.restore(dict(snaps[2], observation="forged"))
    with pytest.raises(RestoreError, match="replay ended"):
        fresh.restore(
            dict(snaps[-1], actions=snaps[-1]["actions"] + ["click[buy now]"], digest=None)
        )


def test_oracle_policy_through_the_runner_earns_the_training_reward(data):
    fmt = AgentFormat()
    tasks = _tasks(data, "val")[:3]
    with EnvPool("webshop") as pool:
        runner = AgentRunner(pool, fmt, max_turns=15)
        eps = runner.run([Start(t, seed=0) for t in tasks], OraclePolicy(fmt), seed=0)
    for e in eps:
        traj = runner.to_trajectory(e)
        assert e.error is None and e.won and e.terminal and traj.reward == 10.0  # 10 * 1[s == 1]


def test_score_metrics_are_100_x_mean_and_100_x_fraction_of_ones():
    logged = {}

    class Module:
        def log(self, key, value, **kw):
            logged[key] = (value, kw["batch_size"])

    trajs = [
        Trajectory(turns=[], reward=0.0, success=s == 1.0, score=s) for s in (1.0, 0.5, 0.0, 1.0)
    ]
    batch = RolloutBatch(groups=[Group(task_id="t", trajectories=trajs, task={})])
    EnvScoreMetrics("webshop").on_test_batch_end(None, Module(), None, batch, 0)
    assert logged == {"eval/webshop_score": (62.5, 4), "eval/webshop_success": (50.0, 4)}


# ---------------------------------------------------------------------- CLI on the synthetic catalogue
def test_cli_fit_two_steps_and_test_on_the_synthetic_catalogue(tmp_path):
    env = dict(
        os.environ,
        OMP_WAIT_POLICY="PASSIVE",
        WANDB_MODE="offline",
        TOKENIZERS_PARALLELISM="false",
        SALVAGE_CACHE=str(tmp_path / "cache"),
    )  # a fresh machine: the catalogue is written on first use
    env.pop("WEBSHOP_DATA", None)
    run = tmp_path / "RUN"
    cfg = [
        sys.executable,
        "-m",
        "salvage",
        "--config",
        str(ROOT / "configs/agent/webshop_tiny.yaml"),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
    ]
    cfg.insert(3, "fit")
    proc = subprocess.run(
        [*cfg, "--trainer.max_steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(next(run.glob("version_0/metrics.csv")).open()))
    steps = [r for r in rows if r.get("rollout/turns")]
    assert (
        len(steps) == 2 and float(steps[0]["rollout/turns"]) == 15.0
    )  # the tiny model never buys: H = 15
    assert any(r.get("val/webshop_score") for r in rows) and any(
        r.get("val/webshop_success") for r in rows
    )
    assert (tmp_path / "cache" / "webshop").is_dir()
    cfg[3] = "test"
    proc = subprocess.run(cfg, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.replace("│", " ")
    assert "eval/webshop_score " in out and "eval/webshop_success " in out


def test_title_score_divides_by_the_goal_word_count_with_repeats():
    # as the original get_type_reward: len(set(product words) & set(goal words)) / len(goal
    # word LIST). Goal type words: lumora hair shampoo x 8 = 10 words, 3 distinct; the dryer
    # shares one ("hair"): 1 / 10 = 0.1 (not > 0.2, not < 0.1) -> r_type 0.5, s = 0.5 * 6 / 6.
    # Dividing by the 3 distinct words gave 1 / 3 > 0.2 -> r_type 1.0, s = 1.0.
    goal = dict(GOAL, name="Lumora Hair Shampoo " + "Shampoo " * 7)
    dryer = _product(
        query="hair dryer",
        name="Kestrel Hair Dryer Brush",
        Title="Kestrel Hair Dryer Brush",
        product_category="Beauty & Personal Care › Tools & Accessories › Hair Dryers",
    )
    s, info = webshop_score(dryer, goal, 19.99, GOAL_OPTIONS)
    assert info["title_score"] == pytest.approx(0.1)
    assert info["r_type"] == 0.5 and s == 0.5
    # a repeated shared word still counts once in the numerator: 2 distinct shared / 4 words
    two = dict(GOAL, name="Hair Hair Dryer Lumora")
    assert webshop_score(dryer, two, 19.99, GOAL_OPTIONS)[1]["title_score"] == pytest.approx(0.5)
