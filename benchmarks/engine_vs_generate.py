"""salvage's HF rollout engine vs plain ``transformers`` ``generate`` on the same batch.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/engine_vs_generate.py [--models tiny smollm2-135m-instruct]

Both sides: the same model, prompts (left-padded), n samples, max new tokens, sampling
settings, seed; measured alternately (A B A B ...) in one process, median of ``--repeats``.
The engine runs its defaults: its own decode loop (``engine.hf_decode_loop: own``: one
prefill per distinct prompt, KV-cache steps, ended rows leave the batch) with the behaviour
log-probs taken from the sampler's logits, so its "log-prob pass" column reads ~0 unless
``hf_recompute_logprobs`` makes it run the separate teacher-forced pass (reduced precision);
plain ``generate`` computes no log-probs. ``decode_cpu.py`` compares the engine's two decode
loops.
Not a test; compare ratios, not absolute times, on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from salvage.lm import pad_left  # noqa: E402
from salvage.models import PolicySpec, load_policy  # noqa: E402
from salvage.rollout.hf import HFEngine  # noqa: E402
from salvage.tasks.math import MathData, load_math_tasks  # noqa: E402


def prompts_for(tok, k: int) -> list[list[int]]:
    tasks, _ = load_math_tasks(MathData(source="reasoning_gym:basic_arithmetic", size=k))
    out = []
    for t in tasks:
        s = tok.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True)
        out.append(list(tok(s, add_special_tokens=False)["input_ids"]))
    return out


def plain(model, tok, prompts, n, new, seed) -> float:
    flat = [p for p in prompts for _ in range(n)]
    ids, mask = pad_left(flat, tok.pad_token_id)
    t0 = time.perf_counter()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m-instruct"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rows = []
    for name in a.models:
        model, tok = load_policy(PolicySpec(name))
        model.eval()
        prompts = prompts_for(tok, a.prompts)
        eng = HFEngine(
            model,
            tok,
            max_new_tokens=a.new_tokens,
            batch_size=a.prompts * a.n,
            logprob_batch_size=a.prompts * a.n,
        )
        plain(model, tok, prompts, a.n, a.new_tokens, 0)  # warm-up
        eng.generate(prompts, n=a.n, seed=0)
        p_t, e_s, e_l = [], [], []
        for r in range(a.repeats):
            p_t.append(plain(model, tok, prompts, a.n, a.new_tokens, r + 1))
            eng.generate(prompts, n=a.n, seed=r + 1)
            e_s.append(eng.last_timings["sample_s"])
            e_l.append(eng.last_timings["logprob_s"])
        med = statistics.median
        rows.append((name, med(p_t), med(e_s), med(e_l)))
    print(
        f"\nHF engine vs plain generate: {a.prompts} prompts x {a.n} samples x {a.new_tokens} new tokens, "
        f"median of {a.repeats}"
    )
    print(
        "| model | plain generate (s) | engine sampling (s) | sampling / plain | + log-prob pass (s) | total / plain |"
    )
    print("|---|---|---|---|---|---|")
    for name, p, s, lp in rows:
        print(f"| {name} | {p:.2f} | {s:.2f} | {s / p:.3f} | {lp:.2f} | {(s + lp) / p:.3f} |")


if __name__ == "__main__":
    main()
