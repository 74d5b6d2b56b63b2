"""The vLLM engine: GPU tests (marker ``vllm``) skip here with the reason; config errors are tested everywhere."""

from __future__ import annotations

import pytest
import torch

from salvage.lm import bump_weights_version, weights_version
from salvage.rollout.config import EngineConfig, build_engine
from salvage.rollout.vllm import iter_full_parameters, vllm_available

OK, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not OK, reason=f"vLLM engine cannot run here: {WHY}")


@pytest.fixture
def tiny64():
    """``tiny`` with 4 heads of size 64, a size every vLLM attention backend takes (FlashInfer: 64+)."""
    from salvage.models import PolicySpec, load_policy

    return load_policy(PolicySpec("tiny", hidden_size=256))


def test_backend_vllm_fails_clearly_without_a_gpu(tiny):
    model, tok = tiny
    if OK:
        pytest.skip("a GPU and vllm are present")
    with pytest.raises(RuntimeError, match="engine.backend=vllm"):
        build_engine(EngineConfig(backend="vllm"), model, tok)


def test_engine_config_rejects_bad_vllm_settings():
    with pytest.raises(ValueError, match="engine.vllm_sleep_level"):
        EngineConfig(backend="vllm", vllm_sleep_level=3)
    with pytest.raises(ValueError, match="engine.vllm_gpu_memory_utilization"):
        EngineConfig(backend="vllm", vllm_gpu_memory_utilization=1.5)


def test_weight_stream_is_every_parameter_once(tiny):
    model, _ = tiny
    names = [n for n, _ in iter_full_parameters(model)]
    assert set(n for n, _ in model.named_parameters()) <= set(names)
    assert len(names) == len(set(names))
    assert weights_version(torch.nn.Linear(1, 1)) == 0


def test_engine_backend_starts_unsynced_and_level_0_never_sleeps(tiny):
    from salvage.rollout.vllm import _Backend

    model, _ = tiny
    for _ in range(4):  # a resumed policy
        bump_weights_version(model)
    trainable = _Backend(llm=None, model=model, sleep_level=0, frozen=False)
    assert trainable.needs_sync()  # the first prepare() loads the live weights
    trainable.release()  # level 0: no llm.sleep call (vLLM's level 0 pauses scheduling)
    assert not trainable.asleep
    assert not _Backend(llm=None, model=model, sleep_level=0, frozen=True).needs_sync()


@pytest.mark.vllm
@needs_vllm
def test_vllm_samples_n_per_prompt_with_stop_and_exact_logprobs(tiny64):
    from salvage.lm import response_logprobs

    model, tok = tiny64
    model = model.cuda()
    eng = build_engine(
        EngineConfig(backend="vllm", max_new_tokens=16, stop=["</action>"], temperature=1.0),
        model,
        tok,
    )
    prompts = [
        tok("go north", add_special_tokens=False)["input_ids"],
        tok("take coin", add_special_tokens=False)["input_ids"],
    ]
    eng.prepare()
    out = eng.generate(prompts, n=3, seed=1)
    eng.release()
    assert [len(g) for g in out] == [3, 3]
    flat = [s for g in out for s in g]
    ref = response_logprobs(
        model, [s.prompt_ids for s in flat], [s.response_ids for s in flat], int(tok.pad_token_id)
    )
    for s, lp in zip(flat, ref, strict=True):
        assert len(s.logprobs) == len(s.response_ids) and torch.allclose(
            torch.tensor(s.logprobs), torch.tensor(lp), atol=1e-4
        )


@pytest.mark.vllm
@needs_vllm
def test_vllm_first_prepare_syncs_the_live_model_and_greedy_gives_n_copies(tiny64, tmp_path):
    from salvage.rollout.hf import HFEngine

    model, tok = tiny64
    model.save_pretrained(tmp_path)  # the checkpoint vLLM loads
    tok.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    model = model.cuda()
    prompt = [tok("go north", add_special_tokens=False)["input_ids"]]
    hf = HFEngine(model, tok, max_new_tokens=8, temperature=0.0)
    on_disk = hf.generate(prompt, n=1)[0][0].response_ids
    with torch.no_grad():  # a warm start changed the live model; its version is still 0
        model.model.norm.weight.neg_()
    live = hf.generate(prompt, n=1)[0][0].response_ids
    assert on_disk[:2] != live[:2]
    eng = build_engine(EngineConfig(backend="vllm", max_new_tokens=8, temperature=0.0), model, tok)
    eng.prepare()
    out = eng.generate(prompt, n=3)[0]
    assert len(out) == 3 and len({tuple(s.response_ids) for s in out}) == 1
    assert out[0].response_ids[:2] == live[:2]  # bf16 vs fp32: compare the first tokens only
    eng.release()


@pytest.mark.vllm
@needs_vllm
def test_vllm_resyncs_weights_after_an_update(tiny64):
    model, tok = tiny64
    model = model.cuda()
    eng = build_engine(EngineConfig(backend="vllm", max_new_tokens=8, temperature=0.0), model, tok)
    prompt = [tok("go north", add_special_tokens=False)["input_ids"]]
    before = eng.generate(prompt, n=1)[0][0].response_ids
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    bump_weights_version(model)
    eng.prepare()
    after = eng.generate(prompt, n=1)[0][0].response_ids
    assert after != before
