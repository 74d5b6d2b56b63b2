"""GiGPO step-level advantages (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM
Agent Training"), pure.

Within one group (the G episodes of one task), every turn whose environment state (the
observation it acted on, whitespace-normalised) is identical across the group's episodes
joins one *step group* (the paper's anchor state). A turn's step-level advantage is its
discounted return ``R_t = sum_k gamma^k r_{t+k}`` relative to its step group:
``A_S = (R_t - mean) / F_norm`` with ``F_norm`` the step group's std (+ eps) or 1. A step
group of one turn gets ``A_S = 0``. The turn's final advantage is
``A = A_E + omega * A_S``, ``A_E`` the episode-level (GRPO) advantage of its episode.

Defaults are the paper's / its reference implementation's: ``gamma = 0.95``,
``omega = 1``, ``norm = std`` (the ``mean_std_norm`` mode: std with the unbiased estimator,
as ``salvage.core.grpo``); ``norm = mean`` is the ``F_norm = 1`` variant. Ours (documented
in ``docs/baselines.md``): per-turn rewards are read off salvage's trajectory reward (each
invalid turn carries ``-invalid_penalty`` where it happened, the last turn the rest, i.e.
the success reward), and the state key is the observation text with runs of whitespace
collapsed to one space and the ends stripped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean, stdev

NORMS = ("std", "mean")


@dataclass
class GiGPOConfig:
    """GiGPO's step-level advantage settings (the paper's defaults)."""

    omega: float = 1.0
    """Weight of the step-level advantage: ``A = A_E + omega * A_S``."""
    gamma: float = 0.95
    """Discount of the per-turn returns ``R_t``."""
    norm: str = "std"
    """Step groups: ``std`` (divide by the step group's std + eps) or ``mean`` (F_norm = 1)."""
    eps: float = 1e-6
    """Epsilon of the std normalisation."""

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"gigpo.norm must be one of {NORMS}, got {self.norm!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gigpo.gamma must be in [0, 1], got {self.gamma}")
        if self.omega < 0:
            raise ValueError(f"gigpo.omega must be >= 0, got {self.omega}")
        if self.eps < 0:
            raise ValueError(f"gigpo.eps must be >= 0, got {self.eps}")


def state_key(observation: str) -> str:
    """The anchor-state identity of an observation: whitespace runs collapsed, ends stripped."""
    return " ".join(observation.split())


def turn_rewards(total: float, invalid: Sequence[bool], invalid_penalty: float) -> list[float]:
    """Per-turn rewards that add up to the trajectory reward ``total``: ``-invalid_penalty`` on
    each invalid turn, and the last turn also gets the rest (the success reward)."""
    if not invalid:
        return []
    r = [-invalid_penalty if bad else 0.0 for bad in invalid]
    r[-1] += total - sum(r)
    return r


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """``R_t = r_t + gamma * R_{t+1}`` (``R_T = r_T`` for the last turn)."""
    out = [0.0] * len(rewards)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def step_advantages(
    states: Sequence[Sequence[str]],
    returns: Sequence[Sequence[float]],
    norm: str = "std",
    eps: float = 1e-6,
) -> tuple[list[list[float]], list[int]]:
    """Step-level advantages of one group: ``states[i][t]`` the state key of episode ``i``'s
    turn ``t``, ``returns[i][t]`` its discounted return. Returns (advantages in the same
    shape, the sizes of the step groups in order of first appearance)."""
    if norm not in NORMS:
        raise ValueError(f"gigpo.norm must be one of {NORMS}, got {norm!r}")
    members: dict[str, list[tuple[int, int]]] = {}
    for i, (ss, rs) in enumerate(zip(states, returns, strict=True)):
        if len(ss) != len(rs):
            raise ValueError(f"episode {i}: {len(ss)} states but {len(rs)} returns")
        for t, s in enumerate(ss):
            members.setdefault(s, []).append((i, t))
    adv = [[0.0] * len(rs) for rs in returns]
    for cells in members.values():
        values = [returns[i][t] for i, t in cells]
        mean = fmean(values)
        scale = 1.0
        if norm == "std":
            scale = (stdev(values) if len(values) > 1 else 0.0) + eps
        for (i, t), v in zip(cells, values, strict=True):
            adv[i][t] = (v - mean) / scale if scale > 0 else 0.0  # no spread (eps 0): 0
    return adv, [len(c) for c in members.values()]


def gigpo_advantages(
    episode_adv: Sequence[float],
    states: Sequence[Sequence[str]],
    returns: Sequence[Sequence[float]],
    cfg: GiGPOConfig,
) -> tuple[list[list[float]], list[int]]:
    """Per-turn advantages ``A_E(episode) + omega * A_S(turn)`` of one group, and the step
    group sizes (``step_advantages``)."""
    if len(episode_adv) != len(states):
        raise ValueError(f"{len(episode_adv)} episode advantages for {len(states)} episodes")
    step, sizes = step_advantages(states, returns, cfg.norm, cfg.eps)
    return [
        [a + cfg.omega * s for s in row] for a, row in zip(episode_adv, step, strict=True)
    ], sizes
