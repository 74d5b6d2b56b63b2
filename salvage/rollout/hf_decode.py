"""The HF engine's own decode loop (``salvage.rollout.hf``'s docstring: **Decode loop**,
**Tall LM head**, **Compiled steps**): one prefill of the distinct prompts, then KV-cache
steps of the live rows, ``generate``'s sampling rule; the tall LM head swap.

Its names are importable from ``salvage.rollout.hf`` too.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

TALL_HEAD_MIN_ROWS = 8192


class _TallHead(torch.nn.Module):
    """A bias-free LM head computed as ``W @ h.T`` (see the module docstring)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        return torch.mm(self.head.weight, flat.t()).t().reshape(*h.shape[:-1], -1)


def tall_head_fits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s LM head may be computed as ``W @ h.T`` (``tall_head=None``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    w = head.weight
    cfg = getattr(model, "config", None)
    transforms = any(
        getattr(cfg, k, None) not in (None, 1.0)
        for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")
    )
    return (
        type(w.data) is torch.Tensor  # not a DTensor (FSDP) or another subclass
        and w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.shape[0] >= TALL_HEAD_MIN_ROWS
        and not transforms
    )


class HeadSwap:
    """Within the block, ``model``'s LM head is a ``_TallHead`` over the same weight.

    Reusable: entered again, it swaps in the same wrapper while the head is the same object
    (a compiled decode step guards on the modules it ran; a new wrapper would recompile it).
    """

    def __init__(self, model: Any, on: bool) -> None:
        self.model, self.on = model, on
        self.head: torch.nn.Linear | None = None
        self.tall: _TallHead | None = None

    def __enter__(self) -> None:
        if self.on:
            head = self.model.get_output_embeddings()
            if not isinstance(head, torch.nn.Linear) or head.bias is not None:
                raise ValueError(
                    "engine.hf_tall_head=true needs a bias-free torch.nn.Linear LM head, got "
                    f"{type(head).__name__}"
                )
            self.head = head
            if self.tall is None or self.tall.head is not head:
                self.tall = _TallHead(head)
            self.model.set_output_embeddings(self.tall)

    def __exit__(self, *exc: Any) -> None:
        if self.head is not None:
            self.model.set_output_embeddings(self.head)
            self.head = None


def nucleus_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` (B, V) with the tokens outside each row's nucleus set to -inf.

    Ascending by score, a token is cut while the probability mass up to and including it
    is at most ``1 - top_p``; the most likely token always stays. (``generate``'s rule,
    computed in the same order so that the same tokens survive.)
    """
    if top_p >= 1.0:
        return scores
    ordered, order = torch.sort(scores, dim=-1, descending=False)
    mass = ordered.softmax(dim=-1).cumsum(dim=-1)
    cut = mass <= 1.0 - top_p
    cut[:, -1] = False
    drop = torch.zeros_like(cut).scatter(1, order, cut)
    return scores.masked_fill(drop, float("-inf"))


def _sampled_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float
) -> torch.Tensor:
    """log_softmax(logits / T) at ``tokens`` (T = 1 when greedy): the behaviour log-prob."""
    t = temperature if temperature > 0 else 1.0
    lg = logits if t == 1.0 else logits / t
    return torch.log_softmax(lg, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def _unique_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first row of each distinct row of ``rows`` (in order of first appearance) and,
    per row, the position of its distinct row in that list."""
    seen: dict[tuple[int, ...], int] = {}
    uniq: list[int] = []
    where: list[int] = []
    for i, r in enumerate(rows.tolist()):
        k = tuple(r)
        if k not in seen:
            seen[k] = len(uniq)
            uniq.append(i)
        where.append(seen[k])
    dev = rows.device
    return torch.tensor(uniq, device=dev), torch.tensor(where, device=dev)


@torch.no_grad()
def decode(
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    max_new: int,
    temperature: float,
    top_p: float,
    eos_ids: set[int],
    pad_id: int,
    generator: torch.Generator | None,
    ended: Any = None,
    timings: dict[str, float] | None = None,
    runner: Any = None,
    runner_max_rows: int = 8,
) -> tuple[list[list[int]], list[list[float]]]:
    """Sample up to ``max_new`` tokens after each left-padded row of ``ids``.

    One prefill (of each distinct row once: the n samples of a prompt share it), then one
    forward of the last token per step with a ``DynamicCache``. A row ends at an eos
    token (kept), when ``ended(row, tokens)`` says so (stop strings), or at ``max_new``
    tokens; ended rows are dropped from the batch and the cache. Every step draws one
    multinomial over all rows (ended rows from a point mass on ``pad_id``), so the
    generator advances as in ``generate``. Returns the tokens and their behaviour
    log-probs (``log_softmax(logits / T)`` before the nucleus) per row. ``timings``, when
    given, gets ``prefill_s`` / ``decode_s`` added (seconds). Under ``HeadSwap(model, True)``
    the LM head runs as ``W @ h.T`` (the caller checks ``tall_head_fits``). ``runner``, when
    given, runs the KV-cache steps of at most ``runner_max_rows`` live rows instead of
    ``model`` (a ``torch.compile`` of it); the prefill and larger steps run ``model``.
    """
    lm: Any = model
    B = ids.shape[0]
    t0 = time.perf_counter()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    key = _cache_keyword(lm)
    cache, logits = _prefill(lm, ids, mask, pos, key)
    t1 = time.perf_counter()
    live = torch.arange(B, device=ids.device)  # original row of each batch row
    att = mask
    last = pos[:, -1:]
    toks: list[list[int]] = [[] for _ in range(B)]
    lps: list[list[float]] = [[] for _ in range(B)]
    for step in range(max_new):
        pick = _draw(logits, live, B, temperature, top_p, pad_id, generator)
        lp = _sampled_logprobs(logits, pick, temperature)
        keep = _append(live, pick, lp, toks, lps, eos_ids, ended)
        if not keep or step == max_new - 1:
            break
        small = runner is not None and len(keep) <= runner_max_rows
        live, att, last, logits = _step(
            runner if small else lm, cache, key, keep, live, pick, att, last
        )
    if timings is not None:
        timings["prefill_s"] = timings.get("prefill_s", 0.0) + t1 - t0
        timings["decode_s"] = timings.get("decode_s", 0.0) + time.perf_counter() - t1
    return toks, lps


def _step(
    lm: Any,
    cache: Any,
    key: str,
    keep: list[int],
    live: torch.Tensor,
    pick: torch.Tensor,
    att: torch.Tensor,
    last: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KV-cache step of the rows in ``keep``: (live, attention mask, positions, logits)."""
    nxt = pick[:, None]
    att = torch.cat([att, att.new_ones(att.shape[0], 1)], dim=1)
    last = last + 1
    if len(keep) < len(live):  # ended rows leave the batch and the cache
        sel = torch.tensor(keep, device=live.device)
        live, nxt, att, last = live[sel], nxt[sel], att[sel], last[sel]
        cache.batch_select_indices(sel)
    out = lm(
        input_ids=nxt,
        attention_mask=att,
        position_ids=last,
        **{key: cache},
        use_cache=True,
    )
    return live, att, last, out.logits[:, -1].float()


def _cache_keyword(lm: Any) -> str:
    """The cache keyword of ``lm.forward``: ``cache`` from transformers 5.2x,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def _prefill(
    lm: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, key: str
) -> tuple[Any, torch.Tensor]:
    """The prompts' forward: a ``DynamicCache`` of every row and the last position's logits
    (fp32). Rows with the same prompt (the n samples of a group) share one prefill: the
    distinct rows go through the model, their cache and logits are then copied to every row."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=lm.config)
    except TypeError:  # transformers < 4.56 takes no config
        cache = DynamicCache()
    uniq, first = _unique_rows(torch.cat([ids, mask.to(ids.dtype)], dim=1))
    out = lm(
        input_ids=ids[uniq],
        attention_mask=mask[uniq],
        position_ids=pos[uniq],
        **{key: cache},
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1].float()
    if len(uniq) < ids.shape[0]:
        cache.batch_select_indices(first)
        logits = logits[first]
    return cache, logits


def _draw(
    logits: torch.Tensor,
    live: torch.Tensor,
    B: int,
    temperature: float,
    top_p: float,
    pad_id: int,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """One token per live row: greedy, or one multinomial over all ``B`` rows of the chunk
    (ended rows from a point mass on ``pad_id``), so the generator advances as in
    ``generate``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    scores = nucleus_filter(logits / temperature if temperature != 1.0 else logits, top_p)
    probs = scores.softmax(dim=-1)
    if len(live) == B:
        full = probs
    else:
        full = probs.new_zeros(B, probs.shape[-1])
        full[:, pad_id] = 1.0
        full[live] = probs
    return torch.multinomial(full, 1, generator=generator).squeeze(1)[live]


def _append(
    live: torch.Tensor,
    pick: torch.Tensor,
    lp: torch.Tensor,
    toks: list[list[int]],
    lps: list[list[float]],
    eos_ids: set[int],
    ended: Any,
) -> list[int]:
    """Append each live row's token and log-prob to its row; the batch positions of the
    rows that go on (not at eos, not ``ended``)."""
    keep: list[int] = []
    for j, (row, t, v) in enumerate(zip(live.tolist(), pick.tolist(), lp.tolist(), strict=True)):
        toks[row].append(t)
        lps[row].append(v)
        if t in eos_ids or (ended is not None and ended(row, toks[row])):
            continue
        keep.append(j)
    return keep
