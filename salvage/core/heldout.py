"""Held-out checks by content: digests of tasks, overlap between splits, digest splits.

A task's *digest* is a hash of what the policy sees of it (a math prompt's text, an agent
task's initial observation and goal), after normalisation (case and runs of whitespace do
not make two prompts different). Two tasks with one digest are the same task, whatever
their ids or seeds. Pure functions: no I/O, no global state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


def normalise_text(text: str) -> str:
    """Lower case, whitespace runs collapsed to one space, ends stripped."""
    return " ".join(text.lower().split())


def text_digest(*parts: str) -> str:
    """The hex SHA-1 digest of the normalised parts (joined by a separator no text has)."""
    joined = "\x1f".join(normalise_text(p) for p in parts)
    return hashlib.sha1(joined.encode("utf-8", "surrogatepass")).hexdigest()


def digest_fraction(digest: str) -> float:
    """Where a digest falls in [0, 1): its first 52 bits over 2**52 (uniform for SHA-1)."""
    return int(digest[:13], 16) / float(1 << 52)


def in_digest_part(digest: str, frac: float, part: str) -> bool:
    """Digest split: ``heldout`` keeps digests below ``frac``, ``train`` the rest; the two parts
    of one pool are disjoint by construction and together the whole pool."""
    below = digest_fraction(digest) < frac
    return below if part == "heldout" else not below


def dedupe(digests: list[str]) -> list[int]:
    """Indices of the first occurrence of each digest, in order."""
    seen: set[str] = set()
    keep = []
    for i, d in enumerate(digests):
        if d not in seen:
            seen.add(d)
            keep.append(i)
    return keep


@dataclass(frozen=True)
class Overlap:
    """Held-out tasks whose content is also a training task's."""

    split: str
    n_heldout: int
    pairs: tuple[tuple[str, str], ...]
    """(held-out task id, training task id) per overlapping held-out task."""

    @property
    def count(self) -> int:
        return len(self.pairs)

    @property
    def frac(self) -> float:
        return self.count / self.n_heldout if self.n_heldout else 0.0


def overlap(split: str, train: dict[str, str], heldout: dict[str, str]) -> Overlap:
    """``train`` / ``heldout``: task id -> digest. Each held-out task whose digest is a
    training task's, paired with the first such training task."""
    first: dict[str, str] = {}
    for tid, d in train.items():
        first.setdefault(d, tid)
    pairs = tuple((tid, first[d]) for tid, d in heldout.items() if d in first)
    return Overlap(split, len(heldout), pairs)
