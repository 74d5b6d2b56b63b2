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
index are built once per process (cached by path), since every episode has its own instance.

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
import os
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, ClassVar

from salvage.core.webshop import (
    fuzzy_ratio,
    normalize_color,
    webshop_score,
)
from salvage.envs.base import ReplayEnv
from salvage.errors import ConfigError, DataError

FILE_PAIRS = (
    ("items_shuffle.json", "items_ins_v2.json"),
    ("items_shuffle_1000.json", "items_ins_v2_1000.json"),
)
HUMAN_FILE, REVIEWS_FILE = "items_human_ins.json", "reviews.json"
PRICE_RANGE = tuple(10.0 * i for i in range(1, 100))
GOAL_SHUFFLE_SEED = 233
SEP = " [SEP] "
BACK, PREV, NEXT, BUY = "back to search", "< prev", "next >", "buy now"
SUB_PAGES = ("description", "features", "reviews")
LUCENE_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they "
    "this to was will with".split()
)
_PRICE_CLAUSE = re.compile(r",?\s*and price lower than [\d.]+ dollars\s*$")
_ACTION = re.compile(r"\s*(search|click)\s*\[(.*)\]\s*", re.IGNORECASE | re.DOTALL)


# ---------------------------------------------------------------------- catalogue
def resolve_data_dir(data_dir: str | None) -> Path:
    raw = data_dir or os.environ.get("WEBSHOP_DATA")
    if not raw:
        raise ValueError(
            "webshop needs data_dir (data.env.train_tasks.data_dir / val_tasks.data_dir) or $WEBSHOP_DATA: a "
            "WebShop data folder (items_shuffle*.json, items_ins_v2*.json, items_human_ins.json), or "
            "'synthetic' for the built-in synthetic catalogue"
        )
    if str(raw) == "synthetic" or str(raw).startswith("synthetic:"):  # not "synthetic_data/"
        from salvage.envs.webshop_synth import ensure_synthetic

        _, _, seed = str(raw).partition(":")
        if seed and not seed.isdigit():
            raise ConfigError(
                f"webshop data_dir {str(raw)!r}: the synthetic catalogue's seed must be an "
                "integer (synthetic:SEED)"
            )
        return ensure_synthetic(int(seed or 0))
    p = Path(os.path.expandvars(str(raw))).expanduser().resolve()
    if not p.is_dir():
        raise FileNotFoundError(
            f"webshop data_dir {str(p)!r} (data_dir or $WEBSHOP_DATA) is not a directory"
        )
    return p


def _price(pricing: Any) -> tuple[list[float], str]:
    values = []
    for part in str(pricing or "").split("$")[1:]:
        try:
            values.append(float(Decimal(re.sub(r"[^\d.]", "", part))))
        except InvalidOperation:
            continue
    if not values:
        return [100.0], "$100.0"
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def _product(
    p: dict[str, Any], attrs: dict[str, Any] | None, reviews: dict[str, Any] | None
) -> dict[str, Any]:
    pricing, tag = _price(p.get("pricing"))
    options: dict[str, list[str]] = {}
    for name, contents in (p.get("customization_options") or {}).items():
        if contents is not None:
            options[name.lower()] = [
                c["value"].strip().replace("/", " | ").lower() for c in contents
            ]
    bullets = p.get("small_description") or []
    revs = [
        {
            "title": r.get("title", ""),
            "score": r.get("score", r.get("stars", "")),
            "body": r.get("review", r.get("body", "")),
        }
        for r in (reviews or {}).get("reviews", [])
    ]
    return {
        "asin": p["asin"],
        "name": p["name"],
        "Title": p["name"],
        "query": p["query"].lower().strip(),
        "category": p["category"],
        "product_category": p["product_category"],
        "Description": p.get("full_description") or "",
        "BulletPoints": bullets if isinstance(bullets, list) else [bullets],
        "pricing": pricing,
        "Price": tag,
        "options": options,
        "Attributes": (attrs or {}).get("attributes") or ["DUMMY_ATTR"],
        "Reviews": revs,
        "Rating": (reviews or {}).get("average_rating", "N.A."),
    }


@dataclass
class Catalogue:
    """Normalised products, their prices, the shuffled human goals, and a lazy BM25 index."""

    root: Path
    products: list[dict[str, Any]]
    prices: dict[str, float]
    goals: list[dict[str, Any]]
    by_asin: dict[str, dict[str, Any]] = field(init=False)
    _index: Any = field(default=None, init=False, repr=False)
    _stem: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_asin = {p["asin"]: p for p in self.products}

    def _analyse(self, text: str) -> list[str]:
        words = [w for w in re.findall(r"\w+", text.lower()) if w not in LUCENE_STOP_WORDS]
        return self._stem.stemWords(words)

    def search(self, query: str, k: int = 50) -> list[str]:
        """ASINs of the top-``k`` BM25 hits (score > 0), best first, ties by catalogue order."""
        if self._index is None:
            try:
                import bm25s
                import Stemmer
            except ImportError as e:
                raise RuntimeError(
                    "env 'webshop' needs bm25s, PyStemmer and rapidfuzz: pip install "
                    "'salvage[webshop]'"
                ) from e
            self._stem = Stemmer.Stemmer("porter")
            docs = []
            for p in self.products:
                opts = ", and ".join(f"{n}: {', '.join(v)}" for n, v in p["options"].items())
                docs.append(
                    " ".join([p["Title"], p["Description"], (p["BulletPoints"] or [""])[0], opts])
                )
            index = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
            index.index([self._analyse(d) for d in docs], show_progress=False)
            self._index = index
        import numpy as np

        scores = self._index.get_scores(self._analyse(query))
        order = np.argsort(-scores, kind="stable")[:k]
        return [self.products[i]["asin"] for i in order if scores[i] > 0]


_CATALOGUES: dict[tuple[str, int | None, int], Catalogue] = {}


def load_catalogue(root: Path, num_products: int | None = None, price_seed: int = 0) -> Catalogue:
    key = (str(root), num_products, price_seed)
    if key not in _CATALOGUES:
        _CATALOGUES[key] = _read_catalogue(root, num_products, price_seed)
    return _CATALOGUES[key]


def _read_catalogue(root: Path, num_products: int | None, price_seed: int) -> Catalogue:
    pair = next(((root / a, root / b) for a, b in FILE_PAIRS if (root / a).exists()), None)
    if pair is None:
        raise FileNotFoundError(
            f"webshop: no product file ({' or '.join(a for a, _ in FILE_PAIRS)}) in {root}"
        )
    for f in (pair[1], root / HUMAN_FILE):
        if not f.exists():
            raise FileNotFoundError(
                f"webshop: {f.name} is missing in {root} (needed with {pair[0].name})"
            )
    raw = _read_json(pair[0], list, "a list of products")
    attrs = _read_json(pair[1], dict, "an object {asin: attributes}")
    human = _read_json(root / HUMAN_FILE, dict, "an object {asin: [instructions]}")
    rev_file = root / REVIEWS_FILE
    reviews = {}
    if rev_file.exists():
        rev_list = _read_json(rev_file, list, "a list of review records")
        if not all(isinstance(r, dict) and "asin" in r for r in rev_list):
            raise DataError(f"webshop: {rev_file}: every review record needs an asin")
        reviews = {r["asin"]: r for r in rev_list}
    if num_products is not None:
        raw = raw[:num_products]
    products, seen = [], set()
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise DataError(
                f"webshop: {pair[0]}: product {i} is a {type(p).__name__}, not an object"
            )
        asin = p.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        try:
            products.append(_product(p, attrs.get(asin), reviews.get(asin)))
        except (KeyError, TypeError, AttributeError) as e:
            what = f"lacks {e}" if isinstance(e, KeyError) else f"is malformed ({e})"
            raise DataError(f"webshop: {pair[0]}: product {i} (asin {asin}) {what}") from None
    for asin, ins_list in human.items():
        if not isinstance(ins_list, list) or not all(
            isinstance(x, dict)
            and (not x.get("instruction_attributes") or isinstance(x.get("instruction"), str))
            for x in ins_list
        ):
            raise DataError(
                f"webshop: {root / HUMAN_FILE}: the entry of {asin} must be a list of "
                "objects with an instruction text"
            )
    rng = random.Random(price_seed)
    prices = {
        p["asin"]: p["pricing"][0] if len(p["pricing"]) == 1 else rng.uniform(*p["pricing"][:2])
        for p in products
    }
    goals = []
    for p in products:
        for ins in human.get(p["asin"], []):
            if not ins.get("instruction_attributes"):
                continue
            above = [x for x in PRICE_RANGE if x > prices[p["asin"]]][:4]
            upper, price_text = 1000000.0, ""
            if len(above) >= 2:
                upper = sorted(rng.sample(above, 2))[1]
                price_text = f", and price lower than {upper:.2f} dollars"
            goals.append(
                {
                    "asin": p["asin"],
                    "category": p["category"],
                    "query": p["query"],
                    "name": p["name"],
                    "product_category": p["product_category"],
                    "instruction_text": ins["instruction"].strip(".") + price_text,
                    "attributes": list(ins["instruction_attributes"]),
                    "price_upper": upper,
                    "goal_options": ins.get("instruction_options") or [],
                }
            )
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return Catalogue(root, products, prices, goals)


def _read_json(path: Path, kind: type, shape: str) -> Any:
    """A WebShop data file parsed, or a ``DataError`` naming it (bad JSON or wrong shape)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"webshop: {path} is not valid UTF-8 JSON ({e})") from None
    if not isinstance(data, kind):
        raise DataError(f"webshop: {path} holds a {type(data).__name__}; expected {shape}")
    return data


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
