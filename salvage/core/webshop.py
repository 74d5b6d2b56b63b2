"""WebShop's task score (the original benchmark's reward rule), pure functions on plain data.

s = r_type * (attribute matches + option matches + 1[price <= price_upper])
    / (number of goal attributes + number of goal options + 1)

- an attribute matches when thefuzz-style ``token_set_ratio > 85`` against one of the
  product's attributes, or when it appears in the title, bullet points or description;
- a goal option matches (after colour normalisation) when ``token_set_ratio > 85``
  against one of the chosen option values;
- r_type is 1, lowered to 0.5 when neither the query, nor >= 2 shared category levels,
  nor a title score > 0.2 matches; 0.1 below 0.1; 0 at none. The title score is the number
  of distinct type words the two names share over the goal name's type-word count with
  repeats (Amazon titles repeat words: "Tea Tree Shampoo ... Shampoo" counts shampoo twice).

Differences from the original (read in ``web_agent_site/engine/goal.py``): type words are
alphabetic non-function words (the original uses spaCy noun tags; spaCy models cannot be
downloaded here); fuzzy matching uses rapidfuzz with thefuzz's preprocessing (what thefuzz
0.22 does internally). The environment that applies it is ``salvage.envs.webshop``.
"""

from __future__ import annotations

import re
from typing import Any

# normalize_color's colour list (WebShop engine/normalize.py); the first one contained wins
COLOR_SET = (
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy camel "
    "camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral cranberry "
    "cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass gray green grey "
    "heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve merlot midnight "
    "mint mocha multicolor mushroom mustard natural navy nude olive orange peach pewter pink plum purple rainbow "
    "red rose royal rust sand sapphire seashell silver skull slate steel stone stonewash sunflower tan taupe teal "
    "tiger turquoise violet walnut wheat white wine yellow"
).split()
FUNCTION_WORDS = frozenset(
    "a an the this that these those and or nor but so for of in on at to from by with without into onto over under "
    "up down out off about as per via than then if is are was were be been being am do does did has have had will "
    "would can could should may might must shall i me my we our you your he she it its they them their his her him "
    "not no very too also just only all any some each every both either neither more most less least few many "
    "much such own same other another what which who whom whose when where why how here there".split()
)


def fuzzy_ratio(a: str, b: str) -> int:
    """thefuzz's ``token_set_ratio``: processed strings, rapidfuzz's scorer, rounded."""
    from rapidfuzz import fuzz, utils

    pa = utils.default_process("".join(c for c in a if not 128 <= ord(c) <= 255))
    pb = utils.default_process("".join(c for c in b if not 128 <= ord(c) <= 255))
    if not pa or not pb:
        return 0
    return int(round(fuzz.token_set_ratio(pa, pb)))


def normalize_color(value: str) -> str:
    """The first colour of the list contained in ``value``, else ``value`` (as the original)."""
    return next((c for c in COLOR_SET if c in value), value)


def type_words(name: str) -> list[str]:
    """Type words of a product name in order, repeats kept (ours: stands in for spaCy's
    NOUN/PROPN tokens; the original keeps a list, so a repeated word counts each time)."""
    return [
        w
        for w in re.findall(r"[a-z]+(?:[.'][a-z]+)*", name.lower())
        if len(w) >= 2 and w not in FUNCTION_WORDS
    ]


def title_words(name: str) -> set[str]:
    """The distinct type words of a product name."""
    return set(type_words(name))


def type_reward(product: dict[str, Any], goal: dict[str, Any]) -> dict[str, Any]:
    query_match = product["query"] == goal["query"]
    cats_p = {x.strip() for x in product["product_category"].split("›")}
    cats_g = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(cats_p & cats_g) >= 2
    # as the original: distinct shared words over the goal name's word count WITH repeats
    want, got = type_words(goal["name"]), title_words(product["name"])
    title_score = len(set(want) & got) / len(want) if want else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {
        "r_type": r_type,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def attribute_matches(product: dict[str, Any], goal_attrs: list[str]) -> int:
    text = [
        product["Title"].lower(),
        " ".join(product["BulletPoints"]).lower(),
        product["Description"].lower(),
    ]
    n = 0
    for g in goal_attrs:
        if any(fuzzy_ratio(p, g) > 85 for p in product["Attributes"]) or any(g in t for t in text):
            n += 1
    return n


def option_matches(chosen: list[str], goal_options: list[str]) -> int:
    chosen = [normalize_color(o) for o in chosen]
    return sum(any(fuzzy_ratio(p, normalize_color(g)) > 85 for p in chosen) for g in goal_options)


def webshop_score(
    product: dict[str, Any], goal: dict[str, Any], price: float, options: dict[str, str]
) -> tuple[float, dict[str, Any]]:
    """The original task score s in [0, 1] of buying ``product`` with ``options`` at ``price``."""
    t = type_reward(product, goal)
    goal_opts = goal["goal_options"]
    goal_opts = list(goal_opts.values()) if isinstance(goal_opts, dict) else list(goal_opts)
    r_price = bool(price <= goal["price_upper"]) if goal["price_upper"] > 0 else False
    m_attr = attribute_matches(product, goal["attributes"])
    m_opt = option_matches(list(options.values()), goal_opts)
    denom = len(goal["attributes"]) + len(goal_opts) + 1
    score = (m_attr + m_opt + float(r_price)) / denom * t["r_type"]
    return score, {
        **t,
        "attr_matches": m_attr,
        "option_matches": m_opt,
        "price_ok": r_price,
        "num_attrs": len(goal["attributes"]),
        "num_options": len(goal_opts),
    }
