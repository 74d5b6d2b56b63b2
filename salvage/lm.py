"""Small LM utilities shared by rollout engines and modules: padding, token log-probs, and
the weights version an engine holding a copy of a policy syncs on."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from salvage.core.losses import seq_mean_logprob
from salvage.types import SeqTarget

_VERSIONS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()


def weights_version(model: torch.nn.Module) -> int:
    """How many updates changed ``model``'s weights (0 for a model never updated)."""
    return _VERSIONS.get(model, 0)


def bump_weights_version(model: torch.nn.Module) -> int:
    """Count one update of ``model`` (engines holding a copy, vLLM, re-sync on a new version)."""
    _VERSIONS[model] = weights_version(model) + 1
    return _VERSIONS[model]


def pad_right(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists: positions start at 0 in every row, as in an unpadded pass."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask


def pad_left(
    seqs: Sequence[Sequence[int]], pad_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists (for generation: new tokens are appended on the right)."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask


DEFAULT_LOGPROB_CHUNK = 1024
"""Positions per LM-head chunk of ``token_logprobs`` when the model sets none (0: unchunked)."""

_LOGIT_MODIFIERS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config keys of models whose forward changes the LM head's output (soft-capping, scaling):
the chunked path, which replaces that output, falls back to full logits for them."""


def logprob_chunk_size(model: torch.nn.Module) -> int:
    """The LM-head chunk ``token_logprobs`` uses for ``model`` (``set_logprob_chunk_size``)."""
    return int(getattr(model, "_salvage_logprob_chunk", DEFAULT_LOGPROB_CHUNK))


def set_logprob_chunk_size(model: torch.nn.Module, chunk: int) -> None:
    """Score ``model``'s tokens ``chunk`` positions at a time (0: the full logits at once)."""
    if chunk < 0:
        raise ValueError(f"logprob_chunk_size must be >= 0, got {chunk}")
    setattr(model, "_salvage_logprob_chunk", int(chunk))  # noqa: B010 - read by token_logprobs


class _ChunkedHead(torch.nn.Module):
    """Stands in for a causal LM's head during one forward: returns the targets' log-probs
    (B, n), computed ``chunk`` positions at a time, instead of the logits (B, T, V).

    It runs inside the model's forward, so an FSDP2 root has its parameters gathered as for
    the head itself. With gradients each chunk is checkpointed: only its hidden states are
    kept and the head, log-softmax and gather are recomputed in the backward, so no more
    than ``chunk x V`` logits are alive at once in either pass.
    """

    def __init__(self, head: torch.nn.Module, chunk: int, temperature: float) -> None:
        super().__init__()
        self.head = head
        self.chunk = chunk
        self.temperature = temperature
        self.targets: torch.Tensor | None = None
        self.items: tuple[torch.Tensor, torch.Tensor] | None = None
        """Packed sequences: (sequence, kept position) of each target in ``targets`` (N,),
        a position possibly repeated (a shared prompt's last position predicts the first
        token of every sample); the head then returns the N log-probs."""

    def score(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lg = self.head(hidden).float()
        if self.temperature != 1.0:
            lg = lg / self.temperature
        return torch.log_softmax(lg, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        targets = self.targets
        if targets is None:
            raise RuntimeError("_ChunkedHead called without targets")
        if self.items is not None:  # packed: the listed positions, one target each
            h = hidden[self.items[0], self.items[1]]
            flat = targets
            B, n = 1, targets.shape[0]
        else:  # the positions that predict the targets: all kept ones but the last
            B, n = targets.shape
            h = hidden[:, hidden.shape[1] - n - 1 : -1].reshape(B * n, hidden.shape[-1])
            flat = targets.reshape(B * n)
        parts = []
        for s in range(0, B * n, self.chunk):
            hc, tc = h[s : s + self.chunk], flat[s : s + self.chunk]
            if torch.is_grad_enabled():
                got = checkpoint(self.score, hc, tc, use_reentrant=False, preserve_rng_state=False)
                parts.append(cast(torch.Tensor, got))
            else:
                parts.append(self.score(hc, tc))
        if not parts:
            return hidden.new_zeros((B, n), dtype=torch.float32)
        return torch.cat(parts).reshape(B, n)


def _head_name(model: torch.nn.Module) -> str | None:
    """The attribute holding ``model``'s LM head, when the chunked path can replace it."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Module):
        return None
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in _LOGIT_MODIFIERS):
        return None
    for name, child in model.named_children():
        if child is head:
            return name
    return None


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    first: int = 0,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log pi(x_t | x_<t) / T-tempered, for t = 1..T-1; shape (B, T-1), float32.

    Rows must be right-padded (see ``pad_right``) so that positions match an unpadded
    forward pass. Values at padded positions are meaningless; mask them.
    ``first``: output positions before it are not needed (prompt tokens): the LM head and
    the log-softmax run only from there (HF ``logits_to_keep``; the same values, the
    skipped positions are 0).
    ``chunk_size``: positions (over all rows) per LM-head chunk, so at most ``chunk_size x
    vocab`` logits exist at once instead of ``B x T x vocab`` (the largest activation for a
    150K vocabulary); 0: the full logits; None: the model's own setting
    (``set_logprob_chunk_size``, default ``DEFAULT_LOGPROB_CHUNK``). The same values and
    gradients either way (up to float rounding). Models without a replaceable head, or whose
    forward rescales the logits, take the full-logits path.
    """
    T = input_ids.shape[1]
    first = max(0, min(int(first), T - 1))
    chunk = logprob_chunk_size(model) if chunk_size is None else int(chunk_size)
    name = _head_name(model) if chunk > 0 else None
    if name is None:
        return _full_logprobs(model, input_ids, attention_mask, temperature, first)
    head = getattr(model, name)
    wrapper = _ChunkedHead(head, chunk, temperature)
    setattr(model, name, wrapper)

    def aim(f: int) -> None:  # the targets of the positions kept from ``f``
        wrapper.targets = input_ids[:, 1 + f :]

    try:
        out, first = _forward_from(model, input_ids, attention_mask, first, aim)
    finally:
        setattr(model, name, head)
    got = out.logits
    if first:
        got = torch.cat([got.new_zeros(got.shape[0], first), got], dim=1)
    return got


def _forward_from(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    first: int,
    before: Callable[[int], None] | None = None,
) -> tuple[Any, int]:
    """The model's forward with the LM head from position ``first`` on (HF
    ``logits_to_keep``); a model without ``logits_to_keep`` runs it on every position
    (``first`` becomes 0). ``before(first)`` runs before each call. Returns (output, first)."""
    if first:
        if before is not None:
            before(first)
        try:
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                logits_to_keep=input_ids.shape[1] - first,
            )
            return out, first
        except TypeError:  # a model without logits_to_keep: score every position
            pass
    if before is not None:
        before(0)
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False), 0


def _full_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    first: int,
) -> torch.Tensor:
    """``token_logprobs`` from the full logits of the scored positions."""
    out, first = _forward_from(model, input_ids, attention_mask, first)
    logits = out.logits[:, :-1, :]
    targets = input_ids[:, 1 + first :]
    rows = []
    for i in range(logits.shape[0]):  # one row at a time: bounds the fp32 copy to T x V
        lg = logits[i].float()
        if temperature != 1.0:
            lg = lg / temperature
        lp = torch.log_softmax(lg, dim=-1)
        rows.append(lp.gather(-1, targets[i].unsqueeze(-1)).squeeze(-1))
    got = torch.stack(rows, dim=0)
    if first:
        got = torch.cat([got.new_zeros(got.shape[0], first), got], dim=1)
    return got


@torch.no_grad()
def response_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    pad_id: int,
    temperature: float = 1.0,
    batch_size: int = 8,
    *,
    packed: bool = False,
) -> list[list[float]]:
    """Log-probs of each response token given its prompt, by teacher-forced forward passes.

    ``packed``: responses of a shared prompt in one packed sequence per batch of
    ``batch_size`` (``packed_token_logprobs``; the same values)."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            ps = prompts[start : start + batch_size]
            rs = responses[start : start + batch_size]
            seqs = [list(p) + list(r) for p, r in zip(ps, rs, strict=True)]
            starts = [len(p) - 1 for p in ps]
            lp = _score_rows(model, seqs, starts, pad_id, temperature, device, packed)
            for i, (a, r) in enumerate(zip(starts, rs, strict=True)):
                out.append(lp[i, a : a + len(r)].tolist())
    finally:
        model.train(was_training)
    return out


def target_scores(
    model: torch.nn.Module,
    targets: Sequence[SeqTarget],
    pad_id: int,
    device: torch.device | str | None,
    *,
    packed: bool = False,
) -> torch.Tensor:
    """s(y|h) per target: the mean log-prob of its counted response tokens (temperature 1).

    The one masked-likelihood score of the package: VH-GPO's pair / bridge / resume terms
    and SGT's NLL term (``-s``) all score with it. Differentiable (no ``no_grad``).
    ``packed``: targets that share a prompt in one packed sequence (the same values).
    """
    seqs = [t.prompt_ids + t.response_ids for t in targets]
    starts = [len(t.prompt_ids) - 1 for t in targets]
    lp = _score_rows(model, seqs, starts, pad_id, 1.0, device, packed)
    count = torch.zeros_like(lp)
    for i, t in enumerate(targets):
        m = t.mask if t.mask is not None else [1] * len(t.response_ids)
        a = len(t.prompt_ids) - 1
        count[i, a : a + len(m)] = torch.tensor(m, dtype=lp.dtype, device=lp.device)
    return seq_mean_logprob(lp, count)


PACKABLE_ATTENTION = ("sdpa", "eager")
"""HF attention implementations that take the packed 4-D mask (others score unpacked)."""


def packable(model: torch.nn.Module) -> bool:
    """Whether ``model`` scores packed sequences exactly: an HF model whose attention takes
    a custom 4-D mask as given (``sdpa``, ``eager``: transformers' ``masking_utils`` passes a
    4-D mask through) and has only full-attention layers (a sliding window would be lost
    under the custom mask)."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) not in PACKABLE_ATTENTION:
        return False
    if getattr(cfg, "use_sliding_window", False):
        return False
    kinds = getattr(cfg, "layer_types", None) or ["full_attention"]
    return all(k == "full_attention" for k in kinds)


def packed_token_logprobs(
    model: torch.nn.Module,
    seqs: Sequence[Sequence[int]],
    starts: Sequence[int],
    pad_id: int,
    temperature: float = 1.0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``token_logprobs`` of right-padded ``seqs`` with each prompt computed once.

    Rows that share a prompt (``seq[: start + 1]``) are scored in one packed sequence
    (``salvage.core.packing``). Returns the unpacked layout, shape (B, max len - 1), float32:
    each row's response log-probs at ``[start, len(seq) - 1)``, 0 elsewhere. Without a
    shared prompt, or for a model that cannot take the mask (``packable``), it scores
    unpacked (the prompt positions then hold their log-probs; mask them either way).
    """
    from salvage.core.packing import has_shared_prompt, pack_rows, packed_attention

    if not packable(model) or min(starts, default=-1) < 0 or not has_shared_prompt(seqs, starts):
        ids, mask = pad_right(seqs, pad_id, device)
        return token_logprobs(model, ids, mask, temperature, first=min(starts, default=0))
    layout = pack_rows(seqs, starts)
    ids, _ = pad_right(layout.input_ids, pad_id, device)
    pos, _ = pad_right(layout.position_ids, 0, device)
    allowed = packed_attention(layout.segments, layout.blocks, ids.shape[1]).to(ids.device)
    mask = _packed_mask(model, allowed)
    chunk = logprob_chunk_size(model)
    name = _head_name(model) if chunk > 0 else None
    if name is not None:  # the LM head in chunks, as token_logprobs (one target per position)
        return _packed_chunked(model, name, chunk, layout, ids, mask, pos, seqs, temperature)
    return _packed_full(model, layout, ids, mask, pos, seqs, temperature)


def _packed_mask(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """The packed attention mask as the model's attention takes it (additive for eager)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == "eager":  # eager adds the mask to the scores: 0 / most negative
        dtype = cast(Any, model).get_input_embeddings().weight.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return allowed


def _packed_full(
    model: torch.nn.Module,
    layout: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    seqs: Sequence[Sequence[int]],
    temperature: float,
) -> torch.Tensor:
    """``packed_token_logprobs`` from the full logits of the needed positions, per sequence."""
    W = ids.shape[1]
    first = layout.first_needed
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=pos,
        use_cache=False,
        logits_to_keep=W - first,
    )
    logits = out.logits  # (sequences, W - first, V)
    width = max(len(s) for s in seqs) - 1
    rows_at: list[int] = []
    cols_at: list[int] = []
    vals: list[torch.Tensor] = []
    for k in range(len(layout.input_ids)):
        mine = [r for r, p in enumerate(layout.row_seq) if p == k and layout.row_positions[r]]
        if not mine:
            continue
        at = [q - first for r in mine for q in layout.row_positions[r]]
        tgt = [t for r in mine for t in layout.row_targets[r]]
        lg = logits[k, torch.as_tensor(at, device=logits.device)].float()
        if temperature != 1.0:
            lg = lg / temperature
        lp = torch.log_softmax(lg, dim=-1)
        vals.append(lp.gather(-1, torch.as_tensor(tgt, device=lp.device)[:, None]).squeeze(-1))
        for r in mine:
            n = len(layout.row_targets[r])
            rows_at += [r] * n
            cols_at += range(layout.row_start[r], layout.row_start[r] + n)
    got = torch.zeros(len(seqs), width, dtype=torch.float32, device=logits.device)
    if not vals:
        return got
    index = (
        torch.as_tensor(rows_at, device=got.device),
        torch.as_tensor(cols_at, device=got.device),
    )
    return got.index_put(index, torch.cat(vals))


def _packed_chunked(
    model: torch.nn.Module,
    name: str,
    chunk: int,
    layout: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    pos: torch.Tensor,
    seqs: Sequence[Sequence[int]],
    temperature: float,
) -> torch.Tensor:
    """``packed_token_logprobs`` with the LM head run ``chunk`` scored tokens at a time: the
    head gets the (sequence, position, target) of every needed token and returns their
    log-probs, which go back to each row's layout."""
    first = layout.first_needed
    rows_at: list[int] = []
    cols_at: list[int] = []
    seq_at: list[int] = []
    pos_at: list[int] = []
    tgt: list[int] = []
    for r, k in enumerate(layout.row_seq):
        at = [q - first for q in layout.row_positions[r]]
        n = len(at)
        rows_at += [r] * n
        cols_at += range(layout.row_start[r], layout.row_start[r] + n)
        seq_at += [k] * n
        pos_at += at
        tgt += list(layout.row_targets[r])
    width = max(len(s) for s in seqs) - 1
    dev = ids.device
    got = torch.zeros(len(seqs), width, dtype=torch.float32, device=dev)
    if not tgt:
        return got
    head = getattr(model, name)
    wrapper = _ChunkedHead(head, chunk, temperature)
    wrapper.targets = torch.as_tensor(tgt, device=dev)
    wrapper.items = (torch.as_tensor(seq_at, device=dev), torch.as_tensor(pos_at, device=dev))
    setattr(model, name, wrapper)
    try:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            use_cache=False,
            logits_to_keep=ids.shape[1] - first,
        )
    finally:
        setattr(model, name, head)
    vals = out.logits.reshape(-1)  # the N scored tokens' log-probs, in order
    index = (torch.as_tensor(rows_at, device=dev), torch.as_tensor(cols_at, device=dev))
    return got.index_put(index, vals.to(got.device))


def _score_rows(
    model: torch.nn.Module,
    seqs: Sequence[Sequence[int]],
    starts: Sequence[int],
    pad_id: int,
    temperature: float,
    device: torch.device | str | None,
    packed: bool,
) -> torch.Tensor:
    """Token log-probs of ``seqs`` whose responses start after ``starts`` (B, max len - 1):
    packed (each shared prompt once) or one right-padded row each."""
    if packed:
        return packed_token_logprobs(model, seqs, starts, pad_id, temperature, device)
    ids, mask = pad_right(seqs, pad_id, device)
    return token_logprobs(model, ids, mask, temperature, first=min(starts, default=0))
