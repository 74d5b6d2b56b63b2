"""The HF engine's decode loop against the previous engine, alternating on the same batch.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_cpu.py [--models smollm2-135m-instruct] [--batch 8] [--new-tokens 32] [--rounds 3]

Sides, each called A B A B ... on the same prompts (``--batch`` sequences: ``--batch / --n``
prompts x ``--n`` samples, one engine chunk) with the same seed, fp32:

- ``before``: ``engine.hf_decode_loop: generate`` + ``hf_recompute_logprobs: true`` (the
  engine as it was: ``transformers`` ``generate``, then a teacher-forced log-prob pass);
- ``after_linear``: our decode loop with the LM head as ``F.linear`` (``hf_tall_head: false``);
- ``after``: the defaults (our decode loop, log-probs from the sampler's logits, the LM
  head as ``W @ h.T`` where ``tall_head_fits``).

Per side, medians over the rounds (the first call of each side is a warm-up, not
counted): wall seconds per engine call, generated tokens/s over that whole call
(sampling + log-probs), and decode efficiency = tokens/s over the bandwidth floor
(``--batch`` x probed read bandwidth / fp32 bytes of the weights one decode step reads;
``probes.py``, probed in the same process after the runs). ``after`` also prints its
decode-only rate (tokens after each row's first, over the time of the KV-cache steps) and
that rate's efficiency. Whether both sides drew the same tokens is printed too, and the
first-step ratio deviation of the sampler's log-probs: max and mean |sampler lp -
teacher-forced lp| over the last round's tokens and of exp(that difference) - 1 (the
first PPO ratio, which the recomputed pass makes exactly 1). Not a test; a shared machine
is noisy, compare the sides of one run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from engine_vs_generate import prompts_for  # noqa: E402
from probes import bandwidth_probe  # noqa: E402

from salvage.core.flops import decode_floor_tokens_per_s  # noqa: E402
from salvage.lm import response_logprobs  # noqa: E402
from salvage.memory import shape_of  # noqa: E402
from salvage.models import PolicySpec, load_policy  # noqa: E402
from salvage.rollout.hf import HFEngine  # noqa: E402

SIDES = {
    "before": dict(decode_loop="generate", recompute_logprobs=True),
    "after_linear": dict(decode_loop="own", recompute_logprobs=False, tall_head=False),
    "after": dict(decode_loop="own", recompute_logprobs=False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (batch / n prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    a = ap.parse_args()
    print(
        f"torch threads {torch.get_num_threads()}, batch {a.batch} ({a.batch // a.n} prompts x "
        f"{a.n}), <= {a.new_tokens} new tokens, T = {a.temperature}"
    )
    for name in a.models:
        model, tok = load_policy(PolicySpec(name))
        model.eval()
        prompts = prompts_for(tok, a.batch // a.n)
        engines = {
            side: HFEngine(
                model,
                tok,
                temperature=a.temperature,
                max_new_tokens=a.new_tokens,
                batch_size=a.batch,
                logprob_batch_size=a.batch,
                **kw,
            )
            for side, kw in SIDES.items()
        }
        res: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
        toks: dict[str, list[list[int]]] = {}
        last = []
        for r in range(a.rounds + 1):
            for side, eng in engines.items():
                t0 = time.perf_counter()
                out = eng.generate(prompts, n=a.n, seed=r)
                wall = time.perf_counter() - t0
                got = [s.response_ids for g in out for s in g]
                if r == a.rounds:
                    toks[side] = got
                    last = [s for g in out for s in g] if side == "after" else last
                n_tok = sum(len(x) for x in got)
                row = {"wall_s": wall, "tok_s": n_tok / wall, "len": n_tok / len(got)}
                if "decode_s" in eng.last_timings:
                    row["decode_tok_s"] = (n_tok - len(got)) / eng.last_timings["decode_s"]
                    row["prefill_s"] = eng.last_timings["prefill_s"]
                if r:  # round 0: warm-up
                    res[side].append(row)
        bw = bandwidth_probe("cpu")
        floor = decode_floor_tokens_per_s(shape_of({"name_or_path": name}), a.batch, bw)
        print(
            f"\n{name}: bandwidth {bw / 1e9:.1f} GB/s, floor {floor:.0f} tok/s at batch {a.batch}"
        )
        print("| side | wall (s) | tok/s | decode eff | decode-only tok/s | its eff | mean len |")
        print("|---|---|---|---|---|---|---|")
        med = {
            s: {k: statistics.median(x[k] for x in rows) for k in rows[0]}
            for s, rows in res.items()
        }
        for side, m in med.items():
            dec = m.get("decode_tok_s")
            dec_txt = f"{dec:.1f} | {dec / floor:.3f}" if dec else "- | -"
            print(
                f"| {side} | {m['wall_s']:.2f} | {m['tok_s']:.1f} | {m['tok_s'] / floor:.3f} | "
                f"{dec_txt} | {m['len']:.1f} |"
            )
        print(f"after / before wall: {med['after']['wall_s'] / med['before']['wall_s']:.2f}x")
        print(
            f"after / after_linear wall: "
            f"{med['after']['wall_s'] / med['after_linear']['wall_s']:.2f}x"
        )
        print(
            f"same tokens (last round): before = after {toks['before'] == toks['after']}, "
            f"after_linear = after {toks['after_linear'] == toks['after']}"
        )
        ref = response_logprobs(
            model,
            [s.prompt_ids for s in last],
            [s.response_ids for s in last],
            int(tok.pad_token_id),
            temperature=a.temperature if a.temperature > 0 else 1.0,
        )
        pairs = [
            (p, q)
            for s, r in zip(last, ref, strict=True)
            for p, q in zip(s.logprobs, r, strict=True)
        ]
        d = [abs(p - q) for p, q in pairs]
        q = [abs(math.expm1(p - q)) for p, q in pairs]
        print(
            f"sampler vs recomputed log-probs over {len(d)} tokens (T = {a.temperature}): "
            f"|diff| max {max(d):.2e} mean {statistics.mean(d):.2e}; "
            f"|ratio - 1| max {max(q):.2e} mean {statistics.mean(q):.2e}"
        )


if __name__ == "__main__":
    main()
