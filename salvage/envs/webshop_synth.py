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
``goals`` of them. Option values are chosen so that no two values of a product match under the
reward's fuzzy rule (checked on writing), so a wrong option always costs exactly one match.

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

VERSION = 1
PRODUCTS_FILE, ATTRIBUTES_FILE = "items_shuffle_1000.json", "items_ins_v2_1000.json"
HUMAN_FILE, REVIEWS_FILE = "items_human_ins.json", "reviews.json"

# (category, query, product_category, title noun, attribute pool, option groups, price range)
TYPES: list[tuple[str, str, str, str, list[str], dict[str, list[str]], tuple[int, int]]] = [
    (
        "beauty",
        "shampoo",
        "Beauty & Personal Care › Hair Care › Shampoo & Conditioner › Shampoos",
        "Shampoo",
        [
            "sulfate free",
            "paraben free",
            "tea tree",
            "natural ingredients",
            "dry hair",
            "color safe",
        ],
        {
            "scent": ["lavender", "coconut", "eucalyptus mint"],
            "size": ["travel bottle", "family jug", "refill pouch"],
        },
        (7, 34),
    ),
    (
        "beauty",
        "face moisturizer",
        "Beauty & Personal Care › Skin Care › Face › Creams & Moisturizers › Face Moisturizers",
        "Face Moisturizer",
        [
            "hyaluronic acid",
            "fragrance free",
            "sensitive skin",
            "oil free",
            "vitamin c",
            "cruelty free",
        ],
        {"size": ["trial jar", "standard tube", "value pump"]},
        (9, 58),
    ),
    (
        "beauty",
        "lipstick",
        "Beauty & Personal Care › Makeup › Lips › Lipstick",
        "Lipstick",
        [
            "long lasting",
            "matte finish",
            "vegan formula",
            "moisturizing",
            "smudge proof",
            "shea butter",
        ],
        {"color": ["cherry", "nude", "plum", "coral"]},
        (5, 26),
    ),
    (
        "beauty",
        "nail polish",
        "Beauty & Personal Care › Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
        "Nail Polish",
        ["quick dry", "non toxic", "high gloss", "chip resistant", "gel effect", "easy removal"],
        {
            "color": ["fuchsia", "ivory", "teal", "gold"],
            "item package quantity": ["single bottle", "set of six"],
        },
        (4, 22),
    ),
    (
        "electronics",
        "headphones",
        "Electronics › Headphones, Earbuds & Accessories › Headphones › Over-Ear Headphones",
        "Headphones",
        [
            "noise cancelling",
            "wireless bluetooth",
            "long battery life",
            "foldable design",
            "built in microphone",
            "hi res audio",
        ],
        {"color": ["black", "white", "navy"]},
        (25, 190),
    ),
    (
        "electronics",
        "phone case",
        "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
        "Phone Case",
        [
            "shockproof",
            "slim fit",
            "wireless charging compatible",
            "raised edges",
            "scratch resistant",
            "kickstand",
        ],
        {
            "color": ["black", "pink", "olive"],
            "phone model": ["galaxy s23", "pixel eight", "iphone fifteen"],
        },
        (6, 29),
    ),
    (
        "electronics",
        "bluetooth speaker",
        "Electronics › Portable Audio & Video › Portable Speakers & Docks › Portable Bluetooth Speakers",
        "Bluetooth Speaker",
        [
            "waterproof",
            "portable",
            "deep bass",
            "long battery life",
            "stereo pairing",
            "usb c charging",
        ],
        {"color": ["black", "orange", "grey"]},
        (18, 120),
    ),
    (
        "electronics",
        "usb cable",
        "Electronics › Computers & Accessories › Computer Accessories & Peripherals › Cables & Accessories › "
        "Cables › USB Cables",
        "USB C Cable",
        [
            "fast charging",
            "braided nylon",
            "data transfer",
            "durable",
            "tangle free",
            "gold plated",
        ],
        {
            "length": ["one foot", "six feet", "ten feet"],
            "item package quantity": ["single cable", "three pack"],
        },
        (5, 25),
    ),
    (
        "fashion",
        "running shoes",
        "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
        "Running Shoes",
        [
            "rubber sole",
            "breathable mesh",
            "lightweight",
            "arch support",
            "memory foam",
            "non slip",
        ],
        {"color": ["black", "grey", "royal"], "size": ["seven", "nine", "eleven", "thirteen"]},
        (30, 140),
    ),
    (
        "fashion",
        "t-shirt",
        "Clothing, Shoes & Jewelry › Women › Clothing › Tops, Tees & Blouses › T-Shirts",
        "T-Shirt",
        ["cotton", "short sleeve", "machine wash", "relaxed fit", "crew neck", "moisture wicking"],
        {"color": ["white", "heather", "burgundy"], "size": ["small", "medium", "large"]},
        (9, 35),
    ),
    (
        "fashion",
        "jeans",
        "Clothing, Shoes & Jewelry › Men › Clothing › Jeans",
        "Jeans",
        [
            "slim fit",
            "stretch denim",
            "button fly",
            "classic five pocket",
            "machine wash",
            "straight leg",
        ],
        {"color": ["indigo", "black", "stonewash"], "size": ["w30", "w34", "w38"]},
        (20, 90),
    ),
    (
        "fashion",
        "backpack",
        "Clothing, Shoes & Jewelry › Luggage & Travel Gear › Backpacks › Casual Daypacks",
        "Backpack",
        [
            "water resistant",
            "laptop compartment",
            "padded straps",
            "usb charging port",
            "anti theft",
            "lightweight",
        ],
        {"color": ["black", "khaki", "maroon"]},
        (19, 80),
    ),
    (
        "furniture",
        "office chair",
        "Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs › Home Office Desk Chairs",
        "Office Chair",
        [
            "ergonomic",
            "lumbar support",
            "adjustable height",
            "mesh back",
            "swivel",
            "easy assembly",
        ],
        {"color": ["black", "white", "grey"]},
        (60, 320),
    ),
    (
        "furniture",
        "bookshelf",
        "Home & Kitchen › Furniture › Living Room Furniture › Bookcases",
        "Bookshelf",
        [
            "solid wood",
            "five tier",
            "easy assembly",
            "wall mounted",
            "industrial style",
            "space saving",
        ],
        {"color": ["walnut", "white", "espresso"]},
        (40, 260),
    ),
    (
        "furniture",
        "coffee table",
        "Home & Kitchen › Furniture › Living Room Furniture › Tables › Coffee Tables",
        "Coffee Table",
        [
            "tempered glass",
            "storage shelf",
            "mid century",
            "solid wood",
            "lift top",
            "easy assembly",
        ],
        {"color": ["oak", "black", "white"]},
        (70, 380),
    ),
    (
        "furniture",
        "bed sheets",
        "Home & Kitchen › Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
        "Bed Sheet Set",
        [
            "deep pocket",
            "egyptian cotton",
            "wrinkle free",
            "hypoallergenic",
            "breathable",
            "cooling",
        ],
        {"color": ["ivory", "sage", "charcoal"], "size": ["twin", "queen", "king"]},
        (25, 130),
    ),
    (
        "grocery",
        "coffee beans",
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Coffee › Whole Coffee Beans",
        "Whole Bean Coffee",
        ["fair trade", "organic", "single origin", "low acid", "kosher", "small batch"],
        {
            "flavor name": ["light roast", "dark roast", "espresso blend"],
            "size": ["twelve ounce bag", "two pound bag"],
        },
        (9, 45),
    ),
    (
        "grocery",
        "green tea",
        "Grocery & Gourmet Food › Beverages › Coffee, Tea & Cocoa › Tea › Green Tea",
        "Green Tea",
        [
            "caffeine free",
            "organic",
            "non gmo",
            "individually wrapped",
            "gluten free",
            "antioxidant rich",
        ],
        {
            "flavor name": ["jasmine", "matcha", "ginger lemon"],
            "size": ["twenty bags", "hundred bags"],
        },
        (4, 28),
    ),
    (
        "grocery",
        "protein bars",
        "Grocery & Gourmet Food › Snacks & Sweets › Snack Bars › Protein Bars",
        "Protein Bars",
        ["gluten free", "low sugar", "high protein", "keto friendly", "plant based", "non gmo"],
        {
            "flavor name": ["chocolate chip", "peanut butter", "cookie dough"],
            "size": ["box of twelve", "box of 24"],
        },
        (12, 40),
    ),
    (
        "grocery",
        "beef jerky",
        "Grocery & Gourmet Food › Meat & Seafood › Jerky & Dried Meats › Beef Jerky",
        "Beef Jerky",
        ["grass fed", "high protein", "low sodium", "gluten free", "zero sugar", "resealable bag"],
        {"flavor name": ["teriyaki", "peppered", "smoked hickory"]},
        (7, 38),
    ),
]

BRANDS = [
    "Lumora",
    "Brightfield",
    "Northway",
    "Kestrel",
    "Oakmere",
    "Velora",
    "Tandem & Co",
    "Quillon",
    "Harbor Lane",
    "Sunvale",
    "Marlowe",
    "Pinecrest",
    "Ostara",
    "Fennick",
    "Larkspur",
    "Caldera",
]
OPENERS = ["i need", "i am looking for", "i want", "find me", "i'm looking for", "i would like"]
QUALITIES = [
    "Premium",
    "Everyday",
    "Classic",
    "Essential",
    "Signature",
    "Pro",
    "Deluxe",
    "Original",
]
REVIEW_TITLES = [
    "Works as described",
    "Great value",
    "Would buy again",
    "Not bad",
    "Exactly what I needed",
]


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
        items.append(
            {
                "asin": asin,
                "name": title,
                "category": cat,
                "query": query,
                "product_category": pcat,
                "full_description": (
                    f"This {noun.lower()} by {brand} is {attrs[0]} and {attrs[1]}. "
                    f"Designed for everyday use, it is a dependable choice."
                ),
                "small_description": [f"{a.capitalize()}" for a in attrs[1:]]
                + [f"Made by {brand}"],
                "pricing": pricing,
                "customization_options": {
                    name.title(): [{"value": v.title(), "image": None} for v in vals]
                    for name, vals in options.items()
                },
                "images": [f"synthetic/{asin}.jpg"],
                "brand": brand,
            }
        )
        ins_v2[asin] = {"attributes": attrs, "instruction": None, "instruction_attributes": attrs}
        n_rev = rng.choice((0, 1, 2, 3))
        stars = [rng.choice((3, 4, 5)) for _ in range(n_rev)]
        reviews.append(
            {
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
        )
    human: dict[str, list[dict[str, Any]]] = {}
    for k in sorted(rng.sample(range(products), goals)):
        item = items[k]
        _, query, _, _, _, _, _ = TYPES[k % len(TYPES)]
        attrs = ins_v2[item["asin"]]["attributes"]
        want = attrs[: rng.choice((1, 2, 3))]
        option_groups = list(item["customization_options"])
        n_chosen = min(len(option_groups), rng.choice((0, 1, 1, 2, 2)))
        chosen = rng.sample(option_groups, n_chosen)
        opts = [
            rng.choice(item["customization_options"][g])["value"].lower()
            for g in sorted(chosen, key=option_groups.index)
        ]
        text = f"{rng.choice(OPENERS)} {_article(want[0])} {' and '.join(want)} {query}"
        if opts:
            text += " in " + " and ".join(opts)
        human[item["asin"]] = [
            {
                "asin": item["asin"],
                "instruction": text,
                "instruction_attributes": want,
                "instruction_options": opts,
                "attributes": want,
                "options": [
                    f"{g.lower()}: {v}"
                    for g, v in zip(sorted(chosen, key=option_groups.index), opts, strict=True)
                ],
                "worker_id": f"synthetic-{seed}",
                "assignment_id": f"synthetic-{seed}-{k}",
            }
        ]
    order = list(range(products))
    rng.shuffle(order)  # "items_shuffle": the official product list is shuffled
    return {
        PRODUCTS_FILE: [items[i] for i in order],
        ATTRIBUTES_FILE: ins_v2,
        HUMAN_FILE: human,
        REVIEWS_FILE: reviews,
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
