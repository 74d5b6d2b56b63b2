"""The policy-loss registry (hand-worked values) and the fast update against a slow reference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from salvage.core.policy_loss import (
    POLICY_LOSSES,
    LossInputs,
    get_policy_loss,
    register_policy_loss,
    row_policy_loss,
)
from salvage.models import PolicySpec
from salvage.types import Group, RolloutBatch, SeqRatio, Trajectory, Turn


def _x(lp, old, adv, **kw):
    t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    return LossInputs(t(lp), t(old), t(adv), torch.ones(1, len(lp), dtype=torch.float64), **kw)


def test_registered_losses_by_hand():
    assert {"clip", "luffy", "sequence"} <= set(POLICY_LOSSES)
    # clip: r = e^(ln 1.5) = 1.5 > 1 + 0.28, A = 1 > 0: min(1.5, 1.28) = 1.28 -> loss -1.28,
    # clipped; r = 0.5 < 0.8 with A = -1: min(-0.5, -0.8) = -0.8 -> loss 0.8, clipped;
    # r = 1 (ratio inside): loss -A = -2, not clipped
    x = _x([math.log(1.5), math.log(0.5), 0.0], [0.0, 0.0, 0.0], [1.0, -1.0, 2.0])
    loss, clipped = get_policy_loss("clip")(x)
    assert loss[0].tolist() == pytest.approx([-1.28, 0.8, -2.0])
    assert clipped[0].tolist() == [1.0, 1.0, 0.0]
    # luffy: p = 0.5, A = 2: -(0.5 / 0.6) * 2 = -5/3; never clipped
    loss, clipped = get_policy_loss("luffy")(_x([math.log(0.5)], [0.0], [2.0]))
    assert float(loss) == pytest.approx(-5 / 3) and float(clipped) == 0.0
    # sequence: mean logp = (ln 2 + 0) / 2 = ln sqrt 2, ref 0 -> rho = 1.41421 > 1.2 with A = 1:
    # min(1.414, 1.2) = 1.2 on both tokens, clipped
    x = _x(
        [math.log(2.0), 0.0],
        [0.0, 0.0],
        [1.0, 1.0],
        seq_ref=torch.tensor([0.0], dtype=torch.float64),
        seq_low=torch.tensor([0.8], dtype=torch.float64),
        seq_high=torch.tensor([1.2], dtype=torch.float64),
    )
    loss, clipped = get_policy_loss("sequence")(x)
    assert loss[0].tolist() == pytest.approx([-1.2, -1.2])
    assert clipped[0].tolist() == [1.0, 1.0]


def test_rows_of_different_kinds_take_their_own_loss():
    lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]], dtype=torch.float64))
    x = LossInputs(
        lp, lp.clone(), torch.tensor([[2.0, 2.0], [2.0, 2.0]]).double(), torch.ones(2, 2)
    )
    loss, _ = row_policy_loss(["clip", "luffy"], x)
    assert loss[0].tolist() == pytest.approx([-2.0, -2.0])  # r = 1: -A
    assert loss[1].tolist() == pytest.approx([-5 / 3, -5 / 3])  # luffy with p = 0.5
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        row_policy_loss(["clip", "nope"], x)
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("clip")(lambda x: (x.logprobs, x.logprobs))


# ---- a full update against a slow, obviously correct reference ----------------------------


def _reference_grads(policy, ref_policy, trajs, temperature, eps_low, eps_high, kl_coef):
    """Token-mean over every response token of the minibatch, one sequence and one token at a
    time: the policy term by its formula (times the row weight), plus kl_coef * k3 KL."""
    policy.zero_grad(set_to_none=True)
    n_tokens = sum(len(t.turns[0].response_ids) for t in trajs)
    total = torch.zeros(())
    for t in trajs:
        turn = t.turns[0]
        ids = torch.tensor([list(turn.prompt_ids) + list(turn.response_ids)])
        start = len(turn.prompt_ids) - 1
        lps = torch.log_softmax(policy(input_ids=ids).logits[0, :-1].float() / temperature, -1)
        with torch.no_grad():
            ref = torch.log_softmax(
                ref_policy(input_ids=ids).logits[0, :-1].float() / temperature, -1
            )
        cur = [lps[start + j, tok] for j, tok in enumerate(turn.response_ids)]
        refs = [ref[start + j, tok] for j, tok in enumerate(turn.response_ids)]
        kind = "sequence" if t.seq_ratio is not None else t.loss
        a = t.advantage
        if kind == "sequence":
            seq_ref, low = t.seq_ratio.ref, t.seq_ratio.low
            high = math.inf if t.seq_ratio.high is None else t.seq_ratio.high
            rho = torch.exp(torch.stack(cur).mean() - seq_ref)
            term = -torch.minimum(rho * a, torch.clamp(rho, low, high) * a)
        for j, lp in enumerate(cur):
            if kind == "clip":
                r = torch.exp(lp - turn.logprobs[j])
                pol = -torch.minimum(r * a, torch.clamp(r, 1 - eps_low, 1 + eps_high) * a)
            elif kind == "luffy":
                p = torch.exp(lp)
                pol = -(p / (p + 0.1)) * a
            else:
                pol = term
            d = refs[j] - lp
            kl = torch.exp(d) - d - 1
            total = total + (t.weight * pol + kl_coef * kl) / n_tokens
    total.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def test_fast_update_equals_the_slow_reference():
    from salvage.modules.grpo import GRPOModule

    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicySpec("tiny"),
        lr=1.0,
        num_minibatches=1,
        micro_batch_size=2,  # 7 rows: four micro-batches
        kl_coef=0.1,
        max_grad_norm=0.0,
        shuffle_minibatches=False,
        loss_agg="token-mean",
    )
    module.configure_model()
    gen = torch.Generator().manual_seed(1)

    def traj(n_prompt, n_resp, adv, w=1.0, source="self", loss="clip", seq_ratio=None):
        prompt = torch.randint(5, 200, (n_prompt,), generator=gen).tolist()
        resp = torch.randint(5, 200, (n_resp,), generator=gen).tolist()
        old = (-torch.rand(n_resp, generator=gen) * 6 - 1).tolist()  # ratios far from 1
        turn = Turn(prompt, resp, old, response_text="")
        return Trajectory(
            turns=[turn],
            reward=0.0,
            success=False,
            advantage=adv,
            weight=w,
            source=source,
            loss=loss,
            seq_ratio=None if seq_ratio is None else SeqRatio(*seq_ratio),
        )

    trajs = [
        traj(7, 5, 1.5),  # own row, clipped surrogate
        traj(4, 3, -0.7),  # own row, negative advantage
        traj(6, 4, 1.1, w=0.6, source="peer"),  # GRAFT peer row, compatibility weight
        traj(5, 6, 0.9, source="peer", loss="luffy"),  # LUFFY-style peer tokens
        traj(3, 4, -1.2, seq_ratio=(-4.0, 0.8, 1.3)),  # HACPO own row: sequence-level ratio
        traj(4, 3, 0.8, source="peer", loss="hacpo", seq_ratio=(-3.5, 0.85, None)),
        traj(5, 3, 1.3, source="peer", loss="clip", seq_ratio=(-3.0, 0.8, 1.28)),  # Table 2a
    ]
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    reference = copy.deepcopy(module.policy)
    expected = _reference_grads(reference, module.ref_model, trajs, 0.8, 0.2, 0.28, kl_coef=0.1)
    batch = RolloutBatch(groups=[Group("q", trajs)], temperature=0.8)
    opt = torch.optim.SGD(module.policy.parameters(), lr=1.0)  # after - before = -grad
    module.update(batch, opt, None, 0)
    checked = 0
    for name, p in module.policy.named_parameters():
        if name not in expected:
            continue
        got = before[name] - p.detach()
        assert torch.allclose(got, expected[name], atol=1e-6, rtol=1e-4), name
        checked += 1
    assert checked >= 10
    assert max(float(g.abs().max()) for g in expected.values()) > 1e-3  # a real gradient
