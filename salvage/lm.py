"""Small LM utilities shared by rollout engines and modules: padding, token log-probs, and
the weights version an engine holding a copy of a policy syncs on."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

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


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float = 1.0,
    first: int = 0,
) -> torch.Tensor:
    """log pi(x_t | x_<t) / T-tempered, for t = 1..T-1; shape (B, T-1), float32.

    Rows must be right-padded (see ``pad_right``) so that positions match an unpadded
    forward pass. Values at padded positions are meaningless; mask them.
    ``first``: output positions before it are not needed (prompt tokens): the LM head and
    the log-softmax run only from there (HF ``logits_to_keep``; the same values, the
    skipped positions are 0).
    """
    T = input_ids.shape[1]
    first = max(0, min(int(first), T - 1))
    if first:
        try:
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                logits_to_keep=T - first,
            )
        except TypeError:  # a model without logits_to_keep: score every position
            first = 0
    if not first:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
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
) -> list[list[float]]:
    """Log-probs of each response token given its prompt, by teacher-forced forward passes."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            ps = prompts[start : start + batch_size]
            rs = responses[start : start + batch_size]
            seqs = [list(p) + list(r) for p, r in zip(ps, rs, strict=True)]
            ids, mask = pad_right(seqs, pad_id, device)
            lp = token_logprobs(model, ids, mask, temperature, first=min(len(p) for p in ps) - 1)
            for i, (p, r) in enumerate(zip(ps, rs, strict=True)):
                a = len(p) - 1
                out.append(lp[i, a : a + len(r)].tolist())
    finally:
        model.train(was_training)
    return out


def target_scores(
    model: torch.nn.Module,
    targets: Sequence[SeqTarget],
    pad_id: int,
    device: torch.device | str | None,
) -> torch.Tensor:
    """s(y|h) per target: the mean log-prob of its counted response tokens (temperature 1).

    The one masked-likelihood score of the package: VH-GPO's pair / bridge / resume terms
    and SGT's NLL term (``-s``) all score with it. Differentiable (no ``no_grad``).
    """
    ids, mask = pad_right([t.prompt_ids + t.response_ids for t in targets], pad_id, device)
    lp = token_logprobs(model, ids, mask, 1.0)
    count = torch.zeros_like(lp)
    for i, t in enumerate(targets):
        m = t.mask if t.mask is not None else [1] * len(t.response_ids)
        a = len(t.prompt_ids) - 1
        count[i, a : a + len(m)] = torch.tensor(m, dtype=lp.dtype, device=lp.device)
    return seq_mean_logprob(lp, count)
