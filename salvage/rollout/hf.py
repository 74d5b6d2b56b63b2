"""Rollout engine on the live ``transformers`` model: the CPU / test path.

Batched sampling with temperature, top-p, max new tokens and stop strings; ``n`` samples
per prompt; seeded per chunk of ``batch_size`` sequences (its own generator, so the
caller's global RNG is untouched).

- **Decode loop** (``decode_loop``). ``own`` (default): one prefill of the left-padded
  prompts, then one forward of the last token per step with a KV cache; a row leaves the
  batch (and its cache) as soon as it ends (eos, a stop string in its text, or
  ``max_new_tokens``), so finished rows stop costing compute. Sampling processes the
  logits as ``transformers`` ``generate`` does (``logits / T``, then the nucleus), and
  draws every step one multinomial over all rows of the chunk (an ended row draws from a
  point mass), so the generator is consumed exactly as ``generate`` consumes it: the same
  seed gives the same tokens as ``generate`` up to floating-point rounding of a smaller
  batch (measured: identical on ``tiny`` and SmolLM2, see ``tests/test_engine.py`` and
  ``benchmarks/README.md``). ``generate``: ``transformers`` ``generate`` itself (the
  previous path, kept for one release).
- **Log-probs** (``recompute_logprobs``). False: the log-prob of each sampled token is
  read off the logits the sampler computed, ``log_softmax(logits / T)`` (T = 1 when
  greedy) before the nucleus cut, i.e. the same quantity the update computes for the
  current policy; in fp32 it differs from a teacher-forced pass only by rounding (KV-cache
  vs full-sequence matmuls; measured in README "HF rollouts"). True: a separate
  teacher-forced forward pass of the behaviour policy on the right-padded prompt +
  response at the sampling temperature (exactly the update's computation, so the first
  ratio is exactly 1; the old behaviour). None (default): False for an fp32 model outside
  autocast, True under reduced precision (bf16 / fp16 weights or autocast), where the two
  computations round apart by far more than in fp32.
- **Tall LM head** (``tall_head``, own loop only). Decoding a few rows, the LM head is a
  GEMM of a few rows against a vocabulary-tall weight; CPU BLAS runs ``F.linear`` on it well
  below the memory bandwidth (measured 41-100 ms for SmolLM2's head at 8 rows, ~45% of a
  step's GEMM time in a microbenchmark of its shapes). Computed as ``W @ h.T`` instead (the
  vocabulary as the long dimension) it is 1.46x (1 thread) to 2.3x (2 loaded threads)
  faster (``benchmarks/README.md``). The logits differ by fp32 rounding of the other
  summation order (~1e-6 relative), so a sample on a near-tie may differ from
  ``generate``'s. None (default): on where it pays and is exact up to rounding: a bias-free
  ``nn.Linear`` head of >= 8192 rows, fp32, on CPU, plain tensors (not FSDP's), no logit
  soft-capping or scaling in the config.
- **Compiled steps** (``compile_decode``, own loop only, default off). The KV-cache steps of
  at most ``compile_max_rows`` live rows run through ``torch.compile(model, dynamic=True)``
  (the weights stay graph inputs, so updates apply); on small batches of a small model,
  where a step is mostly eager per-op overhead, an engine call takes 0.56-0.74x the time
  (``tiny``, 2-8 rows); with many rows and a long cache the compiled step is slower, hence
  the row cap. The first calls compile (a graph for 2+ rows, one for 1 row).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from salvage.distributed import check_gathered
from salvage.lm import pad_left, response_logprobs
from salvage.progress import stage
from salvage.rollout.config import DEFAULT_GENERATE_TIMEOUT_S, EngineConfig, call_settings
from salvage.rollout.hf_decode import (
    TALL_HEAD_MIN_ROWS,
    HeadSwap,
    _sampled_logprobs,
    _TallHead,
    decode,
    nucleus_filter,
    tall_head_fits,
)
from salvage.types import Sample

DECODE_LOOPS = ("own", "generate")


def _mix_seed(seed: int, chunk: int) -> int:
    return (seed * 1_000_003 + chunk * 7_919 + 17) % (2**63 - 1)


class HFEngine:
    """Samples the live policy module (our decode loop or ``generate``); holds a reference."""

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any, frozen: bool = False
    ) -> HFEngine:
        """Built from ``engine.*`` settings (``frozen`` needs nothing here: no copy to sync)."""
        return cls(
            model,
            tokenizer,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=cfg.stop,
            batch_size=cfg.batch_size,
            logprob_batch_size=cfg.logprob_batch_size,
            recompute_logprobs=cfg.hf_recompute_logprobs,
            decode_loop=cfg.hf_decode_loop,
            tall_head=cfg.hf_tall_head,
            compile_decode=cfg.hf_compile_decode,
            compile_max_rows=cfg.hf_compile_max_rows,
            generate_timeout_s=cfg.generate_timeout_s,
        )

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] = (),
        batch_size: int = 64,
        logprob_batch_size: int = 8,
        recompute_logprobs: bool | None = None,
        decode_loop: str = "own",
        tall_head: bool | None = None,
        compile_decode: bool = False,
        compile_max_rows: int = 8,
        generate_timeout_s: float | None = DEFAULT_GENERATE_TIMEOUT_S,
    ) -> None:
        """Args:
        model: the live causal LM to sample (a ``transformers`` model).
        tokenizer: its tokenizer (pad / eos ids, stop strings).
        temperature: sampling temperature (0: greedy).
        top_p: nucleus sampling mass (1: off).
        max_new_tokens: cap on generated tokens per sequence.
        stop: stop strings: a sequence ends once its text contains one (kept).
        batch_size: sequences decoded together (one seeded chunk).
        logprob_batch_size: sequences per forward of the recomputed log-prob pass.
        recompute_logprobs: behaviour log-probs from a separate teacher-forced pass (exact
            first ratio 1) instead of from the sampler's logits (fp32 rounding only); None:
            recompute only under reduced precision (bf16 / fp16 weights or autocast).
        decode_loop: ``own`` (prefill + KV-cache steps, ended rows dropped; default) or
            ``generate`` (``transformers`` ``generate``, the previous path).
        tall_head: own loop: the LM head as ``W @ h.T`` (faster on CPU for a vocabulary-tall
            head; fp32 rounding only); None: where ``tall_head_fits`` the model.
        compile_decode: own loop: the KV-cache steps run through ``torch.compile`` of the
            model (inductor, dynamic shapes, weights read at run time so updates apply);
            the first calls compile.
        compile_max_rows: compiled steps only while at most this many rows are live
            (larger steps: eager).
        generate_timeout_s: wall-clock limit of one call made through
            ``generate_with_retry`` (None: none).
        """
        if decode_loop not in DECODE_LOOPS:
            raise ValueError(
                f"engine decode_loop must be one of {DECODE_LOOPS}, got {decode_loop!r}"
            )
        if temperature < 0:
            raise ValueError(f"engine temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"engine top_p must be in (0, 1], got {top_p}")
        if max_new_tokens < 1:
            raise ValueError(f"engine max_new_tokens must be >= 1, got {max_new_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.batch_size = batch_size
        self.logprob_batch_size = logprob_batch_size
        self.recompute_logprobs = recompute_logprobs
        self.decode_loop = decode_loop
        self.tall_head = tall_head
        self.compile_decode = compile_decode
        self.compile_max_rows = compile_max_rows
        self.generate_timeout_s = generate_timeout_s
        if compile_decode and decode_loop != "own":
            raise ValueError("engine hf_compile_decode=true needs hf_decode_loop='own'")
        self._compiled: Any = None
        self._swap: HeadSwap | None = None
        self.calls = 0
        self.last_timings: dict[str, float] = {}
        self._loop_timings: dict[str, float] = {}

    def prepare(self) -> None:
        """Nothing to do: it samples the live module itself."""

    def release(self) -> None:
        """Nothing to do: it holds no memory of its own."""

    def rebuild(self) -> None:
        """Drop what the engine built (the compiled decode step, the head swap) after an
        error inside a call; the live model's LM head is put back if a call was cut off
        while the tall head was in place. The next call builds them anew."""
        model: Any = self.model  # a transformers model
        head = model.get_output_embeddings()
        if isinstance(head, _TallHead):
            model.set_output_embeddings(head.head)
        self._compiled = None
        self._swap = None
        self._loop_timings = {}

    def close(self) -> None:
        """Nothing to free: it holds a reference to the live model only."""

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def eos_ids(self) -> set[int]:
        ids = {int(self.tokenizer.eos_token_id)}
        gen_cfg = getattr(self.model, "generation_config", None)
        extra = getattr(gen_cfg, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(int(e) for e in extra)
        return ids

    def recomputes(self, device: torch.device) -> bool:
        """Whether a call recomputes the behaviour log-probs: the switch, or when unset,
        under reduced precision (weights not fp32, or autocast on ``device``)."""
        if self.recompute_logprobs is not None:
            return self.recompute_logprobs
        low = next(self.model.parameters()).dtype != torch.float32
        return low or torch.is_autocast_enabled(device.type)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        *,
        seed: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        stop: Sequence[str] | None = None,
    ) -> list[list[Sample]]:
        seed, temperature, top_p, max_new, stop = call_settings(
            self, seed, temperature, top_p, max_new_tokens, stop
        )

        t0 = time.perf_counter()
        self._loop_timings = {}
        flat = [list(p) for p in prompts for _ in range(n)]
        check_gathered(self.model, "HFEngine.generate")
        device = next(self.model.parameters()).device
        recompute = self.recomputes(device)
        was_training = self.model.training
        self.model.eval()
        try:
            samples = self._sample(flat, device, seed, temperature, top_p, max_new, stop, recompute)
        finally:
            self.model.train(was_training)
        t1 = time.perf_counter()
        if recompute:
            self._recompute(samples, temperature)
        self.last_timings = {
            "sample_s": t1 - t0,
            "logprob_s": time.perf_counter() - t1,
            **self._loop_timings,
        }
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _sample(
        self,
        flat: list[list[int]],
        device: torch.device,
        seed: int,
        temperature: float,
        top_p: float,
        max_new: int,
        stop: tuple[str, ...],
        recompute: bool,
    ) -> list[Sample]:
        """Every prompt row sampled, in seeded chunks of ``batch_size`` rows."""
        samples: list[Sample] = []
        bar_ctx = stage("generate", total=len(flat), unit="seq")
        bar = bar_ctx.__enter__()
        try:
            for chunk, start in enumerate(range(0, len(flat), self.batch_size)):
                part = flat[start : start + self.batch_size]
                cseed = _mix_seed(seed, chunk)
                ids, mask = pad_left(part, self.pad_id, device)
                if self.decode_loop == "own":
                    gens, lps = self._decode_own(
                        ids, mask, max_new, temperature, top_p, stop, cseed
                    )
                else:
                    gens, lps = self._decode_generate(
                        ids, mask, max_new, temperature, top_p, stop, cseed, recompute
                    )
                for prompt, gen, lp in zip(part, gens, lps, strict=True):
                    s = self._finish(prompt, gen, stop, max_new, cseed)
                    s.logprobs = lp[: len(s.response_ids)]
                    samples.append(s)
                bar.advance(len(part))
        finally:
            bar_ctx.__exit__(None, None, None)
        return samples

    def _recompute(self, samples: list[Sample], temperature: float) -> None:
        """The behaviour log-probs by a teacher-forced pass at the sampling temperature."""
        rec = response_logprobs(
            self.model,
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            self.pad_id,
            temperature=temperature if temperature > 0 else 1.0,
            batch_size=self.logprob_batch_size,
        )
        for s, lp in zip(samples, rec, strict=True):
            s.logprobs = lp

    def _decode_own(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        temperature: float,
        top_p: float,
        stop: tuple[str, ...],
        cseed: int,
    ) -> tuple[list[list[int]], list[list[float]]]:
        gen = torch.Generator(device=ids.device)
        gen.manual_seed(cseed)

        def ended(row: int, toks: list[int]) -> bool:
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            return any(s in text for s in stop)

        tall = tall_head_fits(self.model) if self.tall_head is None else self.tall_head
        if self.compile_decode and self._compiled is None:
            if any(type(p.data) is not torch.Tensor for p in self.model.parameters()):
                raise ValueError(
                    "engine.hf_compile_decode=true needs plain weights; this model's are "
                    "sharded (FSDP) or another tensor subclass: set it false"
                )
            self._compiled = torch.compile(self.model, dynamic=True)
        if self._swap is None or self._swap.on != tall:
            self._swap = HeadSwap(self.model, tall)
        with self._swap:
            return decode(
                self.model,
                ids,
                mask,
                max_new=max_new,
                temperature=temperature,
                top_p=top_p,
                eos_ids=self.eos_ids,
                pad_id=self.pad_id,
                generator=gen,
                ended=ended if stop else None,
                timings=self._loop_timings,
                runner=self._compiled,
                runner_max_rows=self.compile_max_rows,
            )

    def _decode_generate(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor,
        max_new: int,
        temperature: float,
        top_p: float,
        stop: tuple[str, ...],
        cseed: int,
        recompute: bool,
    ) -> tuple[list[list[int]], list[list[float]]]:
        kwargs: dict[str, Any] = dict(
            max_new_tokens=max_new,
            pad_token_id=self.pad_id,
            eos_token_id=sorted(self.eos_ids),
        )
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if stop:
            kwargs.update(stop_strings=list(stop), tokenizer=self.tokenizer)
        keep_logits = not recompute
        if keep_logits:
            kwargs.update(return_dict_in_generate=True, output_logits=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cseed)
            lm: Any = self.model  # a transformers causal LM (``generate``)
            out = lm.generate(input_ids=ids, attention_mask=mask, **kwargs)
        seqs = out.sequences if keep_logits else out
        new = seqs[:, ids.shape[1] :]
        if not keep_logits:
            return new.tolist(), [[] for _ in range(new.shape[0])]
        cols = [
            _sampled_logprobs(lg.float(), new[:, t], temperature) for t, lg in enumerate(out.logits)
        ]
        lp = torch.stack(cols, dim=1) if cols else new.new_zeros(new.shape[0], 0).float()
        return new.tolist(), lp.tolist()

    def _finish(
        self, prompt: list[int], gen: list[int], stop: tuple[str, ...], max_new: int, seed: int
    ) -> Sample:
        """Cut a generated row at its end: eos (kept) or the token completing a stop string."""
        eos = self.eos_ids
        end = len(gen)
        reason = "length"
        for i, t in enumerate(gen):
            if t in eos:
                end, reason = i + 1, "stop"
                break
        ids = gen[:end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop:
            hits = [(text.find(s), s) for s in stop if s in text]
            if hits:
                pos, s = min(hits)
                cut_chars = pos + len(s)
                # fewest tokens whose decoded text contains the stop string
                lo, hi = 1, len(ids)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if len(self.tokenizer.decode(ids[:mid], skip_special_tokens=True)) >= cut_chars:
                        hi = mid
                    else:
                        lo = mid + 1
                ids = ids[:lo]
                text = text[:cut_chars]
                reason = "stop"
        if reason == "length" and len(ids) < max_new:
            reason = "stop"  # generate ended early through a stopping criterion
        return Sample(
            prompt_ids=prompt,
            response_ids=ids,
            text=text,
            logprobs=[],
            finish_reason=reason,
            seed=seed,
        )


__all__ = [
    "DECODE_LOOPS",
    "TALL_HEAD_MIN_ROWS",
    "HFEngine",
    "HeadSwap",
    "decode",
    "nucleus_filter",
    "tall_head_fits",
]
