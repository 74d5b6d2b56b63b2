"""GRPO's batch plumbing: a rollout batch cut into per-turn training rows, their padded
tensors, the minibatches and the micro-batch order (``GRPOModule``'s "batch -> rows"
stage), and a minibatch's normalisation, loss inputs and running numbers.

Plain data and tensors: no model runs here (``GRPOModule`` computes the log-probs and the
losses).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from salvage.core.grpo import Aggregation, aggregation_denominator, aggregation_weights
from salvage.core.packing import has_shared_prompt, micro_batch_order, pack_rows, prompt_key
from salvage.core.policy_loss import LossInputs
from salvage.core.seeds import permutation_seed
from salvage.lm import pad_right
from salvage.metrics import StepMetrics
from salvage.types import RolloutBatch, SeqRatio, TokenBatch, Trajectory


@dataclass
class _Row:
    """One training sequence: a turn's prompt + response, with what the loss needs."""

    ids: list[int]
    start: int  # index in ids[1:]-aligned tensors where the response begins
    old_logprobs: list[float]
    advantage: float
    weight: float
    seq: int
    peer: bool = False
    loss: str = "clip"  # the registered policy loss of its tokens (salvage.core.policy_loss)
    # sequence-level ratio (HACPO rows, Table 2a's variant): (reference mean log-prob, low, high)
    seq_ratio: tuple[float, float, float] | None = None


def rows_of(trajectories: Sequence[Trajectory]) -> tuple[list[_Row], list[list[int]]]:
    """Training rows (one per trainable turn with a response) and, per trajectory, its row
    indices."""
    rows: list[_Row] = []
    per_traj: list[list[int]] = []
    for seq, traj in enumerate(trajectories):
        idx = []
        for turn in traj.turns:
            if not turn.train or not turn.response_ids:
                continue
            idx.append(len(rows))
            rows.append(
                _Row(
                    ids=list(turn.prompt_ids) + list(turn.response_ids),
                    start=len(turn.prompt_ids) - 1,
                    old_logprobs=list(turn.logprobs),
                    advantage=traj.advantage if turn.advantage is None else turn.advantage,
                    weight=traj.weight,
                    seq=seq,
                    peer=traj.source != "self",
                    loss=_loss_kind(traj),
                    seq_ratio=_seq_ratio(traj.seq_ratio),
                )
            )
        per_traj.append(idx)
    return rows, per_traj


def collate_rows(rows: Sequence[_Row], pad_id: int, device: torch.device) -> TokenBatch:
    """The rows right-padded, with their response mask, behaviour log-probs, advantages and
    weights on the ``ids[1:]``-aligned positions (fp32 whatever the default dtype)."""
    ids, mask = pad_right([r.ids for r in rows], pad_id, device)
    shape = (len(rows), ids.shape[1] - 1)
    # fp32 whatever the default dtype (bf16-true sets bf16: +-1.3% ratio error)
    dev, f32 = device, torch.float32
    resp = torch.zeros(shape, device=dev, dtype=f32)
    old = torch.zeros(shape, device=dev, dtype=f32)
    adv = torch.zeros(shape, device=dev, dtype=f32)
    w = torch.zeros(shape, device=dev, dtype=f32)
    for i, r in enumerate(rows):
        n = len(r.old_logprobs)
        sl = slice(r.start, r.start + n)
        resp[i, sl] = 1.0
        old[i, sl] = torch.tensor(r.old_logprobs, device=dev, dtype=f32)
        adv[i, sl] = r.advantage
        w[i, sl] = r.weight
    seq = torch.tensor([r.seq for r in rows], device=device)
    return TokenBatch(ids, mask, resp, old, adv, w, seq)


def split_minibatches(
    per_traj: list[list[int]],
    batch: RolloutBatch | None,
    num_minibatches: int,
    shuffle: bool,
    seed: int,
    step: int,
) -> list[list[int]]:
    """Row indices of each minibatch: as the batch fixes them by groups
    (``minibatch_groups``, GRAFT's peer-last order), else ``num_minibatches`` chunks of the
    trajectories (shuffled with the stream of ``seed`` at ``step``), each whole."""
    fixed = batch.minibatch_groups if batch is not None else None
    if batch is not None and fixed is not None:
        first, spans = 0, []
        for g in batch.groups:
            spans.append(range(first, first + len(g.trajectories)))
            first += len(g.trajectories)
        return [[r for gi in mb for t in spans[gi] for r in per_traj[t]] for mb in fixed]
    order = list(range(len(per_traj)))
    if shuffle:
        gen = torch.Generator().manual_seed(permutation_seed(seed, step))
        order = torch.randperm(len(per_traj), generator=gen).tolist()
    order = [t for t in order if per_traj[t]]
    k = min(num_minibatches, len(order))
    chunks = [order[i * len(order) // k : (i + 1) * len(order) // k] for i in range(k)]
    return [[r for t in chunk for r in per_traj[t]] for chunk in chunks]


def row_order(rows: Sequence[_Row], length_aware: bool, packed: bool) -> list[int]:
    """The order in which ``rows`` are cut into micro-batches: as given, or (``length_aware``)
    by length, rows sharing a prompt together when ``packed``."""
    if not length_aware:
        return list(range(len(rows)))
    lengths = [len(r.ids) for r in rows]
    if not packed:
        return micro_batch_order(lengths)
    keys = [prompt_key(r.ids, r.start) for r in rows]
    return micro_batch_order(lengths, keys, [r.start + 1 for r in rows])


def count_positions(counts: list[int], part: Sequence[_Row], packed: bool) -> None:
    """Add a micro-batch's forward to ``counts``: [positions run (padding included), tokens
    run, response tokens scored]."""
    if packed:
        seqs, starts = [r.ids for r in part], [r.start for r in part]
        if has_shared_prompt(seqs, starts):
            layout = pack_rows(seqs, starts)
            counts[0] += len(layout.input_ids) * layout.width
            counts[1] += sum(len(s) for s in layout.input_ids)
            counts[2] += sum(len(r.ids) - 1 - r.start for r in part)
            return
    counts[0] += len(part) * max(len(r.ids) for r in part)
    counts[1] += sum(len(r.ids) for r in part)
    counts[2] += sum(len(r.ids) - 1 - r.start for r in part)


def row_weights(
    rows: Sequence[_Row], loss_agg: Aggregation
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A minibatch's response lengths and each row's per-token aggregation weights, over the
    whole minibatch (``loss_agg``)."""
    lengths = torch.tensor([len(r.old_logprobs) for r in rows], dtype=torch.float32)
    if not rows:
        return lengths, []
    seq = torch.tensor([r.seq for r in rows], dtype=torch.long)
    agg = aggregation_weights(_ragged_mask(lengths), seq, loss_agg)
    return lengths, [agg[i, : int(lengths[i])] for i in range(len(rows))]


def local_denominator(rows: Sequence[_Row], loss_agg: Aggregation) -> float:
    """This rank's share of the minibatch's loss normaliser (``loss_agg``; 0: no rows)."""
    if not rows:
        return 0.0
    lengths = torch.tensor([len(r.old_logprobs) for r in rows], dtype=torch.float32)
    seq = torch.tensor([r.seq for r in rows], dtype=torch.long)
    return aggregation_denominator(_ragged_mask(lengths), seq, loss_agg)


@dataclass
class Minibatch:
    """One minibatch in flight: its rows, their normalisation and the running loss numbers."""

    rows: list[_Row]
    row_ids: list[int]
    """Each row's index among the update's rows (and its reference log-probs)."""
    ref_lp: list[torch.Tensor] | None
    temperature: float
    lengths: torch.Tensor
    weights: list[torch.Tensor]
    """Per row, its tokens' aggregation weights over the whole minibatch."""
    scale: float | None
    """Several ranks: the factor that makes the local loss a share of the global mean."""
    stats: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("policy", "kl", "clip", "ratio", "peer_clip", "peer_w"), 0.0
        )
    )


def loss_inputs(
    part: Sequence[_Row], lp: torch.Tensor, tb: TokenBatch, eps_low: float, eps_high: float
) -> LossInputs:
    """What the registered policy losses of a micro-batch's rows read."""
    seq = [r.seq_ratio or (0.0, 0.0, math.inf) for r in part]
    has_seq = any(r.seq_ratio is not None for r in part)
    return LossInputs(
        logprobs=lp,
        old_logprobs=tb.old_logprobs,
        advantages=tb.advantages,
        mask=tb.response_mask,
        eps_low=eps_low,
        eps_high=eps_high,
        seq_ref=torch.tensor([x[0] for x in seq], device=lp.device) if has_seq else None,
        seq_low=torch.tensor([x[1] for x in seq], device=lp.device) if has_seq else None,
        seq_high=torch.tensor([x[2] for x in seq], device=lp.device) if has_seq else None,
    )


def reference_rows(mb: Minibatch, idx: Sequence[int], lp: torch.Tensor) -> torch.Tensor:
    """The reference's token log-probs of a micro-batch, in ``lp``'s layout."""
    assert mb.ref_lp is not None
    ref = torch.zeros_like(lp)
    for i in range(len(idx)):
        rl = mb.ref_lp[mb.row_ids[idx[i]]]
        ref[i, : rl.shape[0]] = rl[: ref.shape[1]]
    return ref


def add_stats(
    stats: dict[str, float],
    part: Sequence[_Row],
    pol: torch.Tensor,
    aw: torch.Tensor,
    clipped: torch.Tensor,
    ratio: torch.Tensor,
) -> None:
    """Add a micro-batch's weighted policy loss, clipped tokens (all, peers') and ratios."""
    stats["policy"] += float(pol.detach())
    stats["clip"] += float((aw * clipped).sum().detach())
    if any(r.peer for r in part):
        pm = torch.tensor([float(r.peer) for r in part], device=aw.device)[:, None] * aw
        stats["peer_clip"] += float((pm * clipped).sum().detach())
        stats["peer_w"] += float(pm.sum().detach())
    stats["ratio"] += float((aw * ratio).sum().detach())


def log_minibatch(m: StepMetrics, mb: Minibatch, grad_norm: float, kl_coef: float) -> None:
    """A stepped minibatch's gradient norm and loss metrics (token-weighted) into ``m``."""
    stats = mb.stats
    n_tok = float(mb.lengths.sum())
    m.update("train/grad_norm", grad_norm)
    if not mb.rows:
        return
    m.update("loss/policy", stats["policy"], n_tok)
    m.update("loss/clip_frac", stats["clip"], n_tok)
    if stats["peer_w"] > 0:
        m.update("loss/peer_clip_frac", stats["peer_clip"] / stats["peer_w"], stats["peer_w"])
    m.update("loss/ratio_mean", stats["ratio"], n_tok)
    if mb.ref_lp is not None:
        m.update("loss/kl", stats["kl"], n_tok)
    m.update("loss/total", stats["policy"] + kl_coef * stats["kl"], n_tok)


def _loss_kind(traj: Trajectory) -> str:
    """A trajectory's registered policy loss: ``sequence`` for a row with a sequence-level
    ratio (HACPO rows, Table 2a's peer rows), else ``traj.loss`` (``clip`` or ``luffy``;
    ``hacpo`` only labels HACPO's rows)."""
    if traj.seq_ratio is not None:
        return "sequence"
    return "clip" if traj.loss == "hacpo" else traj.loss


def _seq_ratio(value: SeqRatio | None) -> tuple[float, float, float] | None:
    """A sequence ratio as (reference mean log-prob, low, high; no upper bound: inf)."""
    if value is None:
        return None
    return value.ref, value.low, math.inf if value.high is None else value.high


def _ragged_mask(lengths: torch.Tensor) -> torch.Tensor:
    width = int(lengths.max()) if lengths.numel() else 0
    return (torch.arange(width)[None, :] < lengths[:, None]).to(torch.float32)
