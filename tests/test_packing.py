"""Prompt packing and length-aware micro-batches (two of the rollout and update speed-ups).

Core: the packed layout, mask and order by hand. Shell: one update of the real ``tiny``
model, packed and/or length-ordered vs the unpacked, shuffled update, for GRPO on math
groups (with and without the KL reference pass), VH-GPO's auxiliary terms and GRAFT's
peer rows: parameters after the update agree within 1e-5.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from salvage.core.grpo import assign_advantages
from salvage.core.packing import (
    JOIN_CAPACITY,
    PAD_SEGMENT,
    first_fit_decreasing,
    has_shared_prompt,
    join_packs,
    micro_batch_order,
    pack_rows,
    packed_attention,
)
from salvage.lm import packed_token_logprobs, pad_right, token_logprobs
from salvage.models import PolicySpec
from salvage.types import Group, RelayData, RolloutBatch, SeqTarget, Trajectory, Turn


# ----------------------------------------------------------------------------- core
def test_pack_rows_by_hand():
    # rows: prompt [5, 6] + [7, 8, 9]; prompt [5, 6] + [10, 11]; prompt [5] + [6, 7]
    seqs = [[5, 6, 7, 8, 9], [5, 6, 10, 11], [5, 6, 7]]
    starts = [1, 1, 0]
    lay = pack_rows(seqs, starts, join=False)
    # pack 0: prompt 5 6 (pos 0 1), sample 0 minus its last token: 7 8 (pos 2 3),
    # sample 1 minus its last token: 10 (pos 2); pack 1: prompt 5, then 6 (pos 1)
    assert lay.input_ids == [[5, 6, 7, 8, 10], [5, 6]]
    assert lay.position_ids == [[0, 1, 2, 3, 2], [0, 1]]
    assert lay.segments == [[-1, -1, 0, 0, 1], [-1, 0]]
    assert lay.blocks == [[0] * 5, [0, 0]]
    assert lay.row_seq == [0, 0, 1]
    # the prompt's last position (1) predicts the first token of both samples of pack 0
    assert lay.row_positions == [[1, 2, 3], [1, 4], [0, 1]]
    assert lay.row_targets == [[7, 8, 9], [10, 11], [6, 7]]
    assert lay.row_start == [1, 1, 0]
    assert lay.width == 5 and lay.first_needed == 0
    assert has_shared_prompt(seqs, starts) and not has_shared_prompt(seqs[1:], starts[1:])
    with pytest.raises(ValueError, match="row 0 has start 4"):
        pack_rows([[1, 2, 3, 4]], [4])


def test_packs_join_where_they_fit_by_hand():
    assert first_fit_decreasing([5, 2, 3], 5) == [[0], [2, 1]]
    assert first_fit_decreasing([5, 2, 3], 10) == [[0, 2, 1]]
    # join_packs: capacities 199 .. 2 x 199 = 398 (JOIN_CAPACITY 2); positions run =
    # sequences x width: cap 199 -> 3 x 199 = 597; cap 238 (122 + 116) -> [199], [122, 116]:
    # 2 x 238 = 476; cap 315 -> [199, 116], [122]: 2 x 315 = 630; cap 321 -> 642; the sum
    # 437 > 398 is out of bounds. Best: 476
    assert JOIN_CAPACITY == 2
    assert join_packs([199, 122, 116]) == [[0], [1, 2]]
    # equal cost (4 x 4 = 2 x 8 = 16): the narrower layout
    assert join_packs([4, 4, 4, 4]) == [[0], [1], [2], [3]]
    # packs: A = [5, 6, 7, 8, 10] (5 tokens), B = [5, 6] (2), C = prompt [9] + [8, 7, 6] ->
    # [9, 8, 7] (3): [A], [C, B] (2 x 5 = 10, as wide as A alone) beats one sequence of 10
    seqs = [[5, 6, 7, 8, 9], [5, 6, 10, 11], [5, 6, 7], [9, 8, 7, 6]]
    starts = [1, 1, 0, 0]
    lay = pack_rows(seqs, starts)
    assert lay.input_ids == [[5, 6, 7, 8, 10], [9, 8, 7, 5, 6]]
    assert lay.position_ids == [[0, 1, 2, 3, 2], [0, 1, 2, 0, 1]]
    assert lay.segments == [[-1, -1, 0, 0, 1], [-1, 0, 0, -1, 0]]
    assert lay.blocks == [[0] * 5, [0, 0, 0, 1, 1]]
    assert lay.row_seq == [0, 0, 1, 1]
    # B sits at offset 3 of sequence 1: its positions 0, 1 -> 3, 4
    assert lay.row_positions == [[1, 2, 3], [1, 4], [3, 4], [0, 1, 2]]
    assert pack_rows(seqs, starts, join=False).input_ids == [[5, 6, 7, 8, 10], [5, 6], [9, 8, 7]]
    m = packed_attention(lay.segments, lay.blocks, lay.width)
    # sequence 1: C's tokens see C's prompt and their own sample; B's tokens see only B
    assert m[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_packed_attention_by_hand():
    # pack 0 of the first test: segments [-1, -1, 0, 0, 1]; a second pack [-1, 0] padded to 5
    m = packed_attention([[-1, -1, 0, 0, 1], [-1, 0]], [[0] * 5, [0, 0]], 5)
    assert m.shape == (2, 1, 5, 5) and m.dtype == torch.bool
    want0 = [
        [1, 0, 0, 0, 0],  # prompt token 0: itself
        [1, 1, 0, 0, 0],  # prompt token 1: the prompt
        [1, 1, 1, 0, 0],  # sample 0, first input: prompt + itself
        [1, 1, 1, 1, 0],  # sample 0, second input
        [1, 1, 0, 0, 1],  # sample 1: the prompt and itself, not sample 0
    ]
    # padding (segment PAD_SEGMENT) is seen by no real token; a padding query sees the
    # padding up to itself
    want1 = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert m[0, 0].int().tolist() == want0 and m[1, 0].int().tolist() == want1
    assert PAD_SEGMENT == -2


def test_micro_batch_order_by_hand():
    # unpacked: longest first, ties in the given order
    assert micro_batch_order([3, 9, 5, 9]) == [1, 3, 2, 0]
    # packed: rows 0, 2, 3 share prompt "a" (length 4), row 1 has prompt "b" (length 10);
    # packed lengths: a = 4 + (7-5) + (6-5) + (9-5) = 11, b = 10 + (12-11) = 11 -> tie: a first
    # (first seen); in a unit longer rows first: 3 (9), 0 (7), 2 (6)
    keys = ["a", "b", "a", "a"]
    assert micro_batch_order([7, 12, 6, 9], keys, [4, 10, 4, 4]) == [3, 0, 2, 1]
    # b grows by one token: b = 12 > a = 11 comes first
    assert micro_batch_order([7, 13, 6, 9], keys, [4, 10, 4, 4]) == [1, 3, 0, 2]
    with pytest.raises(ValueError, match="prompt_lengths"):
        micro_batch_order([1, 2], ["a", "b"])


# ----------------------------------------------------------------------------- lm
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_token_logprobs_equal_unpacked_on_tiny(impl):
    from salvage.models import load_model, load_tokenizer

    spec = PolicySpec("tiny")
    tok = load_tokenizer(spec)
    model = load_model(spec, tok)
    model.config._attn_implementation = impl
    gen = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(5, 400, (n,), generator=gen).tolist()  # noqa: E731
    p1, p2 = rand(7), rand(4)
    seqs = [p1 + rand(n) for n in (5, 3, 1, 6)] + [p2 + rand(n) for n in (2, 4)] + [rand(5)]
    starts = [6] * 4 + [3] * 2 + [1]
    got = packed_token_logprobs(model, seqs, starts, tok.pad_token_id, 0.7)
    ids, mask = pad_right(seqs, tok.pad_token_id)
    want = token_logprobs(model, ids, mask, 0.7)
    assert got.shape == want.shape
    sel = torch.zeros_like(want, dtype=torch.bool)
    for i, (s, a) in enumerate(zip(seqs, starts, strict=True)):
        sel[i, a : len(s) - 1] = True
    assert (got[~sel] == 0).all()
    assert torch.allclose(got[sel], want[sel], atol=1e-5)
    # the gradients agree too (the shared prompt's logits feed several rows)
    got[sel].sum().backward()
    g_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want[sel].sum().backward()
    for a, b in zip(g_packed, (p.grad for p in model.parameters()), strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_packed_sequences_take_the_lm_head_in_chunks():
    """Packed scoring runs the head ``logprob_chunk_size`` scored tokens at a time (a shared
    prompt's last position scored once per sample) with the same values and gradients as
    the full logits."""
    from salvage.lm import set_logprob_chunk_size
    from salvage.models import load_model, load_tokenizer

    spec = PolicySpec("tiny")
    tok = load_tokenizer(spec)
    model = load_model(spec, tok)
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(5, 400, (n,), generator=gen).tolist()  # noqa: E731
    p1, p2 = rand(6), rand(3)
    seqs = [p1 + rand(n) for n in (4, 2, 5)] + [p2 + rand(n) for n in (3, 1)]
    starts = [5] * 3 + [2] * 2
    seen = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[-2]))
    results = {}
    for chunk in (0, 3, 1024):
        set_logprob_chunk_size(model, chunk)
        seen.clear()
        model.zero_grad()
        lp = packed_token_logprobs(model, seqs, starts, tok.pad_token_id, 0.7)
        lp.sum().backward()
        results[chunk] = (lp.detach(), [p.grad.clone() for p in model.parameters()], list(seen))
    hook.remove()
    full, g_full, _ = results[0]
    n_scored = sum(len(s) - 1 - a for s, a in zip(seqs, starts, strict=True))
    for chunk in (3, 1024):
        lp, grads, sizes = results[chunk]
        assert (lp - full).abs().max() <= 1e-6
        for a, b in zip(grads, g_full, strict=True):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
        assert max(sizes) <= chunk  # never more than one chunk of logits at once
    # every scored token once per pass (and once more in the backward recomputation)
    assert sum(results[3][2]) == 2 * n_scored


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_token_logprobs_under_bf16(impl):
    """bf16 weights (the eager mask is bf16 too) and bf16 autocast: finite, and as close to
    the unpacked values as bf16 rounding allows (measured max 1.4e-3 sdpa, 0 eager)."""
    from salvage.models import load_model, load_tokenizer

    spec = PolicySpec("tiny")
    tok = load_tokenizer(spec)
    model = load_model(spec, tok)
    model.config._attn_implementation = impl
    gen = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(5, 400, (n,), generator=gen).tolist()  # noqa: E731
    p = rand(9)
    seqs = [p + rand(n) for n in (6, 2, 4)] + [rand(7)]
    starts = [8, 8, 8, 3]
    ids, mask = pad_right(seqs, tok.pad_token_id)
    sel = torch.zeros(len(seqs), ids.shape[1] - 1, dtype=torch.bool)
    for i, (s, a) in enumerate(zip(seqs, starts, strict=True)):
        sel[i, a : len(s) - 1] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = packed_token_logprobs(model, seqs, starts, tok.pad_token_id)
        want = token_logprobs(model, ids, mask)
    assert torch.isfinite(got).all() and (got[sel] - want[sel]).abs().max() < 0.02
    model.to(torch.bfloat16)
    got = packed_token_logprobs(model, seqs, starts, tok.pad_token_id)
    want = token_logprobs(model, ids, mask)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got[sel] - want[sel]).abs().max() < 0.02


def test_models_that_cannot_take_the_mask_score_unpacked():
    from salvage.lm import packable
    from salvage.models import load_model, load_tokenizer

    spec = PolicySpec("tiny")
    tok = load_tokenizer(spec)
    model = load_model(spec, tok)
    assert packable(model)
    seqs, starts = [[5, 6, 7, 8], [5, 6, 9]], [1, 1]
    ids, mask = pad_right(seqs, tok.pad_token_id)
    unpacked = token_logprobs(model, ids, mask, first=1)
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert not packable(model)
    # unpacked: the same tensor as token_logprobs (prompt positions hold their values)
    assert torch.equal(packed_token_logprobs(model, seqs, starts, tok.pad_token_id), unpacked)
    assert not packable(torch.nn.Linear(2, 2))  # no HF attention implementation named


# ----------------------------------------------------------------------------- shell
def _enc(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def _math_batch(tok, G=4, prompts=3, seed=0, old_shift=0.05) -> RolloutBatch:
    """Single-turn math groups: G samples per prompt, ragged responses, old log-probs near
    (not at) the policy's so the clip bites somewhere."""
    rng = random.Random(seed)
    groups = []
    for q in range(prompts):
        text = f"What is {q + 3} + {2 * q + 4}? Think, then answer in \\boxed{{}}." + " ok" * q
        p = _enc(tok, text)
        trajs = []
        for _ in range(G):
            resp = [rng.randrange(5, 300) for _ in range(rng.randrange(2, 14))]
            old = [-6.0 + rng.uniform(-old_shift, old_shift) * 20 for _ in resp]
            trajs.append(
                Trajectory(
                    turns=[Turn(p, resp, old)], reward=float(rng.random() < 0.5), success=False
                )
            )
        trajs[0].reward, trajs[1].reward = 1.0, 0.0
        g = Group(task_id=f"q{q}", trajectories=trajs)
        assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
        groups.append(g)
    return RolloutBatch(groups=groups, temperature=0.9)


def _updated(module_cls, batch, pack, length_aware, **kw):
    module = module_cls(
        policy=PolicySpec("tiny", seed=0),
        lr=1e-3,
        pack_prompts=pack,
        length_aware_micro_batches=length_aware,
        **kw,
    )
    module.configure_model()
    cfg = module.configure_optimizers()
    values = module.update(copy.deepcopy(batch), cfg["optimizer"], None, 0)
    return module, values


def _max_param_diff(a, b) -> float:
    return max(
        (x - y).abs().max().item()
        for x, y in zip(a.policy.parameters(), b.policy.parameters(), strict=True)
    )


def _max_param_change(m, fresh) -> float:
    return max(
        (x - y).abs().max().item()
        for x, y in zip(m.policy.parameters(), fresh.policy.parameters(), strict=True)
    )


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_update_packed_and_length_ordered_equals_unpacked(kl_coef):
    from salvage.modules.grpo import GRPOModule

    tok = GRPOModule(policy=PolicySpec("tiny")).tokenizer
    batch = _math_batch(tok)
    kw = dict(micro_batch_size=4, num_minibatches=2, kl_coef=kl_coef)
    base, v0 = _updated(GRPOModule, batch, False, False, **kw)
    fresh = GRPOModule(policy=PolicySpec("tiny", seed=0))
    fresh.configure_model()
    assert _max_param_change(base, fresh) > 1e-4  # the update moved the weights
    for pack, la in ((True, True), (True, False), (False, True)):
        m, v = _updated(GRPOModule, batch, pack, la, **kw)
        assert _max_param_diff(m, base) <= 1e-5, (pack, la)
        assert v["loss/policy"] == pytest.approx(v0["loss/policy"], abs=1e-5)
        if kl_coef:
            assert v["loss/kl"] == pytest.approx(v0["loss/kl"], abs=1e-6) and v0["loss/kl"] > 0
    # packed: each prompt runs once per micro-batch holding rows of its group, not per row
    m, _ = _updated(GRPOModule, batch, True, True, **kw)
    assert m.forward_positions[1] < base.forward_positions[1]
    assert m.forward_positions[2] == base.forward_positions[2]


def test_length_aware_order_cuts_padding_and_keeps_the_minibatches():
    from salvage.modules.grpo import GRPOModule

    tok = GRPOModule(policy=PolicySpec("tiny")).tokenizer
    batch = _math_batch(tok, G=4, prompts=4, seed=3)
    kw = dict(micro_batch_size=2, num_minibatches=1)
    shuffled, _ = _updated(GRPOModule, batch, False, False, **kw)
    ordered, _ = _updated(GRPOModule, batch, False, True, **kw)
    assert _max_param_diff(ordered, shuffled) <= 1e-5
    # the same tokens run and scored, fewer padding positions
    assert ordered.forward_positions[1:] == shuffled.forward_positions[1:]
    assert ordered.forward_positions[0] < shuffled.forward_positions[0]
    # packed, micro-batches of 4 = G: each micro-batch is one whole group, one pack of
    # prompt + sum(response - 1) tokens; unpacked: every row runs its prompt again
    packed, _ = _updated(GRPOModule, batch, True, True, micro_batch_size=4, num_minibatches=1)
    assert _max_param_diff(packed, shuffled) <= 1e-5
    groups = [[t.turns[0] for t in g.trajectories] for g in batch.groups]
    want = sum(len(g[0].prompt_ids) + sum(len(u.response_ids) - 1 for u in g) for g in groups)
    assert packed.forward_positions[1] == want
    assert shuffled.forward_positions[1] == sum(
        len(u.prompt_ids) + len(u.response_ids) for g in groups for u in g
    )


def test_vhgpo_aux_terms_packed_equal_unpacked():
    from salvage.modules.vhgpo import VHGPOModule

    tok = VHGPOModule(policy=PolicySpec("tiny")).tokenizer
    h = _enc(tok, "You are in the kitchen. Admissible actions: [take coin, look around]\n")
    h2 = _enc(tok, "You see a coin on the table.\n")
    relays = [
        RelayData(
            bridge=[SeqTarget(h, _enc(tok, "<action>take coin</action>"))],
            resume=[SeqTarget(h2, _enc(tok, "<action>look around</action>"))],
            pair=(
                SeqTarget(h, _enc(tok, "<action>take coin</action>"), None),
                SeqTarget(h, _enc(tok, "<action>look around</action>"), None),
            ),
        ),
        RelayData(
            bridge=[SeqTarget(h, _enc(tok, "<action>look around</action>"))],
            resume=[],
            pair=(
                SeqTarget(h2, _enc(tok, "<action>take coin</action>"), [1, 1, 0, 1, 1]),
                SeqTarget(h2, _enc(tok, "<action>go east</action>"), None),
            ),
        ),
    ]
    batch = _math_batch(tok, prompts=2)
    batch.relays = relays
    kw = dict(micro_batch_size=4, kl_coef=0.02)
    base, v0 = _updated(VHGPOModule, batch, False, False, **kw)
    m, v = _updated(VHGPOModule, batch, True, True, **kw)
    assert _max_param_diff(m, base) <= 1e-5
    for k in ("loss/pair", "loss/bridge", "loss/resume", "loss/policy", "loss/kl"):
        assert v[k] == pytest.approx(v0[k], abs=1e-5), k


def test_graft_peer_rows_packed_equal_unpacked():
    """GRAFT's receiver B: its own group and a transplanted peer group (A's samples
    re-tokenised, B's prompt format, pi_old scored by B, packed or not); one update."""
    from salvage.modules.graft import GRAFTModule
    from salvage.rollout.hf import HFEngine

    def run(pack: bool):
        module = GRAFTModule(
            policy_a=PolicySpec("tiny", vocab_size=768),
            policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
            lr=1e-3,
            num_minibatches=1,
            micro_batch_size=4,
            kl_coef=0.02,
            pack_prompts=pack,
            length_aware_micro_batches=pack,
        )
        module.configure_model()
        ta, tb = module.a.tokenizer, module.b.tokenizer

        def group(samples, ok):
            trajs = [
                Trajectory(
                    turns=[
                        Turn(
                            s.prompt_ids,
                            s.response_ids,
                            s.logprobs,
                            response_text=s.text,
                            finish_reason=s.finish_reason,
                        )
                    ],
                    reward=float(k),
                    success=k,
                )
                for s, k in zip(samples, ok, strict=True)
            ]
            g = Group(task_id="q", trajectories=trajs, task={"answer": "7"})
            assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
            return g

        def prompt(t, text):
            s = t.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            return _enc(t, s)

        qs = ["What is 3 + 4?", "What is 12 - 5?"]
        ea = HFEngine(module.a.policy, ta, max_new_tokens=10)
        eb = HFEngine(module.b.policy, tb, max_new_tokens=10)
        sa = ea.generate([prompt(ta, q) for q in qs], n=4, seed=3)
        sb = eb.generate([prompt(tb, q) for q in qs], n=4, seed=4)
        src = RolloutBatch(groups=[group(sa[0], [1, 0, 0, 0]), group(sa[1], [0, 1, 1, 0])])
        dst = RolloutBatch(groups=[group(sb[0], [0] * 4), group(sb[1], [1, 0, 0, 1])])
        module.receive(src, dst, [0], module.b)
        assert [t.source for t in dst.groups[0].trajectories] == ["peer"] * 4
        cfg = module.b.configure_optimizers()
        values = module.b.update(dst, cfg["optimizer"], None, 0)
        return module, dst, values

    base, dst0, v0 = run(False)
    m, dst1, v = run(True)
    peers0 = [t.turns[0].logprobs for t in dst0.groups[0].trajectories]
    peers1 = [t.turns[0].logprobs for t in dst1.groups[0].trajectories]
    for a, b in zip(peers0, peers1, strict=True):  # B's pi_old of the peer rows, packed
        assert a == pytest.approx(b, abs=1e-5)
    assert _max_param_diff(m.b, base.b) <= 1e-5
    assert v.get("loss/peer_clip_frac") == pytest.approx(v0.get("loss/peer_clip_frac"), abs=1e-6)
    assert v["loss/kl"] == pytest.approx(v0["loss/kl"], abs=1e-6)


def test_agent_turns_pack_only_identical_prompts():
    """Two-turn episodes: every episode's first turn has the same prompt (packed), the
    second turns differ (each its own pack, joined beside others); one update equals the
    unpacked one."""
    from salvage.modules.grpo import GRPOModule

    tok = GRPOModule(policy=PolicySpec("tiny")).tokenizer
    rng = random.Random(5)
    first = _enc(tok, "You are in a kitchen. Admissible actions: [take coin, look]\n")
    trajs = []
    for e in range(4):
        r1 = [rng.randrange(5, 300) for _ in range(rng.randrange(3, 8))]
        p2 = first + r1 + _enc(tok, f"\nYou see {e} coins.\n")
        r2 = [rng.randrange(5, 300) for _ in range(rng.randrange(3, 8))]
        turns = [Turn(first, r1, [-6.0] * len(r1)), Turn(p2, r2, [-5.9] * len(r2))]
        trajs.append(Trajectory(turns=turns, reward=float(e % 2), success=bool(e % 2)))
    g = Group(task_id="ep", trajectories=trajs)
    assign_advantages(g, "grpo", 1e-6, 1e-6, 1e-6)
    batch = RolloutBatch(groups=[g])
    kw = dict(micro_batch_size=8, kl_coef=0.02)
    base, v0 = _updated(GRPOModule, batch, False, False, **kw)
    m, v = _updated(GRPOModule, batch, True, True, **kw)
    assert _max_param_diff(m, base) <= 1e-5
    assert v["loss/policy"] == pytest.approx(v0["loss/policy"], abs=1e-5)
    # the shared first-turn prompt ran once instead of four times
    saved = base.forward_positions[1] - m.forward_positions[1]
    assert saved == 3 * len(first) + 8  # + one dropped last token per row (8 rows)
