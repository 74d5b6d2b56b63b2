"""The text the built-in students' tokenizers are fit to (``policy.corpus``)."""

from __future__ import annotations

from salvage.errors import ConfigError

CORPORA = ("mixed", "twx", "arith")
"""The corpora a built-in's tokenizer can be fit to (``policy.corpus``)."""


def _arith_corpus() -> list[str]:
    """Arithmetic prompts in reasoning-gym's ``basic_arithmetic`` form ("Calculate 7 - 3."),
    the plain "What is a + b?" form, SPEC's suffix and answers (``\\boxed{n}``), numbers 0-99."""
    from salvage.tasks.math import PROMPT_SUFFIX

    lines = [PROMPT_SUFFIX, "The answer is", "Let's think step by step."]
    for a in range(100):
        for b in range(0, 100, 3 if a < 10 else 13):
            for op, val in (("+", a + b), ("-", a - b), ("*", a * b)):
                lines.append(f"Calculate {a} {op} {b}. {PROMPT_SUFFIX}")
                lines.append(f"What is {a} {op} {b}? {a} {op} {b} = {val}. \\boxed{{{val}}}")
    return lines


def corpus_lines(corpus: str = "mixed") -> list[str]:
    """The text a built-in tokenizer is fit to (``policy.corpus``)."""
    if corpus == "mixed":
        from salvage.models import _tiny_corpus

        return _tiny_corpus()
    if corpus == "arith":
        return _arith_corpus()
    if corpus == "twx":
        from importlib.resources import files

        text = files("salvage").joinpath("data/corpus_twx.txt").read_text(encoding="utf-8")
        # tiny's words too (the tags and the digits): the response format is shared
        from salvage.models import _tiny_corpus

        return _tiny_corpus() + text.splitlines()
    raise ConfigError(f"policy.corpus must be one of {CORPORA}, got {corpus!r}")
