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


@dataclass(frozen=True)
class PackedLayout:
    """Packed sequences of a set of rows and the maps back to each row's log-probs."""

    input_ids: list[list[int]]
    """One sequence per distinct prompt: the prompt, then each sample's response minus its
    last token."""
    position_ids: list[list[int]]
    """Per packed token: its position in the row's own unpacked sequence."""
    segments: list[list[int]]
    """Per packed token: -1 for the shared prompt, j >= 0 for the j-th sample of the pack."""
    row_pack: list[int]
    """The pack that holds each row."""
    row_positions: list[list[int]]
    """Per row: the packed positions whose logits predict its response tokens, in order."""
    row_targets: list[list[int]]
    """Per row: its response tokens (the targets of ``row_positions``)."""
    row_start: list[int]
    """Per row: ``start`` (where its response log-probs go in ``seq[1:]``-aligned tensors)."""

    @property
    def width(self) -> int:
        """The longest packed sequence."""
        return max((len(s) for s in self.input_ids), default=0)

    @property
    def first_needed(self) -> int:
        """The first packed position whose logits some row needs (the LM head starts there)."""
        return min((p[0] for p in self.row_positions if p), default=0)


def prompt_key(seq: Sequence[int], start: int) -> tuple[int, ...]:
    """The prompt of a row (``seq[: start + 1]``): rows with equal keys share a pack."""
    return tuple(seq[: start + 1])


def has_shared_prompt(seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> bool:
    """Whether two rows share a prompt (otherwise packing saves nothing)."""
    keys = [prompt_key(s, a) for s, a in zip(seqs, starts, strict=True)]
    return len(set(keys)) < len(keys)


def pack_rows(seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> PackedLayout:
    """Pack rows that share a prompt into one sequence each (packs in first-seen order)."""
    if len(seqs) != len(starts):
        raise ValueError(f"pack_rows: {len(seqs)} sequences but {len(starts)} starts")
    pack_of: dict[tuple[int, ...], int] = {}
    ids: list[list[int]] = []
    pos: list[list[int]] = []
    seg: list[list[int]] = []
    members: list[int] = []
    row_pack, row_positions, row_targets = [], [], []
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
    return PackedLayout(ids, pos, seg, row_pack, row_positions, row_targets, list(starts))


def packed_attention(segments: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """Boolean attention mask (packs, 1, width, width); True: the query may attend the key.

    Query i sees key k iff k <= i and k is a prompt token or a token of i's own sample.
    Padding (right, segment ``PAD_SEGMENT``) is seen by no real token; a padding query sees
    the prompt and padding so no row of the mask is empty (its outputs are never used).
    """
    seg = torch.full((len(segments), width), PAD_SEGMENT, dtype=torch.long)
    for i, s in enumerate(segments):
        seg[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    q, k = seg[:, :, None], seg[:, None, :]
    allowed = causal[None] & ((k == -1) | (k == q))
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
