"""WebShop (Yao et al., 2022) in text mode, from the official data files, offline (extra ``webshop``).

Data. ``data_dir`` (an argument of ``list_tasks``) or ``$WEBSHOP_DATA``: a WebShop ``data/``
folder with ``items_shuffle.json`` + ``items_ins_v2.json`` (full catalogue) or
``items_shuffle_1000.json`` + ``items_ins_v2_1000.json`` (the 1000-product one; the full pair
wins when both are there), ``items_human_ins.json`` (human goals) and, optionally,
``reviews.json``. ``data_dir: synthetic`` (or ``synthetic:SEED``) uses the small synthetic
catalogue of ``salvage.envs.webshop_synth``, written once into the salvage cache. Products are
normalised as the original ``load_products`` does (title, description, bullet points, price
tag, lower-cased options with ``/`` -> `` | ``, attributes or ``DUMMY_ATTR``, first
``num_products`` records, duplicate / malformed ASINs dropped). The catalogue and its search
index are built once per process (cached by path), since every episode has its own instance
(``salvage.envs.webshop_catalogue``; its names are importable from here too).

Goals. Human goals as in ``get_human_goals``: one per instruction with attributes, in product
order, ``price_upper`` drawn from the four multiples of 10 above the product price, the text
``instruction.strip('.') + ", and price lower than X dollars"``; then shuffled with
``random.seed(233)``. The original ranges: goals ``0 .. eval_goals-1`` are ``test``, the next
``dev_goals`` ``val`` and the rest ``train`` (500 / 1000: test 0-499, dev 500-1499, train
1500-, as the original baselines; verl-agent evaluates on 0-499 and trains on the rest, i.e.
``dev_goals: 0`` with no validation split; set both smaller for a small catalogue). A task is ``{"id", "family": category, "goal": {...}, ...}``.

Pages and actions, as in the original text environment (``observation_mode="text"``): the
page's visible strings joined by `` [SEP] ``, instruction included; ``search[query]`` on the
search page; ``click[x]`` for ``x`` among the page's clickables (lower-cased): results (10 a
page of the top 50 BM25 hits) with ``back to search``, ``< prev`` (page > 1), ``next >`` and the
ASINs; the item page with ``back to search``, ``< prev`` (to the results), ``description``,
``features``, ``reviews``, ``buy now`` and the option values; the three sub-pages with ``back
to search`` and ``< prev`` (to the item). ``info["admissible"]`` lists ``search[<your query>]``
on the search page and ``click[x]`` elsewhere (verl-agent's format). Anything else is invalid:
the state and observation stay unchanged and ``info["invalid_action"]`` is set. The episode
ends at ``buy now`` (score s) or after ``step_limit`` (H = 15) actions (s = 0).

Reward: ``salvage.core.webshop.webshop_score``, the original ``get_reward`` of
``engine/goal.py``, written out in that module's docstring. Its option rule (each goal option
counts once if a chosen value fuzzy-matches it) is the same in the first release (2022-07) and
the current code (2024-05); only the spaCy model changed (``_lg`` -> ``_sm``). A later commit
that iterates the chosen options instead ("Finer matching for options", 2022-08) never
reached the main branch and is not followed. ``won = s == 1`` at purchase (training reward ``10 * won``, SPEC §2.6).

Where this differs from the original (ours):
- title words for ``r_type``: the original keeps the NOUN/PROPN tokens of spaCy's
  ``en_core_web_sm`` (first release: ``_lg``) tags, a model that cannot be downloaded here; we keep the alphabetic
  tokens (>= 2 letters) that are not function words (our list). On Title-Case product names,
  where spaCy tags most content words PROPN/NOUN, both pick nearly the same words; ours also
  keeps adjectives and verbs spaCy would drop.
- fuzzy matching: ``rapidfuzz.fuzz.token_set_ratio`` with thefuzz's processing (drop code
  points 128-255, non-alphanumerics to spaces, lower-case, strip; rounded to an integer):
  the computation thefuzz >= 0.20 itself delegates to rapidfuzz.
- search: BM25 from ``bm25s`` (Lucene's formula, k1 = 0.9, b = 0.4 as Pyserini's defaults)
  over the documents of the original index (title, description, first bullet point, option
  text, lower-cased), analysed with Lucene's English stop words and the Porter stemmer
  (PyStemmer); ties by catalogue order. Pyserini/Lucene (Java) is not used, so rankings can
  differ slightly from the original's.
- randomness: product prices of price ranges (``uniform(low, high)``) and ``price_upper`` are
  drawn from ``random.Random(price_seed)`` in the original's order, not from the unseeded
  global generator, so every process sees the same goals.
- ``search[...]`` is accepted on the search page only (the original also searches from other
  pages, where its admissible list has no search bar); the action verb may be any case.
- the item page shows ``You have clicked <value>.`` for each chosen option (as the original's
  ``text_rich`` mode does), so a restore verifies the chosen options too; the done page shows
  the purchase and the score only; ``next >`` shows on every results page, as in the original.
- a dict of goal options is scored by its values (the original passes ``.items()``).
- reviews are read from ``reviews.json`` when present (the current original reads none).

The oracle (``oracle_action()``) is a deterministic expert: search the instruction (without
its price clause, or the product title when the instruction does not retrieve the product),
page to the goal ASIN, open it, choose for each goal option the best-matching value, buy.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from salvage.core.webshop import (
    fuzzy_ratio,
    normalize_color,
    webshop_score,
)
from salvage.envs.base import ReplayEnv
from salvage.envs.webshop_catalogue import (
    FILE_PAIRS,
    GOAL_SHUFFLE_SEED,
    HUMAN_FILE,
    LUCENE_STOP_WORDS,
    PRICE_RANGE,
    REVIEWS_FILE,
    Catalogue,
    load_catalogue,
    resolve_data_dir,
)

SEP = " [SEP] "
BACK, PREV, NEXT, BUY = "back to search", "< prev", "next >", "buy now"
SUB_PAGES = ("description", "features", "reviews")
_PRICE_CLAUSE = re.compile(r",?\s*and price lower than [\d.]+ dollars\s*$")
_ACTION = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.IGNORECASE | re.DOTALL)


# ---------------------------------------------------------------------- environment
class WebShopEnv(ReplayEnv):
    """Text-mode WebShop; the catalogue is named by each task (``data_dir``, ``num_products``)."""

    name: ClassVar[str] = "webshop"
    reports_score: ClassVar[bool] = True
    """Evaluation logs ``<prefix>/webshop_score`` and ``<prefix>/webshop_success`` (SPEC §2.6)."""

    def __init__(
        self, step_limit: int = 15, results_per_page: int = 10, search_return_n: int = 50
    ) -> None:
        super().__init__()
        if step_limit < 1 or results_per_page < 1 or search_return_n < 1:
            raise ValueError(
                "webshop step_limit, results_per_page and search_return_n must be >= 1"
            )
        self.step_limit = step_limit
        self.results_per_page = results_per_page
        self.search_return_n = search_return_n
        self._cat: Catalogue | None = None
        self._goal: dict[str, Any] = {}
        self._clear()

    def _clear(self) -> None:
        """The page state of a fresh episode: the search page, nothing chosen."""
        self._page, self._keywords, self._page_no = "search", "", 1
        self._results: list[str] = []
        self._asin: str | None = None
        self._options: dict[str, str] = {}
        self._sub = ""
        self._score, self._n = 0.0, 0
        self._reward_info: dict[str, Any] = {}
        self._expert_query: str | None = None

    @classmethod
    def list_tasks(
        cls,
        split: str,
        data_dir: str | None = None,
        num_tasks: int | None = None,
        eval_goals: int = 500,
        dev_goals: int = 1000,
        num_products: int | None = None,
        price_seed: int = 0,
        families: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """The original WebShop ranges: goals ``0 .. eval_goals-1`` are ``test``, the next
        ``dev_goals`` are ``val`` (dev), the rest ``train`` (defaults 500 / 1000: test
        0-499, dev 500-1499, train 1500-)."""
        if split not in ("train", "val", "test"):
            raise ValueError(f"webshop split must be train, val or test, got {split!r}")
        if eval_goals < 1 or dev_goals < 0:
            raise ValueError(
                f"webshop: eval_goals must be >= 1 and dev_goals >= 0, got {eval_goals}, "
                f"{dev_goals}"
            )
        root = resolve_data_dir(data_dir)
        cat = load_catalogue(root, num_products, price_seed)
        n = len(cat.goals)
        bounds = {
            "test": (0, eval_goals),
            "val": (eval_goals, eval_goals + dev_goals),
            "train": (eval_goals + dev_goals, n),
        }
        lo, hi = bounds[split]
        idx = range(min(lo, n), min(hi, n))
        tasks = []
        for i in idx:
            g = cat.goals[i]
            if families and g["category"] not in families:
                continue
            tasks.append(
                {
                    "id": f"webshop/{split}/{i}",
                    "family": g["category"],
                    "goal_index": i,
                    "data_dir": str(root),
                    "num_products": num_products,
                    "price_seed": price_seed,
                    "description": g["instruction_text"],
                    "goal": g,
                }
            )
            if num_tasks and len(tasks) >= num_tasks:
                break
        if not tasks:
            raise ValueError(
                f"webshop: the {split} split is empty ({n} goals in {root}; eval_goals="
                f"{eval_goals}, dev_goals={dev_goals}: test 0..{eval_goals - 1}, val "
                f"{eval_goals}..{eval_goals + dev_goals - 1}, train the rest)"
            )
        return tasks

    # -- state -----------------------------------------------------------------------
    @classmethod
    def task_text(cls, task: dict[str, Any]) -> str | None:
        return str(task["description"])  # the instruction is all a goal shows at its start

    def _reset(self, task: dict[str, Any], seed: int) -> tuple[str, dict[str, Any]]:
        self._cat = load_catalogue(
            resolve_data_dir(task["data_dir"]), task.get("num_products"), task.get("price_seed", 0)
        )
        self._goal = task["goal"]
        if self._goal["asin"] not in self._cat.by_asin:
            raise ValueError(
                f"webshop: goal product {self._goal['asin']} is not in the catalogue at {task['data_dir']}"
            )
        self._clear()
        return self._render(), self._state_info(invalid=False)

    def _clickables(self) -> dict[str, str]:
        """Clickable text -> what it targets, in the original's order (buttons, links, options)."""
        if self._page == "results":
            keys = [BACK] + ([PREV] if self._page_no > 1 else []) + [NEXT]
            out = {k: k for k in keys}
            out.update({a.lower(): a for a in self._page_asins()})
            return out
        if self._page == "item":
            out = {k: k for k in (BACK, PREV, *SUB_PAGES, BUY)}
            for name, values in self._product()["options"].items():
                out.update({v: name for v in values})  # a value shared by two groups: the last wins
            return out
        if self._page == "sub":
            return {BACK: BACK, PREV: PREV}
        return {}

    def _admissible(self) -> list[str]:
        if self._page == "search":
            return ["search[<your query>]"]
        return [f"click[{k}]" for k in self._clickables()]

    def _state_info(self, invalid: bool) -> dict[str, Any]:
        done = self._page == "done"
        return {
            "won": done and self._score == 1.0,
            "admissible": self._admissible(),
            "score": self._score,
            "done": done,
            "task_description": self._goal["instruction_text"],
            "invalid_action": invalid,
            "page": self._page,
            **({"reward_info": self._reward_info} if done else {}),
        }

    def _product(self) -> dict[str, Any]:
        assert self._cat is not None and self._asin is not None
        return self._cat.by_asin[self._asin]

    def _page_asins(self) -> list[str]:
        k = self.results_per_page
        return self._results[(self._page_no - 1) * k : self._page_no * k]

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self._n += 1
        ok = self._apply(action)
        done = self._page == "done" or self._n >= self.step_limit
        info = self._state_info(invalid=not ok)
        info["done"] = done
        return self._render(), self._score if self._page == "done" else 0.0, done, info

    def _apply(self, action: str) -> bool:
        m = _ACTION.fullmatch(action)
        if m is None:
            return False
        verb, arg = m.group(1).lower(), m.group(2).strip().lower()
        if verb == "search":
            if self._page != "search" or not arg:
                return False
            assert self._cat is not None
            self._keywords, self._page_no = arg, 1
            self._results = self._cat.search(arg, self.search_return_n)
            self._to_results()
            return True
        clicks = self._clickables()
        if arg not in clicks:
            return False
        target = clicks[arg]
        if arg == BACK:
            self._page, self._keywords, self._results, self._asin, self._options = (
                "search",
                "",
                [],
                None,
                {},
            )
        elif self._page == "results":
            if arg in (NEXT, PREV):
                self._page_no += 1 if arg == NEXT else -1
                self._to_results()
            else:
                self._page, self._asin = "item", target
        elif self._page == "item":
            if arg == PREV:
                self._to_results()
            elif arg in SUB_PAGES:
                self._page, self._sub = "sub", arg
            elif arg == BUY:
                assert self._cat is not None and self._asin is not None
                self._score, self._reward_info = webshop_score(
                    self._product(), self._goal, self._cat.prices[self._asin], self._options
                )
                self._page = "done"
            else:
                self._options[target] = arg
        elif self._page == "sub":  # < prev
            self._page = "item"
        return True

    def _to_results(self) -> None:
        self._page, self._asin, self._options = "results", None, {}

    # -- text ------------------------------------------------------------------------
    def _render(self) -> str:
        instr = self._goal["instruction_text"]
        if self._page == "search":
            parts = ["WebShop", "Instruction:", instr, "Search"]
        elif self._page == "done":
            p = self._product()
            parts = [
                "Thank you for shopping with us!",
                "Purchased",
                "asin",
                p["asin"],
                "options",
                json.dumps(self._options),
                "Your score (min 0.0, max 1.0)",
                f"{self._score}",
            ]
        else:
            parts = ["Instruction:", instr, "Back to Search"]
            if self._page == "results":
                assert self._cat is not None
                parts += [f"Page {self._page_no} (Total results: {len(self._results)})"]
                parts += (["< Prev"] if self._page_no > 1 else []) + ["Next >"]
                for a in self._page_asins():
                    q = self._cat.by_asin[a]
                    parts += [a, q["Title"], q["Price"]]
            elif self._page == "item":
                p = self._product()
                parts += ["< Prev"] + [f"You have clicked {v}." for v in self._options.values()]
                for name, values in p["options"].items():
                    parts += [name, *values]
                parts += [
                    p["Title"],
                    f"Price: {p['Price']}",
                    f"Rating: {p['Rating']}",
                    "Description",
                    "Features",
                    "Reviews",
                    "Buy Now",
                ]
            else:
                p = self._product()
                parts += ["< Prev"]
                if self._sub == "description":
                    parts += [p["Description"]]
                elif self._sub == "features":
                    parts += list(p["BulletPoints"])
                else:
                    for r in p["Reviews"]:
                        parts += [f'"{r["title"]}"', str(r["score"]), r["body"]]
        return SEP.join(s.strip() for s in parts if s and s.strip())

    # -- oracle ----------------------------------------------------------------------
    def oracle_action(self) -> str | None:
        """The deterministic expert's next action (see the module docstring)."""
        if self._task is None or self._done or self._cat is None:
            return None
        goal = self._goal["asin"]
        if self._page == "search":
            return f"search[{self._query_for_goal()}]"
        if self._page == "results":
            if goal in self._page_asins():
                return f"click[{goal.lower()}]"
            if goal in self._results:
                target = self._results.index(goal) // self.results_per_page + 1
                return f"click[{NEXT if target > self._page_no else PREV}]"
            return f"click[{BACK}]"
        if self._page == "sub" or self._asin != goal:
            return f"click[{PREV}]"
        for group, value in self._goal_choices():
            if self._options.get(group) != value:
                return f"click[{value}]"
        return f"click[{BUY}]"

    def _query_for_goal(self) -> str:
        if self._expert_query is None:
            assert self._cat is not None
            instr = _PRICE_CLAUSE.sub("", self._goal["instruction_text"]).lower()
            title = self._cat.by_asin[self._goal["asin"]]["Title"].lower()
            q = re.sub(r"[\[\]]", " ", instr).strip()
            if self._goal["asin"] not in self._cat.search(q, self.search_return_n):
                q = re.sub(r"[\[\]]", " ", title).strip()
            self._expert_query = " ".join(q.split())
        return self._expert_query

    def _goal_choices(self) -> list[tuple[str, str]]:
        """(group, value) to choose for the goal options: exact value, else best fuzzy > 85."""
        clicks = {v: name for name, values in self._product()["options"].items() for v in values}
        goal_opts = self._goal["goal_options"]
        goal_opts = list(goal_opts.values()) if isinstance(goal_opts, dict) else list(goal_opts)
        out: dict[str, str] = {}
        for g in goal_opts:
            g = g.lower()
            if g in clicks:
                best = g
            else:
                scored = [(fuzzy_ratio(normalize_color(v), normalize_color(g)), v) for v in clicks]
                top = max(scored, key=lambda sv: sv[0], default=(0, ""))
                best = top[1] if top[0] > 85 else ""
            if best and clicks[best] not in out:
                out[clicks[best]] = best
        return list(out.items())


__all__ = [
    "FILE_PAIRS",
    "GOAL_SHUFFLE_SEED",
    "HUMAN_FILE",
    "LUCENE_STOP_WORDS",
    "PRICE_RANGE",
    "REVIEWS_FILE",
    "Catalogue",
    "WebShopEnv",
    "load_catalogue",
    "resolve_data_dir",
]
