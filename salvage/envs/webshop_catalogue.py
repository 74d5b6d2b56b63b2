"""The WebShop catalogue: the official data files read and normalised, the human goals,
and the BM25 search index (``salvage.envs.webshop``'s docstring describes the rules).

Built once per process per (folder, ``num_products``, ``price_seed``) (``load_catalogue``),
since every episode has its own environment instance.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from salvage.errors import ConfigError, DataError, MissingFileError

FILE_PAIRS = (
    ("items_shuffle.json", "items_ins_v2.json"),
    ("items_shuffle_1000.json", "items_ins_v2_1000.json"),
)
HUMAN_FILE, REVIEWS_FILE = "items_human_ins.json", "reviews.json"
PRICE_RANGE = tuple(10.0 * i for i in range(1, 100))
GOAL_SHUFFLE_SEED = 233
LUCENE_STOP_WORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they "
    "this to was will with".split()
)


def resolve_data_dir(data_dir: str | None) -> Path:
    raw = data_dir or os.environ.get("WEBSHOP_DATA")
    if not raw:
        raise ConfigError(
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
        raise MissingFileError(
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
    products_file, attrs_file = _data_files(root)
    raw = _read_json(products_file, list, "a list of products")
    attrs = _read_json(attrs_file, dict, "an object {asin: attributes}")
    human = _read_json(root / HUMAN_FILE, dict, "an object {asin: [instructions]}")
    _check_human(human, root / HUMAN_FILE)
    reviews = _read_reviews(root / REVIEWS_FILE)
    if num_products is not None:
        raw = raw[:num_products]
    products = _normalised(raw, attrs, reviews, products_file)
    rng = random.Random(price_seed)
    prices = {
        p["asin"]: p["pricing"][0] if len(p["pricing"]) == 1 else rng.uniform(*p["pricing"][:2])
        for p in products
    }
    goals = _human_goals(products, prices, human, rng)
    random.Random(GOAL_SHUFFLE_SEED).shuffle(goals)
    return Catalogue(root, products, prices, goals)


def _data_files(root: Path) -> tuple[Path, Path]:
    """The product and attribute files of ``root`` (the full pair wins), checked present
    with the human goals."""
    pair = next(((root / a, root / b) for a, b in FILE_PAIRS if (root / a).exists()), None)
    if pair is None:
        raise MissingFileError(
            f"webshop: no product file ({' or '.join(a for a, _ in FILE_PAIRS)}) in {root}"
        )
    for f in (pair[1], root / HUMAN_FILE):
        if not f.exists():
            raise MissingFileError(
                f"webshop: {f.name} is missing in {root} (needed with {pair[0].name})"
            )
    return pair


def _read_reviews(rev_file: Path) -> dict[str, Any]:
    """Review records by ASIN (none when the file is absent)."""
    if not rev_file.exists():
        return {}
    rev_list = _read_json(rev_file, list, "a list of review records")
    if not all(isinstance(r, dict) and "asin" in r for r in rev_list):
        raise DataError(f"webshop: {rev_file}: every review record needs an asin")
    return {r["asin"]: r for r in rev_list}


def _normalised(
    raw: list[Any], attrs: dict[str, Any], reviews: dict[str, Any], path: Path
) -> list[dict[str, Any]]:
    """The products of ``raw`` normalised, in order; duplicate or malformed ASINs dropped."""
    products, seen = [], set()
    for i, p in enumerate(raw):
        if not isinstance(p, dict):
            raise DataError(f"webshop: {path}: product {i} is a {type(p).__name__}, not an object")
        asin = p.get("asin")
        if not isinstance(asin, str) or asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        try:
            products.append(_product(p, attrs.get(asin), reviews.get(asin)))
        except (KeyError, TypeError, AttributeError) as e:
            what = f"lacks {e}" if isinstance(e, KeyError) else f"is malformed ({e})"
            raise DataError(f"webshop: {path}: product {i} (asin {asin}) {what}") from None
    return products


def _check_human(human: dict[str, Any], path: Path) -> None:
    """Every entry of the human goals file is a list of objects with an instruction text."""
    for asin, ins_list in human.items():
        if not isinstance(ins_list, list) or not all(
            isinstance(x, dict)
            and (not x.get("instruction_attributes") or isinstance(x.get("instruction"), str))
            for x in ins_list
        ):
            raise DataError(
                f"webshop: {path}: the entry of {asin} must be a list of "
                "objects with an instruction text"
            )


def _human_goals(
    products: list[dict[str, Any]],
    prices: dict[str, float],
    human: dict[str, Any],
    rng: random.Random,
) -> list[dict[str, Any]]:
    """One goal per human instruction with attributes, in product order (before the
    shuffle), each with its ``price_upper`` drawn from ``rng``."""
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
    return goals


def _read_json(path: Path, kind: type, shape: str) -> Any:
    """A WebShop data file parsed, or a ``DataError`` naming it (bad JSON or wrong shape)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"webshop: {path} is not valid UTF-8 JSON ({e})") from None
    if not isinstance(data, kind):
        raise DataError(f"webshop: {path} holds a {type(data).__name__}; expected {shape}")
    return data
