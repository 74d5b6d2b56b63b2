"""The vLLM engine: tests that need vllm (marker ``vllm``: its CPU build or a GPU) skip
without it, with the reason; config errors and the temporary checkpoints are tested
everywhere. ``make test-vllm`` runs them on vLLM's CPU build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from salvage.lm import bump_weights_version, weights_version
from salvage.rollout.config import EngineConfig, build_engine, generate_with_retry
from salvage.rollout.vllm import (
    SOURCE_PREFIX,
    TempCheckpoint,
    iter_full_parameters,
    sweep_stale_checkpoints,
    vllm_available,
)

OK, WHY = vllm_available()
needs_vllm = pytest.mark.skipif(not OK, reason=f"vLLM engine cannot run here: {WHY}")
ON_GPU = torch.cuda.is_available()
DTYPE = "bfloat16" if ON_GPU else "float32"
"""The engine's dtype in these tests: fp32 on CPU (log-probs comparable to the policy's)."""
LOGPROB_GAP = 1e-4 if ON_GPU else 1e-5
"""The largest gap allowed between vLLM's fp32 sampled-token log-probs and the policy's."""
ROOT = Path(__file__).resolve().parents[1]


def _dev(model):
    return model.cuda() if ON_GPU else model


def _cfg(**kw):
    return EngineConfig(backend="vllm", vllm_dtype=DTYPE, **kw)


@pytest.fixture
def tiny64():
    """``tiny`` with 4 heads of size 64, a size every vLLM attention backend takes (FlashInfer: 64+)."""
    from salvage.models import PolicySpec, load_policy

    return load_policy(PolicySpec("tiny", hidden_size=256))


def test_backend_vllm_fails_clearly_without_vllm(tiny):
    model, tok = tiny
    if OK:
        pytest.skip("vllm runs here")
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


# -- temporary checkpoints (no vllm needed) ------------------------------------------------
def test_temporary_checkpoint_is_removed_on_close(tiny, tmp_path):
    from salvage.rollout.vllm import _Backend

    model, tok = tiny
    ckpt = TempCheckpoint(model, tok, tmp=str(tmp_path))
    assert ckpt.path.name.startswith(f"{SOURCE_PREFIX}{os.getpid()}-")
    assert (ckpt.path / "config.json").exists()
    backend = _Backend(llm=None, model=model, sleep_level=0, frozen=False, checkpoint=ckpt)
    backend.close()
    assert not ckpt.path.exists()
    ckpt.remove()  # idempotent


def test_temporary_checkpoint_is_removed_at_exit_and_a_dead_process_one_swept(tmp_path):
    code = (
        "import sys; from salvage.models import PolicySpec, load_policy; "
        "from salvage.rollout.vllm import TempCheckpoint; "
        "m, t = load_policy(PolicySpec('tiny')); "
        "c = TempCheckpoint(m, t, tmp=sys.argv[1]); print(c.path, flush=True)"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    path = Path(out.stdout.strip().splitlines()[-1])
    assert path.parent == tmp_path and not path.exists()  # removed at the child's exit
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f"{SOURCE_PREFIX}{dead.stdout.strip()}-abc"  # a killed run's
    mine = tmp_path / f"{SOURCE_PREFIX}{os.getpid()}-abc"
    stale.mkdir()
    mine.mkdir()
    assert sweep_stale_checkpoints(str(tmp_path)) == [stale]
    assert not stale.exists() and mine.exists()


# -- the engine on vLLM (CPU build or GPU) -----------------------------------------------------
def _prompts(tok):
    return [
        tok("go north", add_special_tokens=False)["input_ids"],
        tok("take coin", add_special_tokens=False)["input_ids"],
    ]


@pytest.mark.vllm
@needs_vllm
def test_vllm_samples_n_per_prompt_with_stop_and_exact_logprobs(tiny64):
    from salvage.lm import response_logprobs

    model, tok = tiny64
    model = _dev(model)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    eng = build_engine(_cfg(max_new_tokens=16, stop=["</action>"], temperature=1.0), model, tok)
    assert torch.set_num_threads is set_threads and torch.get_num_threads() == threads
    if not ON_GPU:
        assert eng.sleep_level == 0 and eng.llm.llm_engine.vllm_config.model_config.enforce_eager
    eng.prepare()
    out = eng.generate(_prompts(tok), n=3, seed=1)
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
    ckpt = eng.backend.checkpoint
    assert ckpt is not None and ckpt.path.exists()
    eng.close()
    assert not ckpt.path.exists()


@pytest.mark.vllm
@needs_vllm
def test_vllm_own_logprobs_match_the_policy_in_fp32(tiny64):
    from salvage.lm import response_logprobs

    model, tok = tiny64
    model = _dev(model.float())
    cfg = EngineConfig(
        backend="vllm", max_new_tokens=16, vllm_dtype="float32", vllm_recompute_logprobs=False
    )
    eng = build_engine(cfg, model, tok)
    flat = [s for g in eng.generate(_prompts(tok), n=3, seed=2) for s in g]
    ref = response_logprobs(
        model, [s.prompt_ids for s in flat], [s.response_ids for s in flat], int(tok.pad_token_id)
    )
    gap = max(
        abs(a - b)
        for s, r in zip(flat, ref, strict=True)
        for a, b in zip(s.logprobs, r, strict=True)
    )
    print(f"vLLM fp32 sampled-token log-probs vs the policy's: max gap {gap:.2e}")
    assert gap < LOGPROB_GAP
    eng.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_first_prepare_syncs_the_live_model_and_greedy_gives_n_copies(tiny64, tmp_path):
    from salvage.rollout.hf import HFEngine

    model, tok = tiny64
    model.save_pretrained(tmp_path)  # the checkpoint vLLM loads
    tok.save_pretrained(tmp_path)
    model.config._name_or_path = str(tmp_path)
    model = _dev(model)
    prompt = [tok("go north", add_special_tokens=False)["input_ids"]]
    hf = HFEngine(model, tok, max_new_tokens=8, temperature=0.0)
    on_disk = hf.generate(prompt, n=1)[0][0].response_ids
    with torch.no_grad():  # a warm start changed the live model; its version is still 0
        model.model.norm.weight.neg_()
    live = hf.generate(prompt, n=1)[0][0].response_ids
    assert on_disk[:2] != live[:2]
    eng = build_engine(_cfg(max_new_tokens=8, temperature=0.0), model, tok)
    eng.prepare()
    out = eng.generate(prompt, n=3)[0]
    assert len(out) == 3 and len({tuple(s.response_ids) for s in out}) == 1
    if ON_GPU:
        assert out[0].response_ids[:2] == live[:2]  # bf16 vs fp32: the first tokens only
    else:
        assert out[0].response_ids == live  # fp32 both: the same greedy tokens
    eng.release()
    eng.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_resyncs_weights_after_an_update(tiny64):
    model, tok = tiny64
    model = _dev(model)
    eng = build_engine(_cfg(max_new_tokens=8, temperature=0.0), model, tok)
    prompt = [tok("go north", add_special_tokens=False)["input_ids"]]
    before = eng.generate(prompt, n=1)[0][0].response_ids
    with torch.no_grad():
        model.lm_head.weight.add_(torch.randn_like(model.lm_head.weight))
    bump_weights_version(model)
    eng.prepare()
    after = eng.generate(prompt, n=1)[0][0].response_ids
    assert after != before
    eng.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_error_is_retried_on_a_rebuilt_engine(tiny64):
    model, tok = tiny64
    model = _dev(model)
    eng = build_engine(_cfg(max_new_tokens=8, temperature=1.0), model, tok)
    want = eng.generate(_prompts(tok), n=2, seed=3)
    broken = eng.llm

    def fail(*a, **kw):
        raise RuntimeError("injected vLLM fault")

    broken.generate = fail
    got = generate_with_retry(eng, _prompts(tok), n=2, seed=3)
    assert eng.llm is not broken and eng.backend.rebuilds == 1  # never the same LLM again
    assert [[s.response_ids for s in g] for g in got] == [[s.response_ids for s in g] for g in want]
    eng.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_seeded_prompts_longer_than_the_prefill_budget(tiny64):
    # 24 prompts x 400 tokens: more than a step's 4096-token budget, so with chunked
    # prefill a seeded prompt would be split ("CPU Generator does not use offset" on CPU)
    model, tok = tiny64
    model = _dev(model)
    eng = build_engine(_cfg(max_new_tokens=4, temperature=1.0), model, tok)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(400)] for i in range(24)]
    out = generate_with_retry(eng, prompts, n=2, seed=5)
    again = eng.generate(prompts, n=2, seed=5)
    assert eng.backend.rebuilds == 0 and len(out) == 24
    assert [[s.response_ids for s in g] for g in out] == [
        [s.response_ids for s in g] for g in again
    ]
    eng.close()


@pytest.mark.vllm
@needs_vllm
def test_vllm_refuses_a_head_size_the_backend_cannot_serve(tiny):
    if ON_GPU:
        pytest.skip("checks vLLM's CPU attention limits")
    model, tok = tiny  # 4 heads of size 16
    with pytest.raises(ValueError, match=r"attention head size 16.*supports head sizes 32, 64"):
        build_engine(_cfg(), model, tok)


def _math_fit(tmp_path, engine: EngineConfig, policy: dict):
    """One GRPO update on two `add` prompts through ``salvage``'s own datamodule and module."""
    import lightning as L

    from salvage.datamodules.rlvr import RLVRDataModule
    from salvage.models import PolicySpec
    from salvage.modules.grpo import GRPOModule
    from salvage.tasks.math import MathData

    data = RLVRDataModule(
        train=MathData(
            size=2, seed=0, rg_kwargs={"operators": ["+"], "min_terms": 2, "max_terms": 2}
        ),
        prompts_per_step=1,
        group_size=2,
        engine=engine,
    )
    module = GRPOModule(policy=PolicySpec("tiny", **policy), lr=1e-4, num_minibatches=1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return data


def test_a_fit_closes_the_engines_it_built(tmp_path):
    """The datamodule closes its engines when the fit ends (teardown): a vLLM engine's
    ``LLM`` and temporary checkpoint do not outlive the fit that built them."""
    data = _math_fit(tmp_path, EngineConfig(max_new_tokens=4), {})
    assert data.live_engines() == []


@pytest.mark.vllm
@needs_vllm
def test_vllm_fit_leaves_no_temporary_checkpoint(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    data = _math_fit(tmp_path, _cfg(max_new_tokens=4), {"hidden_size": 256})
    assert data.live_engines() == []
    assert not list(Path(tempfile.gettempdir()).glob(SOURCE_PREFIX + "*"))


def test_vllms_temporary_files_go_in_a_dir_the_sweep_owns(tmp_path, monkeypatch):
    """vLLM's FileStore rendezvous is ``tempfile.gettempdir()/vllm_dist_<hex>``
    (``vllm.utils.network_utils.get_file_store_init_method``, 0.32): during a build it lands
    in ``salvage-vllm-<pid>-tmp-*``, which the next build removes once the pid is gone."""
    import tempfile

    from salvage.rollout import vllm_support

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with vllm_support.owned_tempdir() as d:
        assert tempfile.gettempdir() == str(d) == os.environ["TMPDIR"]
        assert d.parent == tmp_path and d.name.startswith(f"{SOURCE_PREFIX}{os.getpid()}-tmp-")
        store = Path(tempfile.gettempdir()) / "vllm_dist_0123abcd"  # as vLLM names it
        store.write_bytes(b"")
    assert os.environ["TMPDIR"] == str(tmp_path) and tempfile.tempdir is None
    # a killed process's dir (pid 2**22 + 1: above Linux's pid_max default) is swept
    dead = tmp_path / f"{SOURCE_PREFIX}{2**22 + 1}-tmp-xyz"
    dead.mkdir()
    (dead / "vllm_dist_deadbeef").write_bytes(b"")
    with vllm_support.owned_tempdir():
        pass
    assert not dead.exists() and store.exists()  # this process's own stays until its engine ends
    with vllm_support.owned_tempdir() as other:
        pass
    vllm_support.remove_owned_dir(d)  # an engine's shutdown removes its own dir, not another's
    assert not d.exists() and other.exists() and d not in vllm_support._OWNED_DIRS
    vllm_support._remove_owned_dirs()  # and exit removes the rest
    assert not other.exists()


def _cli_fit(tmp_path, policy: str, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    env.pop("VLLM_LOGGING_LEVEL", None)
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "salvage",
            "fit",
            "--config",
            str(ROOT / "configs/grpo/math_tiny.yaml"),
            "--model.init_args.policy",
            policy,
            "--data.init_args.engine.backend",
            "vllm",
            "--data.init_args.engine.vllm_dtype",
            DTYPE,
            "--data.init_args.engine.vllm_cpu_kvcache_gb",
            "1",
            "--trainer.max_steps",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            *extra,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.vllm
@needs_vllm
def test_a_vllm_fit_prints_no_third_party_lines_and_a_bad_model_is_one_line(tmp_path):
    """Without --verbose, a vLLM-backed fit shows none of vLLM's INFO / WARNING lines (some
    are logged while its modules are imported, before vLLM configures logging), no weight
    loading bar and no torch C++ warning (the CPU worker's NUMA binding); a model vLLM cannot
    serve (tiny's head size 16) is one line, exit 2."""
    ok = _cli_fit(tmp_path, '{"name_or_path": "tiny", "hidden_size": 256}')
    assert ok.returncode == 0, ok.stderr[-3000:]
    lines = (ok.stdout + ok.stderr).splitlines()
    noisy = [
        x
        for x in lines
        if any(m in x for m in (" INFO ", " WARNING ", "Triton", "Loading safetensors", "[W"))
    ]
    assert noisy == [], noisy[:5]
    bad = _cli_fit(tmp_path, '{"name_or_path": "tiny"}')
    assert bad.returncode == 2, bad.stderr[-3000:]
    err = [x for x in bad.stderr.splitlines() if x.startswith("salvage: error")]
    assert len(err) == 1 and "head size 16" in err[0], bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
    # an engine error (a generate past its limit, twice: the rebuilt engine too) is one line
    slow = _cli_fit(
        tmp_path,
        '{"name_or_path": "tiny", "hidden_size": 256}',
        "--data.init_args.engine.generate_timeout_s",
        "0.001",
    )
    assert slow.returncode == 1, slow.stderr[-3000:]
    err = [x for x in slow.stderr.splitlines() if x.startswith("salvage: error")]
    assert len(err) == 1 and "generate_timeout_s=0.001" in err[0], slow.stderr[-3000:]
    assert "Traceback" not in slow.stderr and "[rank0]" not in slow.stderr
