"""Rollout engine on ``transformers.generate``: the CPU / test path.

Batched sampling with temperature, top-p, max new tokens and stop strings; ``n`` samples
per prompt; seeded (a forked RNG, so the caller's global RNG is untouched). The
log-probs returned are recomputed by a teacher-forced forward pass of the behaviour
policy on the right-padded prompt + response, at the sampling temperature — the same
computation the update uses for the current policy, so the first ratio is exactly 1.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from salvage.distributed import check_gathered
from salvage.lm import pad_left, response_logprobs
from salvage.progress import stage
from salvage.rollout.config import EngineConfig, call_settings
from salvage.types import Sample


def _mix_seed(seed: int, chunk: int) -> int:
    return (seed * 1_000_003 + chunk * 7_919 + 17) % (2**63 - 1)


class HFEngine:
    """Samples with ``model.generate``. Holds a reference to the live policy module."""

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
    ) -> None:
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
        self.calls = 0
        self.last_timings: dict[str, float] = {}

    def prepare(self) -> None:
        """Nothing to do: it samples the live module itself."""

    def release(self) -> None:
        """Nothing to do: it holds no memory of its own."""

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
        flat = [list(p) for p in prompts for _ in range(n)]
        samples: list[Sample] = []
        check_gathered(self.model, "HFEngine.generate")
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        bar_ctx = stage("generate", total=len(flat), unit="seq")
        bar = bar_ctx.__enter__()
        try:
            for chunk, start in enumerate(range(0, len(flat), self.batch_size)):
                part = flat[start : start + self.batch_size]
                cseed = _mix_seed(seed, chunk)
                ids, mask = pad_left(part, self.pad_id, device)
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
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(cseed)
                    lm: Any = self.model  # a transformers causal LM (``generate``)
                    out = lm.generate(input_ids=ids, attention_mask=mask, **kwargs)
                new = out[:, ids.shape[1] :].tolist()
                for prompt, gen in zip(part, new, strict=True):
                    samples.append(self._finish(prompt, gen, stop, max_new, cseed))
                bar.advance(len(part))
        finally:
            bar_ctx.__exit__(None, None, None)
            self.model.train(was_training)

        t1 = time.perf_counter()
        lps = response_logprobs(
            self.model,
            [s.prompt_ids for s in samples],
            [s.response_ids for s in samples],
            self.pad_id,
            temperature=temperature if temperature > 0 else 1.0,
            batch_size=self.logprob_batch_size,
        )
        for s, lp in zip(samples, lps, strict=True):
            s.logprobs = lp
        self.last_timings = {"sample_s": t1 - t0, "logprob_s": time.perf_counter() - t1}
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

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
