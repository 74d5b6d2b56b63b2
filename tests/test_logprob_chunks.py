"""Chunked token log-probs (``salvage.lm.token_logprobs(chunk_size=...)``): the LM head and
the log-softmax run a bounded number of positions at a time, with the values and gradients
of the full-logits pass."""

from __future__ import annotations

import pytest
import torch

from salvage.lm import logprob_chunk_size, pad_right, set_logprob_chunk_size, token_logprobs
from salvage.models import PolicySpec, load_policy


@pytest.fixture(scope="module")
def model_tok():
    return load_policy(PolicySpec("tiny"))


def _batch(tok):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, len(tok), (n,), generator=g).tolist() for n in (17, 11, 23)]
    return pad_right(seqs, int(tok.pad_token_id))


def _run(model, ids, mask, temperature, first, chunk):
    """Log-probs and parameter gradients of a weighted sum over the real positions."""
    model.zero_grad(set_to_none=True)
    lp = token_logprobs(model, ids, mask, temperature, first=first, chunk_size=chunk)
    w = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape) * mask[:, 1:]
    (lp * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), grads


@pytest.mark.parametrize("first", [0, 5])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(model_tok, first, temperature):
    model, tok = model_tok
    ids, mask = _batch(tok)
    full, g_full = _run(model, ids, mask, temperature, first, 0)
    assert full.shape == (3, ids.shape[1] - 1)
    for chunk in (1, 7, 4096):  # one position, chunks across rows, one chunk for everything
        got, g = _run(model, ids, mask, temperature, first, chunk)
        assert got.shape == full.shape and got.dtype == torch.float32
        assert float((got - full).abs().max()) <= 1e-6, chunk
        assert torch.all(got[:, :first] == 0)
        assert set(g) == set(g_full) and len(g) == len(list(model.parameters()))
        for n, gf in g_full.items():  # float rounding only: relative to the gradient's size
            assert float((g[n] - gf).abs().max()) <= 1e-6 * max(1.0, float(gf.abs().max())), n


def test_the_head_sees_at_most_a_chunk_of_positions(model_tok):
    model, tok = model_tok
    ids, mask = _batch(tok)
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape[-2]))
    try:
        with torch.no_grad():
            token_logprobs(model, ids, mask, 1.0, first=2, chunk_size=8)
        n = 3 * (ids.shape[1] - 1 - 2)  # scored positions over all rows
        assert seen == [8] * (n // 8) + ([n % 8] if n % 8 else [])
        seen.clear()
        lp = token_logprobs(model, ids, mask, 1.0, first=2, chunk_size=8)
        lp.sum().backward()  # each chunk recomputed once in the backward (checkpointed)
        assert len(seen) == 2 * -(-n // 8) and max(seen) == 8
        seen.clear()
        with torch.no_grad():
            token_logprobs(model, ids, mask, 1.0, first=2, chunk_size=0)
        assert seen == [ids.shape[1] - 2]  # the full pass: every kept position at once
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    assert model.lm_head is model.get_output_embeddings()  # the head is back in place


def test_logit_rescaling_models_take_the_full_path(model_tok):
    """A forward that rescales the head's output (soft-capping) cannot be chunked: full path."""
    model, tok = model_tok
    ids, mask = _batch(tok)
    seen: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda m, a, out: seen.append(out.shape[-2]))
    model.config.final_logit_softcapping = 30.0
    try:
        with torch.no_grad():
            token_logprobs(model, ids, mask, 1.0, chunk_size=4)
    finally:
        hook.remove()
        del model.config.final_logit_softcapping
    assert seen == [ids.shape[1]]


def test_modules_set_the_chunk_on_their_models():
    from salvage.modules.grpo import GRPOModule

    m = GRPOModule(policy=PolicySpec("tiny"), kl_coef=0.1, logprob_chunk_size=3)
    m.build()
    assert logprob_chunk_size(m.policy) == 3 and logprob_chunk_size(m.reference) == 3
    with pytest.raises(ValueError, match="model.logprob_chunk_size"):
        GRPOModule(policy=PolicySpec("tiny"), logprob_chunk_size=-1)
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        set_logprob_chunk_size(m.policy, -2)
