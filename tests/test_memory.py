"""Per-GPU memory estimate: hand-worked terms, and every shipped GPU config
estimated under 80 GB at the device count its header states."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

from salvage.core.memory import (
    GB,
    MemoryPlan,
    ModelMem,
    Shape,
    activation_bytes,
    activation_bytes_per_token_layer,
    estimate,
    format_estimate,
    kv_cache_bytes,
    logits_bytes,
    peak,
)

ROOT = Path(__file__).resolve().parents[1]
# 1000 parameters, 2 layers, hidden 4, SwiGLU width 8, K/V width 2, vocabulary 10
S = Shape(params=1000, layers=2, hidden=4, intermediate=8, kv_dim=2, vocab=10)


def test_terms_by_hand():
    # per layer 2 x 4 x 4 (q, o) + 2 x 4 x 2 (k, v) + 3 x 4 x 8 (SwiGLU) + 2 x 4 (norms) = 152;
    # 1000 - 2 x 152 = 696 left: over 1.5 vocabulary matrices (60), so not tied
    assert S.layer_params == 152 and not S.tied
    # 3 sequences x 5 tokens x 2 layers x (K and V) x 2 wide x 2 bytes = 240
    assert kv_cache_bytes(S, 3, 5, 2) == 240
    # 2 bytes x (10 x 4 + 2 x 2 + 4 x 8) + 4 bytes x 2 x 4 = 2 x 76 + 32 = 184
    assert activation_bytes_per_token_layer(S, 2) == 184
    # 10 tokens: 184 x 10 x 2 layers = 3680; checkpointed: inputs 10 x 4 x 2 bytes x 2 layers
    # = 160, plus one layer recomputed 1840 -> 2000
    assert activation_bytes(S, 10, False, 2) == 3680
    assert activation_bytes(S, 10, True, 2) == 2000
    # logits: 3 x 5 x 10 positions x 2 bytes = 300; fp32 log-softmax of every row 600 (with a
    # backward), of one row 5 x 10 x 4 = 200 (without)
    assert logits_bytes(S, 3, 5, True, 2) == 900
    assert logits_bytes(S, 3, 5, False, 2) == 500


def test_chunked_logits_by_hand():
    # chunks of 4 positions over 3 x 5 = 15: 4 x 10 vocabulary x (2 head + 4 fp32 log-softmax
    # + 4 its gradient) = 400 with a backward, 4 x 10 x (2 + 4) = 240 without
    assert logits_bytes(S, 3, 5, True, 2, chunk=4) == 400
    assert logits_bytes(S, 3, 5, False, 2, chunk=4) == 240
    # a chunk larger than the positions holds them all: 15 x 10 x 10 = 1500
    assert logits_bytes(S, 3, 5, True, 2, chunk=64) == 1500
    plan = MemoryPlan(
        models=(
            ModelMem("policy", S, 4),
            ModelMem("reference", S, 4, samples=False, scores_in_update=True),
        ),
        micro_batch=3,
        update_len=5,
        logprob_batch=3,
        engine_len=5,
        logprob_chunk=4,
    )
    got = estimate(plan)
    assert got["update"]["policy logits"] == 400
    assert got["update"]["reference scoring logits"] == 240
    assert got["rollout"]["scoring logits"] == 240


def test_sharded_policy_with_hf_engine_by_hand():
    plan = MemoryPlan(
        models=(ModelMem("policy", S, weight_bytes=4, sharded=True),),
        gpus=2,
        compute_bytes=2,
        engine_batch=3,
        engine_len=5,
        logprob_batch=3,
        micro_batch=2,
        update_len=5,
    )
    got = estimate(plan)
    # rollout: fp32 shard 1000 x 4 / 2 = 2000, AdamW 2 x 2000, gathered bf16 1000 x 2,
    # KV cache 240, scoring logits 500: 8740
    assert got["rollout"] == {
        "policy weights": 2000,
        "policy AdamW state": 4000,
        "policy gathered / cast": 2000,
        "policy KV cache": 240,
        "scoring logits": 500,
    }
    # update: shard 2000, AdamW 4000, gradients 2000, two gathered layers 2 x 152 x 2 = 608,
    # activations of 2 x 5 tokens 3680, logits 2 x 5 x 10 x (2 + 4) = 600: 12888
    assert got["update"] == {
        "policy weights": 2000,
        "policy AdamW state": 4000,
        "policy gradients": 2000,
        "policy gathered layers": 608,
        "policy activations": 3680,
        "policy logits": 600,
    }
    assert peak(got) == ("update", 12888)
    # reshard_after_forward off: the whole model stays gathered in the update (1000 x 2)
    whole = estimate(dataclasses.replace(plan, reshard_after_forward=False))
    assert whole["update"]["policy gathered layers"] == 2000


def test_vllm_shares_reference_and_teacher_by_hand():
    plan = MemoryPlan(
        models=(
            ModelMem("policy", S, 4, engine=0.25, engine_sleeps=True),
            ModelMem(
                "reference", S, 4, samples=False, gathered_in_rollout=False, scores_in_update=True
            ),
            ModelMem("teacher", S, 2, engine=0.1, engine_sleeps=False),
        ),
        gpus=1,
        gpu_gb=80,
        compute_bytes=2,
        logprob_batch=3,
        micro_batch=2,
        update_len=5,
        engine_len=5,
        autocast_copies=True,
    )
    got = estimate(plan)
    r, u = got["rollout"], got["update"]
    assert r["policy vLLM engine"] == 0.25 * 80 * GB and r["teacher vLLM engine"] == 0.1 * 80 * GB
    assert "policy vLLM engine" not in u  # it sleeps outside rollouts
    assert u["teacher vLLM engine (awake)"] == 0.1 * 80 * GB  # a frozen model's engine does not
    assert "reference gathered / cast" not in r and "policy KV cache" not in r
    assert r["policy gathered / cast"] == 2000  # fp32 weights cast to bf16 by autocast
    assert "teacher gathered / cast" not in r  # bf16 already, one GPU
    assert u["policy bf16 autocast copies"] == 2000
    # 2 x 5 x 10 x 2 bytes = 200, no backward: one row's fp32 copy 5 x 10 x 4 = 200
    assert u["reference scoring logits"] == 400
    assert r["reference weights"] == u["reference weights"] == 4000
    text = format_estimate(plan, got)
    assert "rollout:" in text and "update:" in text and "does not fit" not in text


def _header_args(path: Path) -> list[str]:
    """The ``--config`` files and ``--trainer.devices`` of a YAML's first line (its command)."""
    words = shlex.split(path.read_text().splitlines()[0].lstrip("# "))
    out = []
    for i, w in enumerate(words[:-1]):
        if w == "--config" or w == "--trainer.devices":
            out += [w, words[i + 1]]
    return out or ["--config", str(path.relative_to(ROOT))]


def test_every_shipped_gpu_config_fits_80gb_gpus(monkeypatch):
    from test_gpu_configs import _parse, gpu_configs

    from salvage.memory import plan_from_config

    monkeypatch.chdir(ROOT)
    seen = {}
    for path in gpu_configs():
        cfg = _parse(_header_args(path)).as_dict()
        plan = plan_from_config(cfg, gpu_gb=80)
        phase, total = peak(estimate(plan))
        seen[str(path.relative_to(ROOT))] = (plan.gpus, phase, round(total / GB, 1))
    over = {k: v for k, v in seen.items() if v[2] >= 80}
    assert not over, f"estimated over 80 GB per GPU: {over}"
    # the big ones run sharded, at the device counts their headers state
    assert seen["configs/vhgpo/alfworld_7b.yaml"][0] == 8
    assert seen["configs/graft/math_pair1.yaml"][0] == 4


def test_print_memory_prints_and_exits_before_loading(capsys, monkeypatch):
    from salvage.commands.fit import SalvageCLI

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        SalvageCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=["fit", "--config", "configs/vhgpo/alfworld_7b.yaml", "--print_memory", "true"],
        )
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "Estimated memory per GPU (8 GPU(s)" in out
    assert "policy AdamW state" in out and "teacher vLLM engine" in out


def test_update_flops_by_hand():
    from salvage.core.flops import forward_flops, mfu, update_flops

    # matmuls 2 x (2 layers x 152 + LM head 10 x 4) x 3 tokens = 2 x 344 x 3 = 2064; attention
    # 2 layers x 2 x 4 wide x 3 x (3 + 1) = 192 (positions 1, 2, 3: 2 x 2 x 4 x (1 + 2 + 3) x 2)
    assert forward_flops(S, 3) == 2256
    # forward + backward (3 forwards) + recompute (1) + a reference forward (1) = 5 forwards
    assert update_flops(S, [3], recompute=True, frozen_forwards=1) == 5 * 2256
    assert update_flops(S, [3, 3]) == 2 * 3 * 2256
    assert mfu(1e12, 2.0, 1e12, 2) == 0.25


def test_scored_positions_and_decode_floor_by_hand():
    from salvage.core.flops import (
        decode_floor_tokens_per_s,
        decode_weight_bytes,
        forward_flops,
        update_flops,
    )

    # LM head at 1 of 3 positions: matmuls 2 x (2 layers x 152 x 3 + 10 x 4 x 1) = 2 x 952 =
    # 1904; attention as before 192
    assert forward_flops(S, 3, scored=1) == 2096
    # 2 tokens, head at both: 2 x (2 x 152 x 2 + 40 x 2) = 1376; attention 2 x 2 x 4 x 2 x 3 = 96
    assert update_flops(S, [3, 2], scored_lens=[1, 2]) == 3 * (2096 + 1472)
    with pytest.raises(ValueError, match="scored_lens has 1 entries, seq_lens 2"):
        update_flops(S, [3, 2], scored_lens=[1])
    # weights read per decode step: (2 layers x 152 + LM head 10 x 4) x 4 bytes = 1376
    assert decode_weight_bytes(S) == 1376
    # 8 sequences at 1376 kB/s: 1000 steps/s x 8 tokens
    assert decode_floor_tokens_per_s(S, 8, 1376e3) == 8000
