"""Injected faults: the run goes on (or stops) exactly as documented."""

from __future__ import annotations

import math

import lightning as L
import pytest
from test_fit import DigitFraction
from test_vhgpo import CFG, _run

from salvage.callbacks.relay import TeacherSpec, VerifiedHandoff
from salvage.core.relay import RelayConfig
from salvage.datamodules.rlvr import RLVRDataModule
from salvage.models import PolicySpec, load_tokenizer
from salvage.modules.grpo import GRPOModule, NonFiniteLossError
from salvage.rollout.config import EngineConfig, RolloutEngineError
from salvage.tasks.math import MathData, Reward, RewardResult


def _trainer(steps=2):
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _data(reward):
    return RLVRDataModule(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=16),
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
        reward=reward,
    )


class NaNReward(Reward):
    """A verifier gone wrong: NaN rewards make every loss non-finite."""

    def __call__(self, response: str, answer: str) -> RewardResult:
        return RewardResult(math.nan, False)


# NaN rewards are logged as NaN (honest), which torchmetrics' mean warns about
@pytest.mark.filterwarnings("ignore:Encountered `nan` values in tensor")
def test_non_finite_updates_are_skipped_then_the_run_stops():
    module = GRPOModule(
        policy=PolicySpec("tiny"), lr=1e-3, num_minibatches=2, max_nonfinite_in_a_row=3
    )
    module.configure_model()
    before = {k: p.detach().clone() for k, p in module.policy.named_parameters()}
    with pytest.raises(NonFiniteLossError, match="3 non-finite updates in a row"):
        _trainer(steps=5).fit(module, datamodule=_data(NaNReward()))
    assert module.skipped_updates == 3  # minibatch 1 and 2 of update 1, minibatch 1 of update 2
    assert all(
        (p == before[k]).all() for k, p in module.policy.named_parameters()
    )  # nothing applied


class FlakyEngine:
    def __init__(self, engine, failures):
        self.engine, self.failures, self.calls, self.rebuilds = engine, failures, 0, 0
        self.model, self.temperature = engine.model, engine.temperature

    def prepare(self):  # the RolloutEngine protocol: a rollout phase begins and ends
        self.engine.prepare()

    def release(self):
        self.engine.release()

    def close(self):  # the fit's teardown closes the engines it built
        self.engine.close()

    def rebuild(self):  # an engine error is retried on a rebuilt engine, never the same one
        self.rebuilds += 1
        self.engine.rebuild()

    def generate(self, *a, **kw):
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError(f"engine fault {self.calls}")
        return self.engine.generate(*a, **kw)


class FlakyData(RLVRDataModule):
    failures = 1

    @property
    def engine(self):
        eng = super().engine
        if not isinstance(eng, FlakyEngine):
            self._engine = eng = self.flaky = FlakyEngine(eng, self.failures)
        return eng


def test_engine_error_is_retried_once():
    module = GRPOModule(policy=PolicySpec("tiny"), lr=1e-3)
    data = FlakyData(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=16),
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
        reward=DigitFraction(),
    )
    trainer = _trainer(steps=2)
    trainer.fit(module, datamodule=data)
    # the engine the fit used (closed by its teardown): 1 failure + 1 retry + step 2
    assert trainer.global_step == 2 and data.flaky.calls == 3
    assert data.flaky.rebuilds == 1


def test_engine_failing_twice_fails_the_step_with_the_cause():
    data = FlakyData(
        train=MathData(source="reasoning_gym:basic_arithmetic", size=16),
        prompts_per_step=2,
        group_size=4,
        engine=EngineConfig(max_new_tokens=8),
        reward=DigitFraction(),
    )
    data.failures = 2
    with pytest.raises(RolloutEngineError, match="engine fault 1.*engine fault 2"):
        _trainer(steps=2).fit(GRPOModule(policy=PolicySpec("tiny")), datamodule=data)


def test_lm_teacher_with_another_tokenizer_and_malformed_output(tmp_path):
    # a random tiny LM with a different vocabulary as teacher: its outputs are malformed
    # actions, every recovery fails, its tokens are counted, the run goes on
    teacher = TeacherSpec(
        kind="lm",
        policy=PolicySpec("tiny", vocab_size=700, seed=5),
        engine=EngineConfig(max_new_tokens=6),
    )
    trainer, cap, recs = _run(tmp_path, VerifiedHandoff(relay=RelayConfig(**CFG), teacher=teacher))
    assert trainer.global_step == 1
    assert all(
        not r["retained"] and r["reason"] == "no teacher recovery from any anchor" for r in recs
    )
    assert all(r["teacher_attempts"] == 8 for r in recs)
    assert float(trainer.callback_metrics["cost/extra_tokens_teacher"]) > 0
    assert cap.relays == []


def test_tokenizer_without_chat_template_is_a_clear_error():
    spec = PolicySpec("tiny")
    tok = load_tokenizer(spec)
    tok.chat_template = None
    from salvage.models import _finish_tokenizer

    with pytest.raises(ValueError, match="has no chat template; set model.policy.chat_template"):
        _finish_tokenizer(tok, spec)
    tok.chat_template = None
    ok = _finish_tokenizer(tok, PolicySpec("tiny", chat_template="{{ messages[0]['content'] }}"))
    assert ok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
