"""The vLLM engine's rules that run without a GPU or vllm (salvage.rollout.vllm_rules)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from salvage.rollout.config import EngineConfig
from salvage.rollout.vllm_rules import (
    CPU_KVCACHE_VAR,
    MP_VAR,
    EngineRegistry,
    PlatformFacts,
    SyncState,
    check_cpu_kvcache_fits,
    check_servable,
    check_vllm_version,
    cpu_kvcache_gib,
    cpu_scheduler_kwargs,
    cpu_weight_packing_problem,
    default_enforce_eager,
    executor_backend,
    launcher_env,
    model_head_dim,
    platform_sleep_level,
    preserved_rng,
    request_seeds,
    require_in_process,
    samples_to_send,
)


# -- versions ------------------------------------------------------------------
@pytest.mark.parametrize("v", ["0.27.0", "0.30.2", "0.33.0", "0.33.1.dev4+g1a2b3c"])
def test_supported_vllm_versions_pass(v):
    check_vllm_version(v)


@pytest.mark.parametrize("v", ["0.10.2", "0.26.9", "0.34.0", "1.0.0"])
def test_other_vllm_versions_fail_with_the_range(v):
    with pytest.raises(ImportError, match=r"vllm>=0\.27,<0\.34") as e:
        check_vllm_version(v)
    assert v in str(e.value)


# -- in-process engine ---------------------------------------------------------
def test_in_process_is_set_when_unset_and_kept_when_zero():
    env: dict[str, str] = {}
    require_in_process(env)
    assert env == {MP_VAR: "0"}
    env = {MP_VAR: "0"}
    require_in_process(env)
    assert env[MP_VAR] == "0"


@pytest.mark.parametrize("value", ["1", "2", "yes"])
def test_a_user_setting_for_multiprocessing_is_refused_clearly(value):
    env = {MP_VAR: value}
    with pytest.raises(RuntimeError, match=f"{MP_VAR}='{value}'.*set it to 0"):
        require_in_process(env)
    assert env[MP_VAR] == value  # not silently overwritten


# -- launcher from the live process group --------------------------------------
def test_external_launcher_only_with_more_than_one_rank():
    assert executor_backend(False, 1) is None
    # the first in-process engine leaves a 1-process group behind: still vLLM's own executor
    assert executor_backend(True, 1) is None
    assert executor_backend(True, 2) == "external_launcher"
    assert executor_backend(True, 8) == "external_launcher"


def test_launcher_variables_come_from_the_live_group():
    env = {"RANK": "0", "WORLD_SIZE": "4"}  # a launcher that set RANK but not LOCAL_RANK
    changed = launcher_env(env, rank=3, local_rank=1)
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert changed == {"RANK": ("0", "3"), "LOCAL_RANK": (None, "1")}
    assert launcher_env(env, rank=3, local_rank=1) == {}
    assert launcher_env(env, rank=3, local_rank=1, world_size=4) == {}
    assert launcher_env(env, rank=3, local_rank=1, world_size=8) == {"WORLD_SIZE": ("4", "8")}


def _node1_of_two(launcher: str, visible: str) -> dict[str, str]:
    """The variables of the second process of node 1 in a 2-node x 2-process world.

    ``torchrun``: what its elastic agent exports; ``slurm``: what ``srun`` exports (no
    ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``). ``visible``: ``all`` (both GPUs of the node
    visible to each process) or ``one`` (one GPU per task, e.g. ``--gpus-per-task 1``)."""
    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    if launcher == "torchrun":
        env.update(
            TORCHELASTIC_RUN_ID="job", RANK="3", LOCAL_RANK="1", WORLD_SIZE="4",
            GROUP_RANK="1", LOCAL_WORLD_SIZE="2",
        )  # fmt: skip
    else:
        env.update(
            SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_PROCID="3",
            SLURM_LOCALID="1", SLURM_NODEID="1", SLURM_JOB_NAME="salvage", SLURM_JOB_ID="77",
        )  # fmt: skip
    env["CUDA_VISIBLE_DEVICES"] = "0,1" if visible == "all" else "1"
    return env


@pytest.mark.parametrize("visible", ["all", "one"])
@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_launcher_variables_on_node_1_of_a_two_node_world(launcher, visible, monkeypatch):
    """Rank 3 of 4 (node 1, its second process): the external launcher is told the *global*
    rank, the world size and the device the rank trains on, whichever launcher started it.

    The ranks come from Lightning's own cluster environment for those variables (the one its
    trainer picks), the device index as Lightning sets it: ``parallel_devices[local_rank]``
    of the GPUs this process sees (one visible GPU: device 0)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    env = _node1_of_two(launcher, visible)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in [n for n in os.environ if n.startswith(("SLURM_", "TORCHELASTIC"))]:
        monkeypatch.delenv(name)
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    cluster = TorchElasticEnvironment() if launcher == "torchrun" else SLURMEnvironment()
    assert type(cluster).detect()
    rank, local, world = cluster.global_rank(), cluster.local_rank(), cluster.world_size()
    assert (rank, local, world, cluster.node_rank()) == (3, 1, 4, 1)
    device = local if visible == "all" else 0  # torch.cuda.current_device() after set_device
    changed = launcher_env(env, rank, device, world)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", str(device), "4")
    if launcher == "torchrun":  # torchrun's own variables are right, but for the device
        assert changed == ({} if visible == "all" else {"LOCAL_RANK": ("1", "0")})
    if launcher == "slurm":
        assert changed["RANK"] == (None, "3") and changed["WORLD_SIZE"] == (None, "4")
    assert env["MASTER_ADDR"] == "node0" and env["MASTER_PORT"] == "29500"


# -- sampling ----------------------------------------------------------------------
def test_request_seeds_are_spaced_by_n_so_no_sample_shares_a_seed():
    # vLLM seeds sample j of request i with seeds[i] + j (parallel_sampling.py)
    seeds = request_seeds(5, num_prompts=3, n=4)
    base = (5 * 1_000_003) % (2**31 - 1)
    assert seeds == [base, base + 4, base + 8]
    all_samples = [s + j for s in seeds for j in range(4)]
    assert len(set(all_samples)) == 12
    # the old layout (seed + i) gave prompt 0's sample 1 prompt 1's sample 0 seed
    old = [base + i for i in range(3)]
    assert len({s + j for s in old for j in range(4)}) < 12
    assert request_seeds(5, 3, 4) == seeds and request_seeds(6, 3, 4) != seeds


def test_greedy_sends_one_sample_per_prompt():
    assert samples_to_send(0.0, 4) == 1
    assert samples_to_send(0.7, 4) == 4
    assert samples_to_send(1.0, 1) == 1


def test_engine_config_refuses_what_vllm_refuses_or_changes():
    with pytest.raises(ValueError, match=r"engine.temperature=2.5.*\[0, 2\]"):
        EngineConfig(backend="vllm", temperature=2.5)
    with pytest.raises(ValueError, match=r"engine.temperature=0.005"):
        EngineConfig(backend="vllm", temperature=0.005)
    with pytest.raises(ValueError, match=r"engine.top_p=0.9 with vllm_recompute_logprobs"):
        EngineConfig(backend="vllm", top_p=0.9, vllm_recompute_logprobs=False)
    # accepted: greedy, 2.0, top-p with recomputed log-probs, and anything on the HF engine
    EngineConfig(backend="vllm", temperature=0.0)
    EngineConfig(backend="vllm", temperature=2.0)
    EngineConfig(backend="vllm", top_p=0.9)
    EngineConfig(backend="hf", temperature=2.5, top_p=0.9, vllm_recompute_logprobs=False)


# -- sync bookkeeping ----------------------------------------------------------------
def test_a_trainable_engine_syncs_at_its_first_prepare_even_at_version_0():
    s = SyncState(frozen=False)
    assert s.needs_sync(0)  # vLLM loaded the checkpoint on disk, not the live model
    s.synced(0)
    assert not s.needs_sync(0)
    assert s.needs_sync(1)
    s.synced(1)
    s.slept(1)
    assert not s.needs_sync(1)  # level 1 keeps the weights (offloaded to CPU)
    s.slept(2)
    assert s.needs_sync(1)  # level 2 discarded them
    s.synced(1)
    assert not s.needs_sync(1)


def test_a_resumed_policy_at_version_3_is_synced_too():
    s = SyncState(frozen=False)
    assert s.needs_sync(3)


def test_a_frozen_engine_never_syncs():
    s = SyncState(frozen=True)
    assert not s.needs_sync(0) and not s.needs_sync(5)


# -- one sleep-mode engine per process, shared backends ----------------------------
def test_registry_gives_sleep_mode_to_the_first_trainable_engine_only():
    reg = EngineRegistry()
    assert reg.sleep_level(1, frozen=True) == 0  # a teacher built first does not take it
    assert reg.sleep_level(1, frozen=False) == 1
    a = object()
    reg.claim_sleep(a)
    assert reg.sleep_level(2, frozen=False) == 0  # GRAFT's second policy
    assert reg.sleep_level(1, frozen=True) == 0
    assert reg.sleep_level(0, frozen=False) == 0
    with pytest.raises(RuntimeError, match="already uses sleep mode"):
        reg.claim_sleep(object())


def test_registry_shares_a_backend_per_live_model_and_settings():
    reg = EngineRegistry()
    m1, m2 = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    key = (0.3, 1, True, None, "bfloat16", False)
    backend = object()
    reg.add(m1, key, backend)
    assert reg.find(m1, key) is backend  # evaluation reuses the training engine
    assert reg.find(m2, key) is None  # another model: its own engine
    assert reg.find(m1, key[:-1] + (True,)) is None  # other settings: its own engine
    del m1
    import gc

    gc.collect()
    assert reg.find(m2, key) is None
    assert reg._shared == []  # a dead model's entry is dropped


# -- RNG -------------------------------------------------------------------------------
def test_preserved_rng_puts_every_global_stream_back():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    with preserved_rng():  # what vLLM's set_random_seed does while an engine is built
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        torch.rand(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_preserved_rng_restores_after_an_error():
    torch.manual_seed(7)
    state = torch.get_rng_state()
    with pytest.raises(ValueError), preserved_rng():
        torch.manual_seed(0)
        raise ValueError("engine build failed")
    assert torch.equal(torch.get_rng_state(), state)


# -- platform: vLLM's CPU build -------------------------------------------------------------
CPU = PlatformFacts("cpu", True, False, ("bfloat16", "float16", "float32"), (32, 64, 128))
GPU = PlatformFacts("cuda", False, True, ("bfloat16", "float16", "float32"))


def test_cpu_has_no_sleep_mode_and_says_why_in_one_line():
    level, why = platform_sleep_level(1, CPU)
    assert level == 0 and why is not None and "\n" not in why
    assert "no sleep mode on cpu" in why and "vllm_sleep_level=1" in why
    assert platform_sleep_level(2, GPU) == (2, None)
    assert platform_sleep_level(0, CPU) == (0, None)


def test_eager_by_default_on_cpu_only():
    assert default_enforce_eager(None, CPU) is True
    assert default_enforce_eager(None, GPU) is False
    assert default_enforce_eager(False, CPU) is False
    assert EngineConfig(backend="vllm").vllm_enforce_eager is None


def test_a_model_the_backend_cannot_serve_is_refused_naming_value_and_limits():
    with pytest.raises(ValueError, match=r"tiny has attention head size 16.*32, 64, 128"):
        check_servable("tiny", 16, "float32", CPU)
    with pytest.raises(ValueError, match=r"vllm_dtype='float64'.*bfloat16, float16, float32"):
        check_servable("m", 64, "float64", CPU)
    check_servable("m", 64, "float32", CPU)
    check_servable("m", 16, "bfloat16", GPU)  # GPU attention backends: vLLM picks per model
    from types import SimpleNamespace

    assert model_head_dim(SimpleNamespace(hidden_size=256, num_attention_heads=4)) == 64
    assert model_head_dim(SimpleNamespace(head_dim=80, hidden_size=256)) == 80


def test_cpu_kvcache_size_and_the_process_sum_against_memory():
    assert cpu_kvcache_gib(3, {}) == 3
    assert cpu_kvcache_gib(None, {CPU_KVCACHE_VAR: "2"}) == 2
    assert cpu_kvcache_gib(None, {}) == 1
    with pytest.raises(ValueError, match="whole number"):
        cpu_kvcache_gib(None, {CPU_KVCACHE_VAR: "1.5"})
    gib = 1024**3
    check_cpu_kvcache_fits(4, [4, 3], 24 * gib)  # 11 of 12 GiB allowed
    with pytest.raises(ValueError, match=r"would hold 13 GiB.*7 GiB in 2 engine\(s\)"):
        check_cpu_kvcache_fits(6, [4, 3], 24 * gib)
    with pytest.raises(ValueError, match="engine.vllm_cpu_kvcache_gb"):
        EngineConfig(backend="vllm", vllm_cpu_kvcache_gb=0)


def test_seeded_requests_are_never_prefilled_in_chunks_on_cpu():
    kw = cpu_scheduler_kwargs(2048)
    assert kw == {"enable_chunked_prefill": False, "max_num_batched_tokens": 4096}
    assert cpu_scheduler_kwargs(8192)["max_num_batched_tokens"] == 8192  # >= one context


def test_trainable_cpu_engines_refuse_weights_vllm_would_repack():
    assert cpu_weight_packing_problem("float32", amx=True, frozen=False) is None
    assert cpu_weight_packing_problem("bfloat16", amx=False, frozen=False) is None
    assert cpu_weight_packing_problem("bfloat16", amx=True, frozen=True) is None
    why = cpu_weight_packing_problem("bfloat16", amx=True, frozen=False)
    assert why is not None and "float32" in why


def test_registry_forgets_a_closed_backend_and_sums_kv_caches():
    class B:
        def __init__(self, kv):
            self.kv_gib = kv

    reg, model = EngineRegistry(), torch.nn.Linear(1, 1)
    a, b = B(2), B(3)
    reg.add(model, ("a",), a)
    reg.add(model, ("b",), b)
    reg.claim_sleep(a)
    assert sorted(reg.kv_cache_gib()) == [2, 3]
    reg.remove(a)
    assert reg.kv_cache_gib() == [3] and reg.sleep_owner is None and reg.find(model, ("a",)) is None
