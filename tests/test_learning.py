"""Learning checks: the real update paths make the `tiny` model learn, fast.

Hand-value tests of the losses do not catch a sign or scaling error that stops learning;
these do. Both run the real code end to end on a fixed seed:

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
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec
from salvage.modules.grpo import GRPOModule
from salvage.modules.vhgpo import VHGPOModule
from salvage.report import load_metrics
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
