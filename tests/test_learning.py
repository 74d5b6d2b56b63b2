"""Learning checks: the real update paths make the `tiny` model learn, fast.

Hand-value tests of the losses do not catch a sign or scaling error that stops learning;
these do. All run the real code end to end on a fixed seed:

- GRPO: ``GRPOModule`` + ``RLVRDataModule`` under a Lightning ``Trainer`` (the path of
  ``salvage fit``), with a reward the untrained model can climb: the share of digit
  characters in the response. The mean reward of the first update (the untrained
  policy's samples) is below ``START_BELOW``, that of the last two above ``END_ABOVE``
  after ``UPDATES`` updates (measured: 0.21 -> 0.88 in about 10 s).
  With the advantage sign flipped in the update, the reward falls instead (0.21 -> 0.004,
  checked by hand), so the check fails.
- VH-GPO: ``VHGPOModule.update`` on a batch whose only training data is one retained relay
  (bridge, resume and pair items): the student's mean log-likelihood of the bridge turn's
  response rises from about -log(vocab) = -6.2 to above ``BRIDGE_ABOVE`` within
  ``AUX_UPDATES`` updates (measured: -6.27 -> -1.92; with the completion loss's sign
  flipped it falls to -12.9, checked by hand).
- GRAFT: ``GRAFTModule`` + ``GraftDataModule`` under a ``Trainer``, warm starts by
  ``AnswerSFT``, on 4 sums of 3-digit numbers (an in-memory .jsonl, four prompt wordings).
  The peer A (``tiny``, BPE 512) is warm-started on each prompt twice with its sum and once
  with ``\\boxed{I am not sure}``, so it solves about 2/3 of its samples on every prompt
  (never all n, which complementarity excludes); its learning rate is ~0, so it stays so.
  The receiver B (``tiny``, BPE 384) is warm-started on 16 other sums: it knows the response
  format and puts digits about uniformly, so it hits a 3-digit sum ~1e-3 of the time (0 in
  practice) and has no signal of its own. The response is a ~30-token sentence ending in
  ``\\boxed{SUM}``: the length-normalised compatibility score of A's correct responses is
  0.36-0.86 to B at the start (the sum's digits cost B ~7 nats, spread over the sentence),
  A's unsure ones mostly ~0.03, so ``delta`` is lowered to ``GRAFT_DELTA`` = 0.3 to admit all the
  correct ones and still reject the unsure ones (admitted fraction 0.63-0.81 per update).
  Both runs start from the same warm-started weights. With the exchange, B's own
  ``b/rollout/success_rate`` goes 0.0 at the first update -> mean 0.078 over the last 8 of
  ``GRAFT_UPDATES`` = 16 updates (peak 0.16; an exploratory run of the same set-up outside
  the test: mean 0.15, peak 0.31); with the exchange off it is 0.0 at every update. B's learning rate is capped
  by ``tiny``'s ~0.02 weights: at 1e-2 one update wrecks its format (the score of every peer
  response falls under delta and transfers stop), at 3e-3 it learns but slowly, so the
  rise is modest; ~31 s of CPU (about 2.5 min wall on the loaded machine measured).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from salvage.callbacks.answer_sft import AnswerSFT
from salvage.datamodules.graft import GraftDataModule
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.history import load_metrics
from salvage.models import PolicySpec
from salvage.modules.graft import GRAFTModule
from salvage.modules.grpo import GRPOModule
from salvage.modules.vhgpo import VHGPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData, Reward, RewardResult
from salvage.types import RelayData, RolloutBatch, SeqTarget

UPDATES = 12
START_BELOW = 0.3
END_ABOVE = 0.6
AUX_UPDATES = 10
BRIDGE_ABOVE = -3.0


class DigitShare(Reward):
    """Reward = share of digit characters in the response; success = more than half."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        frac = sum(c.isdigit() for c in response) / max(1, len(response))
        return RewardResult(frac, frac > 0.5)


def test_grpo_raises_mean_reward_on_a_learnable_reward(tmp_path):
    torch.manual_seed(0)
    module = GRPOModule(
        policy=PolicySpec("tiny", seed=0),
        lr=1e-2,
        num_minibatches=2,
        micro_batch_size=16,
        kl_coef=0.0,
        seed=0,
    )
    data = RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=64, seed=0),
        prompts_per_step=4,
        group_size=8,
        engine=EngineConfig(max_new_tokens=8),
        reward=DigitShare(),
        seed=0,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=UPDATES,
        logger=CSVLogger(tmp_path, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    rewards = [
        v for _, v in load_metrics(tmp_path / "version_0" / "metrics.csv")["rollout/reward_mean"]
    ]
    assert len(rewards) == UPDATES
    start, end = rewards[0], sum(rewards[-2:]) / 2
    print("mean reward per update:", [round(r, 3) for r in rewards])
    assert start < START_BELOW, rewards
    assert end > END_ABOVE, rewards


def _enc(tok, s: str) -> list[int]:
    return list(tok(s, add_special_tokens=False)["input_ids"])


def test_vhgpo_aux_losses_raise_the_bridge_likelihood():
    torch.manual_seed(0)
    module = VHGPOModule(policy=PolicySpec("tiny", seed=0), lr=1e-2, micro_batch_size=8)
    module.configure_model()
    tok = module.tokenizer
    h = _enc(tok, "You are in the kitchen. Admissible actions: [take coin, look around]\n")
    bridge = SeqTarget(h, _enc(tok, "<action>take coin</action>"))
    resume = SeqTarget(_enc(tok, "You see a coin.\n"), _enc(tok, "<action>look around</action>"))
    pair = (
        SeqTarget(h, _enc(tok, "<action>take coin</action>"), None),
        SeqTarget(h, _enc(tok, "<action>look around</action>"), None),
    )
    batch = RolloutBatch(groups=[], relays=[RelayData(bridge=[bridge], resume=[resume], pair=pair)])
    cfg = module.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]

    def bridge_loglik() -> float:
        with torch.no_grad():
            return float(module.scores(module.policy, [bridge])[0])

    before = bridge_loglik()
    losses = []
    for step in range(AUX_UPDATES):
        values = module.update(batch, opt, sched, step)
        losses.append(values["loss/bridge"])
    after = bridge_loglik()
    print(f"bridge mean log-lik {before:.3f} -> {after:.3f}; loss/bridge {losses}")
    # untrained: about -log(512) = -6.24 per token
    assert before < -5.0
    assert after > BRIDGE_ABOVE
    assert losses[-1] < losses[0]


# GRAFT: the peer's sums (3 digits, so a receiver guessing digits almost never hits one)
GRAFT_SUMS = [(230, 283), (371, 114), (338, 227), (126, 180)]
GRAFT_FORMS = [
    "What is {} + {}?",
    "Compute {} plus {}.",
    "Add {} and {}.",
    "Find the sum of {} and {}.",
]
GRAFT_TEMPLATE = "Adding the two numbers gives the final answer \\boxed{{{answer}}}."
GRAFT_UNSURE = "I am not sure"
GRAFT_UPDATES = 16
GRAFT_DELTA = 0.3
RECEIVER_START_BELOW = 0.05
RECEIVER_END_ABOVE = 0.04
RECEIVER_OFF_BELOW = 0.02


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return MathData(source=str(path), add_suffix=False, dedupe=False)


class _WarmState(L.Callback):
    """The module's weights when training starts (after the warm starts' ``on_fit_start``)."""

    def on_train_start(self, trainer, pl_module):
        self.state = copy.deepcopy(pl_module.state_dict())


def _graft_fit(root, module, data, callbacks=()):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=GRAFT_UPDATES,
        logger=CSVLogger(root, name=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
        callbacks=list(callbacks),
    )
    trainer.fit(module, datamodule=data)
    return load_metrics(Path(trainer.log_dir) / "metrics.csv")


@pytest.mark.slow  # ~150 s on the loaded 2-core machine (two 16-update fits)
def test_graft_exchange_teaches_the_receiver_what_only_the_peer_solves(tmp_path):
    """GRAFT on 4 sums only the peer solves: the receiver's success rises with the exchange
    and stays at 0 without it (set-up and measured numbers in the module docstring)."""
    torch.manual_seed(0)
    problems = [f.format(x, y) for f, (x, y) in zip(GRAFT_FORMS, GRAFT_SUMS, strict=True)]
    answers = [str(x + y) for x, y in GRAFT_SUMS]
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"id": i, "problem": p, "answer": a}
            for i, (p, a) in enumerate(zip(problems, answers, strict=True))
        ],
    )
    # the peer: each problem twice with its sum, once unsure (solves about 2/3 of its samples)
    peer_sft = _jsonl(
        tmp_path / "peer.jsonl",
        [
            {"id": f"{i}{k}", "problem": p, "answer": a if k < 2 else GRAFT_UNSURE}
            for i, (p, a) in enumerate(zip(problems, answers, strict=True))
            for k in range(3)
        ],
    )
    rng = random.Random(7)
    other = [(rng.randint(100, 400), rng.randint(100, 400)) for _ in range(16)]
    receiver_sft = _jsonl(
        tmp_path / "receiver.jsonl",
        [
            {"id": i, "problem": f"What is {x} + {y}?", "answer": str(x + y)}
            for i, (x, y) in enumerate(other)
        ],
    )

    def module(exchange):
        return GRAFTModule(
            policy_a=PolicySpec("tiny", vocab_size=512, seed=0),
            policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
            lr=1e-12,  # the peer stays as warm-started
            lr_b=3e-3,  # tiny's weights are ~0.02: larger Adam steps wreck its format
            num_minibatches=2,
            micro_batch_size=32,
            balance="none",
            delta=GRAFT_DELTA,
            exchange=exchange,
            seed=0,
        )

    def data():
        return GraftDataModule(
            train=train,
            prompts_per_step=len(problems),
            group_size=8,
            engine=EngineConfig(max_new_tokens=40),
            seed=0,
        )

    warm = _WarmState()
    sft = dict(template=GRAFT_TEMPLATE, lr=1e-2, seed=0)
    off = _graft_fit(
        tmp_path / "off",
        module(False),
        data(),
        [
            AnswerSFT(data=peer_sft, learner="a", steps=120, batch_size=12, **sft),
            AnswerSFT(data=receiver_sft, learner="b", steps=60, batch_size=8, **sft),
            warm,
        ],
    )
    on_module = module(True)
    on_module.configure_model()
    on_module.load_state_dict(warm.state)
    on = _graft_fit(tmp_path / "on", on_module, data())

    def series(m, k):
        return [v for _, v in m.get(k, [])]

    b_on, b_off = series(on, "b/rollout/success_rate"), series(off, "b/rollout/success_rate")
    a_on, admitted = series(on, "a/rollout/success_rate"), series(on, "graft/admitted_frac")
    print("receiver success, exchange on: ", [round(v, 3) for v in b_on])
    print("receiver success, exchange off:", [round(v, 3) for v in b_off])
    print("peer success:", [round(v, 3) for v in a_on])
    print("admitted:", [round(v, 3) for v in admitted])
    assert len(b_on) == len(b_off) == GRAFT_UPDATES
    # the regime: the peer solves every prompt sometimes (never all n, or nothing transfers),
    # and the gate admits (its correct responses) at every update with a transfer: at least
    # every update where the receiver solved nothing (an update where the receiver solved
    # every prompt at least once has no transfer, hence no admitted fraction: seen once, with
    # one thread a process, at update 12 of 16)
    assert 0.4 < sum(a_on) / len(a_on) < 0.95, a_on
    adm = dict(on.get("graft/admitted_frac", []))
    none_solved = {s for s, v in on["b/rollout/success_rate"] if v == 0}
    assert none_solved <= set(adm) and len(adm) >= GRAFT_UPDATES // 2, (none_solved, adm)
    assert min(admitted) > 0.3, admitted
    # the receiver starts unable, and learns only through the exchange
    assert b_on[0] <= RECEIVER_START_BELOW and b_off[0] <= RECEIVER_START_BELOW
    late = b_on[GRAFT_UPDATES // 2 :]
    assert sum(late) / len(late) >= RECEIVER_END_ABOVE, b_on
    assert max(b_off) <= RECEIVER_OFF_BELOW, b_off
