"""A small synthetic WebShop catalogue in the official file format (for tests and CPU runs).

``write_catalogue(out_dir, seed)`` writes, deterministically from ``seed``, the four files the
WebShop loader (``salvage.envs.webshop``) reads from a real WebShop ``data/`` folder, with the
same keys as the official ones:

- ``items_shuffle_1000.json``: a list of scraped-product records (``asin``, ``name``,
  ``category``, ``query``, ``product_category``, ``full_description``, ``small_description``,
  ``pricing`` as a ``"$x"`` or ``"$x - $y"`` string, ``customization_options``, ``images``);
- ``items_ins_v2_1000.json``: ``{asin: {"attributes", "instruction", "instruction_attributes"}}``;
- ``items_human_ins.json``: ``{asin: [{"asin", "instruction", "instruction_attributes",
  "instruction_options", "attributes", "options", "worker_id", "assignment_id"}]}``;
- ``reviews.json``: ``[{"asin", "average_rating", "reviews": [{"title", "stars", "review"}]}]``.

Five categories x four product types x ``products // 20`` products, one human-style goal for
``goals`` of them (the vocabulary: ``salvage.envs.webshop_synth_data``). Option values are
chosen so that no two values of a product match under the reward's fuzzy rule (checked on
writing), so a wrong option always costs exactly one match.

CLI: ``python -m salvage.envs.webshop_synth OUT_DIR [--seed N] [--products 200] [--goals 50]``.
``ensure_synthetic(seed)`` writes the catalogue once into the salvage cache (``$SALVAGE_CACHE``
or ``~/.cache/salvage``) and returns its folder; it backs ``data_dir: synthetic``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from salvage.envs.webshop_synth_data import BRANDS, OPENERS, QUALITIES, REVIEW_TITLES, TYPES

VERSION = 1
PRODUCTS_FILE, ATTRIBUTES_FILE = "items_shuffle_1000.json", "items_ins_v2_1000.json"
HUMAN_FILE, REVIEWS_FILE = "items_human_ins.json", "reviews.json"


def _asin(rng: random.Random, taken: set[str]) -> str:
    while True:
        a = "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))
        if a not in taken:
            taken.add(a)
            return a


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


def _check_options(options: dict[str, list[str]]) -> None:
    """No two option values of a product may match under the reward's fuzzy rule."""
    from salvage.core.webshop import fuzzy_ratio, normalize_color

    values = [v for vs in options.values() for v in vs]
    for i, v in enumerate(values):
        for w in values[i + 1 :]:
            if fuzzy_ratio(normalize_color(v), normalize_color(w)) > 85:
                raise AssertionError(f"synthetic option values {v!r} and {w!r} match each other")


def generate(seed: int = 0, products: int = 200, goals: int = 50) -> dict[str, Any]:
    """The four official files' contents (plain data), deterministic in ``seed``."""
    if products < len(TYPES) or goals > products:
        raise ValueError(f"webshop_synth needs products >= {len(TYPES)} and goals <= products")
    rng = random.Random(seed)
    taken: set[str] = set()
    items: list[dict[str, Any]] = []
    ins_v2: dict[str, dict[str, Any]] = {}
    reviews: list[dict[str, Any]] = []
    for k in range(products):
        item, attrs = _item(rng, k, taken)
        items.append(item)
        ins_v2[item["asin"]] = {
            "attributes": attrs,
            "instruction": None,
            "instruction_attributes": attrs,
        }
        reviews.append(_reviews(rng, item["asin"], TYPES[k % len(TYPES)][3], attrs))
    human: dict[str, list[dict[str, Any]]] = {}
    for k in sorted(rng.sample(range(products), goals)):
        item = items[k]
        human[item["asin"]] = [_goal(rng, k, item, ins_v2[item["asin"]]["attributes"], seed)]
    order = list(range(products))
    rng.shuffle(order)  # "items_shuffle": the official product list is shuffled
    return {
        PRODUCTS_FILE: [items[i] for i in order],
        ATTRIBUTES_FILE: ins_v2,
        HUMAN_FILE: human,
        REVIEWS_FILE: reviews,
    }


def _item(rng: random.Random, k: int, taken: set[str]) -> tuple[dict[str, Any], list[str]]:
    """Product ``k``'s scraped-product record (of type ``k % len(TYPES)``) and its three
    attributes."""
    cat, query, pcat, noun, pool, groups, (lo, hi) = TYPES[k % len(TYPES)]
    asin = _asin(rng, taken)
    attrs = sorted(rng.sample(pool, 3), key=pool.index)
    brand = rng.choice(BRANDS)
    shown = attrs[: rng.choice((1, 2))]
    title = f"{brand} {rng.choice(QUALITIES)} {' '.join(a.title() for a in shown)} {noun}"
    if rng.random() < 0.5:
        title += f" - {rng.choice(list(groups.values()))[0].title()} Edition"
    options = {
        name: sorted(rng.sample(vals, min(len(vals), rng.choice((2, 3, 4)))))
        for name, vals in groups.items()
    }
    _check_options(options)
    lead = round(rng.uniform(lo, hi)) - 0.01
    pricing = f"${lead:.2f}" if rng.random() < 0.8 else f"${lead:.2f} - ${lead * 1.4:.2f}"
    item = {
        "asin": asin,
        "name": title,
        "category": cat,
        "query": query,
        "product_category": pcat,
        "full_description": (
            f"This {noun.lower()} by {brand} is {attrs[0]} and {attrs[1]}. "
            f"Designed for everyday use, it is a dependable choice."
        ),
        "small_description": [f"{a.capitalize()}" for a in attrs[1:]] + [f"Made by {brand}"],
        "pricing": pricing,
        "customization_options": {
            name.title(): [{"value": v.title(), "image": None} for v in vals]
            for name, vals in options.items()
        },
        "images": [f"synthetic/{asin}.jpg"],
        "brand": brand,
    }
    return item, attrs


def _reviews(rng: random.Random, asin: str, noun: str, attrs: list[str]) -> dict[str, Any]:
    """A product's review record: 0-3 reviews of 3-5 stars."""
    n_rev = rng.choice((0, 1, 2, 3))
    stars = [rng.choice((3, 4, 5)) for _ in range(n_rev)]
    return {
        "asin": asin,
        "average_rating": round(sum(stars) / n_rev, 1) if n_rev else "N.A.",
        "reviews": [
            {
                "title": rng.choice(REVIEW_TITLES),
                "stars": s,
                "review": f"The {noun.lower()} is {attrs[i % 3]}.",
            }
            for i, s in enumerate(stars)
        ],
    }


def _goal(
    rng: random.Random, k: int, item: dict[str, Any], attrs: list[str], seed: int
) -> dict[str, Any]:
    """A human-style goal for product ``k``: some of its attributes, maybe some options."""
    query = TYPES[k % len(TYPES)][1]
    want = attrs[: rng.choice((1, 2, 3))]
    option_groups = list(item["customization_options"])
    n_chosen = min(len(option_groups), rng.choice((0, 1, 1, 2, 2)))
    chosen = sorted(rng.sample(option_groups, n_chosen), key=option_groups.index)
    opts = [rng.choice(item["customization_options"][g])["value"].lower() for g in chosen]
    text = f"{rng.choice(OPENERS)} {_article(want[0])} {' and '.join(want)} {query}"
    if opts:
        text += " in " + " and ".join(opts)
    return {
        "asin": item["asin"],
        "instruction": text,
        "instruction_attributes": want,
        "instruction_options": opts,
        "attributes": want,
        "options": [f"{g.lower()}: {v}" for g, v in zip(chosen, opts, strict=True)],
        "worker_id": f"synthetic-{seed}",
        "assignment_id": f"synthetic-{seed}-{k}",
    }


def write_catalogue(
    out_dir: str | Path, seed: int = 0, products: int = 200, goals: int = 50
) -> Path:
    """Write the synthetic catalogue's files into ``out_dir`` (created); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in generate(seed, products, goals).items():
        (out / name).write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    return out


def ensure_synthetic(seed: int = 0) -> Path:
    """The cached synthetic catalogue for ``seed`` (written once, atomically, on first use)."""
    from salvage.models import cache_dir

    final = cache_dir() / "webshop" / f"synthetic-v{VERSION}-seed{seed}"
    if (final / HUMAN_FILE).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        write_catalogue(tmp, seed)
        try:
            tmp.rename(final)
        except OSError:  # another process finished first
            if not (final / HUMAN_FILE).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--products", type=int, default=200)
    ap.add_argument("--goals", type=int, default=50)
    a = ap.parse_args(argv)
    out = write_catalogue(a.out_dir, a.seed, a.products, a.goals)
    print(f"wrote {a.products} products and {a.goals} goals to {out}")


if __name__ == "__main__":
    main()
