"""Prompt packing and length-aware micro-batch order for the update's forward passes (ours).

Rows that share byte-identical prompt ids (the G samples of a group, the first turns of
agent episodes, a VH-GPO pair) are scored in ONE sequence: the shared prompt followed by
each sample's response. Under the packed attention mask a response token sees the prompt
and the earlier tokens of its own response only, and every sample's positions continue
from the prompt (each response starts at position ``len(prompt)``), so every log-prob is
the one of the row's own unpacked forward pass. The logits at the prompt's last position
predict the first token of every sample; a response's last token predicts nothing that is
needed, so it is not an input.

A row is a token list ``seq`` with ``start``: the index in ``seq[1:]``-aligned tensors of
its first response token, i.e. the prompt is ``seq[: start + 1]`` and the response
``seq[start + 1 :]`` (the layout of ``GRPOModule``'s rows and of ``SeqTarget``).

Pure functions on lists and tensors; the model call is ``salvage.lm.packed_token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

PAD_SEGMENT = -2
"""Segment id of padding positions (the shared prompt is -1, samples are 0, 1, ...)."""

JOIN_CAPACITY = 2
"""Packs may share a sequence up to this many times the longest pack's length (ours), so no
sequence's attention span grows by more than this factor (``join_packs``)."""


@dataclass(frozen=True)
class PackedLayout:
    """Packed sequences of a set of rows and the maps back to each row's log-probs."""

    input_ids: list[list[int]]
    """The sequences run: each holds one or more packs (a prompt, then each sample's
    response minus its last token), packs of different prompts side by side."""
    position_ids: list[list[int]]
    """Per token: its position in the row's own unpacked sequence."""
    segments: list[list[int]]
    """Per token: -1 for a pack's shared prompt, j >= 0 for the j-th sample of its pack."""
    blocks: list[list[int]]
    """Per token: which pack of its sequence it belongs to (0, 1, ...)."""
    row_seq: list[int]
    """The sequence that holds each row."""
    row_positions: list[list[int]]
    """Per row: the positions in its sequence whose logits predict its response tokens."""
    row_targets: list[list[int]]
    """Per row: its response tokens (the targets of ``row_positions``)."""
    row_start: list[int]
    """Per row: ``start`` (where its response log-probs go in ``seq[1:]``-aligned tensors)."""

    @property
    def width(self) -> int:
        """The longest sequence."""
        return max((len(s) for s in self.input_ids), default=0)

    @property
    def first_needed(self) -> int:
        """The first position whose logits some row needs (the LM head starts there)."""
        return min((p[0] for p in self.row_positions if p), default=0)


def prompt_key(seq: Sequence[int], start: int) -> tuple[int, ...]:
    """The prompt of a row (``seq[: start + 1]``): rows with equal keys share a pack."""
    return tuple(seq[: start + 1])


def has_shared_prompt(seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> bool:
    """Whether two rows share a prompt (otherwise packing saves nothing)."""
    keys = [prompt_key(s, a) for s, a in zip(seqs, starts, strict=True)]
    return len(set(keys)) < len(keys)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each summing to at most ``capacity`` (an item longer than it
    gets a bin of its own): items longest first (ties in order), each into the first bin
    with room. Bins in the order they were opened."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, left in enumerate(room):
            if lengths[i] <= left:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def join_packs(lengths: Sequence[int]) -> list[list[int]]:
    """Which packs share a sequence: the ``first_fit_decreasing`` bins, over capacities from
    the longest pack up to ``JOIN_CAPACITY`` times it, with the fewest positions run
    (sequences x the longest sequence; ties: the narrower). A micro-batch's packs differ in
    length when its rows are parts of groups; side by side they need less padding.

    Capacities tried: the longest pack, every sum of two packs and the sum of all, within
    the bound.
    """
    if not lengths:
        return []
    top = max(lengths)
    bound = JOIN_CAPACITY * top
    caps = {top, sum(lengths)} | {a + b for i, a in enumerate(lengths) for b in lengths[i + 1 :]}
    best: tuple[int, int, list[list[int]]] | None = None
    for cap in sorted(c for c in caps if top <= c <= bound):
        bins = first_fit_decreasing(lengths, cap)
        width = max(sum(lengths[i] for i in b) for b in bins)
        if best is None or (len(bins) * width, width) < best[:2]:
            best = (len(bins) * width, width, bins)
    assert best is not None
    return best[2]


def pack_rows(
    seqs: Sequence[Sequence[int]], starts: Sequence[int], join: bool = True
) -> PackedLayout:
    """Pack rows that share a prompt into one pack each (packs in first-seen order).

    ``join``: packs share a sequence where that cuts padding (``join_packs``); False: one
    sequence per pack.
    """
    if len(seqs) != len(starts):
        raise ValueError(f"pack_rows: {len(seqs)} sequences but {len(starts)} starts")
    ids, pos, seg, row_pack, row_positions, row_targets = _build_packs(seqs, starts)
    lengths = [len(x) for x in ids]
    if join:
        bins = join_packs(lengths)
    else:
        bins = [[k] for k in range(len(ids))]
    out_ids, out_pos, out_seg, out_blk, seq_of, offset = _lay_out(ids, pos, seg, bins)
    return PackedLayout(
        out_ids,
        out_pos,
        out_seg,
        out_blk,
        [seq_of[k] for k in row_pack],
        [[q + offset[k] for q in p] for p, k in zip(row_positions, row_pack, strict=True)],
        row_targets,
        list(starts),
    )


_Lists = list[list[int]]  # per pack, sequence or row


def _build_packs(
    seqs: Sequence[Sequence[int]], starts: Sequence[int]
) -> tuple[_Lists, _Lists, _Lists, list[int], _Lists, _Lists]:
    """Build the packs (ids, positions, segments) and each row's pack, positions and targets."""
    pack_of: dict[tuple[int, ...], int] = {}
    ids: list[list[int]] = []
    pos: list[list[int]] = []
    seg: list[list[int]] = []
    members: list[int] = []
    row_pack: list[int] = []
    row_positions: list[list[int]] = []
    row_targets: list[list[int]] = []
    for r, (s, a) in enumerate(zip(seqs, starts, strict=True)):
        if not 0 <= a < len(s):
            raise ValueError(f"pack_rows: row {r} has start {a} outside its {len(s)} tokens")
        key = prompt_key(s, a)
        k = pack_of.get(key)
        if k is None:
            k = pack_of[key] = len(ids)
            ids.append(list(key))
            pos.append(list(range(len(key))))
            seg.append([-1] * len(key))
            members.append(0)
        response = list(s[a + 1 :])
        j, here = members[k], len(ids[k])
        members[k] += 1
        # the prompt's last token predicts the first response token; then the response's
        # own tokens (all but the last) predict the rest
        row_positions.append([a] + list(range(here, here + len(response) - 1)) if response else [])
        row_targets.append(response)
        row_pack.append(k)
        ids[k] += response[:-1]
        pos[k] += list(range(a + 1, a + len(response)))
        seg[k] += [j] * max(0, len(response) - 1)
    return ids, pos, seg, row_pack, row_positions, row_targets


def _lay_out(
    ids: _Lists, pos: _Lists, seg: _Lists, bins: list[list[int]]
) -> tuple[_Lists, _Lists, _Lists, _Lists, list[int], list[int]]:
    """Lay each bin's packs side by side: the sequences, and each pack's sequence and offset."""
    seq_of, offset = [0] * len(ids), [0] * len(ids)
    out_ids: list[list[int]] = []
    out_pos: list[list[int]] = []
    out_seg: list[list[int]] = []
    out_blk: list[list[int]] = []
    for b, packs in enumerate(bins):
        out_ids.append([])
        out_pos.append([])
        out_seg.append([])
        out_blk.append([])
        for i, k in enumerate(packs):
            seq_of[k], offset[k] = b, len(out_ids[b])
            out_ids[b] += ids[k]
            out_pos[b] += pos[k]
            out_seg[b] += seg[k]
            out_blk[b] += [i] * len(ids[k])
    return out_ids, out_pos, out_seg, out_blk, seq_of, offset


def packed_attention(
    segments: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]], width: int
) -> torch.Tensor:
    """Boolean attention mask (sequences, 1, width, width); True: the query may attend.

    Query i sees key k iff k <= i, both are in the same pack, and k is the pack's prompt or
    a token of i's own sample. Padding (right) is seen by no real token; a padding query
    sees the padding up to itself, so no row of the mask is empty (its outputs are unused).
    """
    seg = torch.full((len(segments), width), PAD_SEGMENT, dtype=torch.long)
    blk = torch.full((len(segments), width), -1, dtype=torch.long)
    for i, (s, b) in enumerate(zip(segments, blocks, strict=True)):
        seg[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        blk[i, : len(b)] = torch.as_tensor(list(b), dtype=torch.long)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    q, k = seg[:, :, None], seg[:, None, :]
    same_pack = blk[:, :, None] == blk[:, None, :]
    allowed = causal[None] & same_pack & ((k == -1) | (k == q))
    return allowed[:, None]


def micro_batch_order(
    lengths: Sequence[int],
    keys: Sequence[Hashable] | None = None,
    prompt_lengths: Sequence[int] | None = None,
) -> list[int]:
    """An order of rows in which consecutive rows have similar forward length (longest
    first), so that micro-batches cut from it carry little padding.

    Without ``keys`` each row is its own unit of length ``lengths[i]``. With ``keys`` (the
    rows' prompts, for packing) rows with equal keys stay together as one unit whose length
    is its packed length, ``prompt + sum(response - 1)`` (``prompt_lengths`` required); in
    a unit, longer rows come first. Ties keep the given order (stable).
    """
    n = len(lengths)
    if keys is None:
        return sorted(range(n), key=lambda i: -lengths[i])
    if prompt_lengths is None or len(keys) != n or len(prompt_lengths) != n:
        raise ValueError("micro_batch_order: keys need prompt_lengths, one per row")
    units: dict[Hashable, list[int]] = {}
    for i, key in enumerate(keys):
        units.setdefault(key, []).append(i)

    def packed(unit: list[int]) -> int:
        p = prompt_lengths[unit[0]]
        return p + sum(max(0, lengths[i] - p - 1) for i in unit)

    ordered = sorted(units.values(), key=lambda u: -packed(u))
    return [i for u in ordered for i in sorted(u, key=lambda i: -lengths[i])]
