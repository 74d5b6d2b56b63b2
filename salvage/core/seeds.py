"""Named seed streams: every random choice of a run draws from its own per-step stream.

A stream is a small integer; ``step_seed(seed, step, stream)`` is the seed of that stream at
that update, so that adding a random choice in one stage never shifts another stage's
draws. The numbers are what the code has always used (changing one changes which
samples a seeded run draws); the names say who draws from them.
"""

from __future__ import annotations

SEED_MODULUS = 2**31 - 1
"""Seeds are reduced modulo the Mersenne prime 2^31 - 1 (fits every RNG's seed type)."""

TRAIN = 0
"""Training rollouts (RLVR samples, agent episodes)."""
EVAL = 1
"""Evaluation rollouts (repeat 0 of a repeated test: ``core.evaluation.repeat_stream``)."""
EVAL_REPEATS = 1000
"""Evaluation repeat r > 0 of a repeated test draws from stream ``EVAL_REPEATS + r``."""
RELAY_SELECT = 7
"""VH-GPO: which zero-signal groups a step rescues, and a random anchor order."""
RELAY_SEARCH = 11
"""VH-GPO: the handoff search's sampling seeds (offset by ``GROUP_OFFSET`` per group)."""
RELAY_DRIVE = 13
"""VH-GPO: the teacher and student calls of the search, one seed per search round."""
EXTRA_ROLLOUTS = 17
"""The compute-matched baseline's extra rollouts (``ExtraStudentRollouts``)."""
GRAFT_EXCHANGE = 21
"""GRAFT: balancing, random selection, random admission and minibatch order."""
STORED_ADMISSION = 31
"""GRAFT stored mode: random admission of the stored peer's responses."""
DYNAMIC_SAMPLING = 41
"""DAPO-style dynamic sampling: the fresh tasks and rollouts of its extra rounds."""

PEER_OFFSET = 7_919
"""GRAFT: policy B samples with its step seed plus this (A with the seed itself)."""
GROUP_OFFSET = 10_007
"""VH-GPO: the search of the batch's group ``gi`` starts at its stream's seed + gi x this."""
EPOCH_MULTIPLIER = 1_000_003
"""Per-epoch (or per-step) permutations: generator seed = seed x this + epoch (or step)."""


def step_seed(seed: int, step: int, stream: int = TRAIN) -> int:
    """Deterministic seed of one named random stream at update ``step`` (no global RNG)."""
    return (seed * 2_654_435_761 + step * 40_503 + stream * 97) % SEED_MODULUS


def permutation_seed(seed: int, index: int) -> int:
    """The generator seed of the permutation number ``index`` (an epoch, a step)."""
    return seed * EPOCH_MULTIPLIER + index
