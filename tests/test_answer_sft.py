"""AnswerSFT: per-model supervised warm start on reference answers; pooled training sources."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from salvage.callbacks.answer_sft import AnswerSFT
from salvage.datamodules.graft import GraftDataModule
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.errors import ConfigError
from salvage.models import PolicySpec
from salvage.modules.graft import GRAFTModule
from salvage.modules.grpo import GRPOModule
from salvage.rollout.config import EngineConfig
from salvage.tasks.math import MathData

ARITH = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def _slice(name: str, ops: list[str], seed: int, size: int = 16) -> MathData:
    return MathData(
        source="reasoning_gym:basic_arithmetic",
        name=name,
        size=size,
        seed=seed,
        rg_kwargs={**ARITH, "operators": ops},
    )


def _nll(module, pairs) -> float:
    from salvage.core.losses import seq_mean_logprob
    from salvage.lm import pad_right, token_logprobs

    ids, mask = pad_right([p + r for p, r in pairs], int(module.tokenizer.pad_token_id), "cpu")
    with torch.no_grad():
        lp = token_logprobs(module.policy, ids, mask)
    count = torch.zeros_like(lp)
    for i, (p, r) in enumerate(pairs):
        count[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return float(-seq_mean_logprob(lp, count).mean())


def test_answer_sft_trains_only_its_graft_model_on_its_slice_and_resets_its_reference(tmp_path):
    module = GRAFTModule(
        policy_a=PolicySpec("tiny", vocab_size=768),
        policy_b=PolicySpec("tiny", vocab_size=384, seed=1),
        lr=1e-12,
        num_minibatches=1,
        kl_coef=0.01,
    )
    data = GraftDataModule(
        train=[_slice("add", ["+", "-"], 0, 8), _slice("mul", ["*"], 1, 8)],
        prompts_per_step=2,
        group_size=2,
        engine=EngineConfig(max_new_tokens=4),
    )
    sft = AnswerSFT(data=_slice("mul", ["*"], 5), learner="b", steps=30, batch_size=16, lr=3e-3)
    module.configure_model()  # builds the policies (Lightning's call later is a no-op)
    a_before = {k: v.clone() for k, v in module.a.policy.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[sft],
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    # the pooled training split holds both slices, labelled by source
    fams = {t.meta["family"] for t in data.tasks["train"]}
    assert fams == {"add", "mul"} and len(data.tasks["train"]) == 16
    assert sft.done and len(sft.history) == 30
    assert sum(sft.history[-5:]) / 5 < 0.5 * sum(sft.history[:5]) / 5, sft.history
    # model A untouched by B's warm start (the one RL update ran at lr 1e-12)
    for k, v in module.a.policy.state_dict().items():
        assert torch.allclose(v, a_before[k], atol=1e-8), k
    # B's reference is B's warm-started policy
    ref = module.b.ref_model
    for (k, v), (k2, v2) in zip(
        module.b.policy.state_dict().items(), ref.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.allclose(v, v2, atol=1e-6), k
    # the NLL of B's own slice answers fell; each instance keeps its own checkpoint state
    pairs = sft.demonstrations(trainer, module.b)
    assert _nll(module.b, pairs[:16]) < sft.history[0]
    assert sft.state_key != AnswerSFT(learner="a").state_key
    assert pairs[0][1][-1] == module.b.tokenizer.eos_token_id
    text = module.b.tokenizer.decode(pairs[0][1][:-1])
    assert text.startswith("\\boxed{") and text.endswith("}"), text


def test_answer_sft_refuses_bad_settings_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="template"):
        AnswerSFT(template="\\boxed{}")
    module = GRPOModule(policy=PolicySpec("tiny"), lr=1e-12, num_minibatches=1)
    data = RLVRDataModule(train=_slice("add", ["+"], 0, 4), prompts_per_step=1, group_size=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[AnswerSFT(learner="a", steps=1)],
        default_root_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match="learner='a'.*single policy"):
        trainer.fit(module, datamodule=data)
    with pytest.raises(ConfigError, match="data.train: an empty list"):
        RLVRDataModule(train=[])
