"""Where one CPU decode step's time goes, and the decode efficiency each part allows.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/decode_ceiling.py [--models smollm2-135m-instruct] [--batch 8] [--rounds 5]

The decode target is >= 40% of the bandwidth floor (``--batch`` x probed read
bandwidth / fp32 bytes of the weights one step reads). This splits a step the way the
engine's own loop runs it and prints, for each part, the efficiency the step could reach if
that part were all there were. Measured in one process, the parts alternating over
``--rounds`` (medians; one warm-up round first):

- ``step``: one KV-cache forward of ``--batch`` rows after a prefill of ``--batch`` prompts
  (cache grown to prompt + ``--cache-steps`` tokens; the LM head as ``W @ h.T`` where
  ``tall_head_fits``), plus the sampler (softmax, one multinomial draw per row, the sampled
  tokens' log-probs), i.e. what one decode step of ``salvage.rollout.hf.decode`` costs.
- ``gemm``: the model's own projection weights (every ``nn.Linear`` of the decoder and the
  LM head, in module order) applied to ``--batch`` rows, in the forms the step uses
  (``F.linear``; the head as ``W @ h.T`` where the step uses that). The step's arithmetic
  on its weights, without attention, norms, the cache, the sampler or Python.
- ``stream``: the same weights applied to 1 row: the same bytes read with 1/``--batch`` of
  the arithmetic, i.e. the rate at which this machine streams these matrices through BLAS.
- ``compiled``: ``step`` with the forward run through ``torch.compile`` of the model
  (``engine.hf_compile_decode``; compiled before timing, weights not frozen).
- ``rest`` = step - gemm: attention, KV cache, norms, rotary, activations, sampler, and the
  per-op overhead of an eager forward.
- ``probe``: ``probes.bandwidth_probe`` (summing one tensor 8x the last-level cache).

Efficiency of a part = (the floor's time for one step) / (the part's time): ``step`` is the
decode efficiency; ``gemm`` the most any change outside the GEMM kernels could give;
``stream`` the most a per-matrix kernel reading each weight once per step could give;
``rest`` the most faster GEMMs alone could give. Not a test; a shared machine is noisy,
compare the parts of one run.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from engine_vs_generate import prompts_for  # noqa: E402
from probes import bandwidth_probe, median_time  # noqa: E402

from salvage.core.flops import decode_weight_bytes  # noqa: E402
from salvage.lm import pad_left  # noqa: E402
from salvage.memory import shape_of  # noqa: E402
from salvage.models import PolicySpec, load_policy  # noqa: E402
from salvage.rollout.hf import HeadSwap, tall_head_fits  # noqa: E402


def weights_in_order(model: torch.nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """Every projection weight a decode step reads, with whether it runs as ``W @ h.T``."""
    head = model.get_output_embeddings()
    tall = tall_head_fits(model)
    out = [
        (m.weight, False)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
    ]
    return [*out, (head.weight, tall)]


def gemm_chain(weights: list[tuple[torch.Tensor, bool]], rows: int) -> callable:  # type: ignore[valid-type]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w, _ in weights}

    def run() -> None:
        for w, tall in weights:
            x = xs[w.shape[1]]
            torch.mm(w, x.t()) if tall else F.linear(x, w)

    return run


class Stepper:
    """A prefilled batch; each call is one decode step (sampler + forward) on a growing
    ``DynamicCache``, as the engine's loop runs it (no rows leave)."""

    def __init__(self, model: torch.nn.Module, prompts: list[list[int]], pad_id: int) -> None:
        from transformers import DynamicCache

        self.model = model
        ids, mask = pad_left(prompts, pad_id)
        self.key = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:
            self.cache = DynamicCache()
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            **{self.key: self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.logits = out.logits[:, -1].float()
        self.att, self.last = mask, pos[:, -1:]
        self.gen = torch.Generator().manual_seed(0)

    def __call__(self) -> None:
        probs = self.logits.softmax(dim=-1)
        pick = torch.multinomial(probs, 1, generator=self.gen)
        torch.log_softmax(self.logits, dim=-1).gather(-1, pick)
        self.att = torch.cat([self.att, self.att.new_ones(self.att.shape[0], 1)], dim=1)
        self.last = self.last + 1
        out = self.model(
            input_ids=pick,
            attention_mask=self.att,
            position_ids=self.last,
            **{self.key: self.cache},
            use_cache=True,
        )
        self.logits = out.logits[:, -1].float()


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache-steps", type=int, default=16, help="decode steps before timing")
    a = ap.parse_args()
    print(f"torch threads {torch.get_num_threads()}, batch {a.batch}, {a.rounds} rounds")
    for name in a.models:
        model, tok = load_policy(PolicySpec(name))
        model.eval()
        weights = weights_in_order(model)
        floor_bytes = decode_weight_bytes(shape_of({"name_or_path": name}))  # one step's reads
        prompts = prompts_for(tok, a.batch)
        cpu = torch.device("cpu")
        with HeadSwap(model, tall_head_fits(model)):
            step = Stepper(model, prompts, int(tok.pad_token_id))
            compiled = Stepper(model, prompts, int(tok.pad_token_id))
            compiled.model = torch.compile(model, dynamic=True)
            t0 = time.perf_counter()
            for _ in range(a.cache_steps):
                step()
                compiled()
            print(
                f"{a.cache_steps} steps of each, compiling included: {time.perf_counter() - t0:.0f} s"
            )
            parts = {
                "step": step,
                "compiled": compiled,
                "gemm": gemm_chain(weights, a.batch),
                "stream": gemm_chain(weights, 1),
            }
            got: dict[str, list[float]] = {k: [] for k in [*parts, "probe"]}
            for r in range(a.rounds + 1):  # round 0: warm-up
                times = {k: median_time(fn, cpu, 3) for k, fn in parts.items()}
                bw = bandwidth_probe("cpu")
                if r:
                    for k, t in times.items():
                        got[k].append(t)
                    got["probe"].append(bw)
        med = {k: statistics.median(v) for k, v in got.items()}
        med["rest"] = med["step"] - med["gemm"]
        bw = med.pop("probe")
        t_floor = floor_bytes / bw
        nbytes = sum(w.numel() * w.element_size() for w, _ in weights)
        print(
            f"\n{name}: {nbytes / 1e6:.3g} MB of projection weights per step "
            f"({floor_bytes / 1e6:.3g} MB counted by the floor); bandwidth probe {bw / 1e9:.1f} GB/s; "
            f"floor {t_floor * 1e3:.3g} ms per step = {a.batch / t_floor:.0f} tok/s at batch {a.batch}"
        )
        print("| part | ms per step | weight read rate (GB/s) | efficiency it allows |")
        print("|---|---|---|---|")
        for k in ("step", "compiled", "gemm", "stream", "rest"):
            rate = f"{nbytes / med[k] / 1e9:.1f}" if k != "rest" else "-"
            print(f"| {k} | {med[k] * 1e3:.1f} | {rate} | {t_floor / med[k]:.3f} |")
        print(
            f"gemm share of the step {med['gemm'] / med['step']:.0%}; at the stream rate the "
            f"step would take {(med['stream'] + med['rest']) * 1e3:.1f} ms "
            f"(efficiency {t_floor / (med['stream'] + med['rest']):.3f}); compiled / eager step "
            f"{med['compiled'] / med['step']:.2f}x, its rest (compiled - gemm) "
            f"{(med['compiled'] - med['gemm']) * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
