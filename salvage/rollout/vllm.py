"""Rollout engine on vLLM (extra ``gpu``; imported lazily): colocated with training.

``engine.backend: vllm`` picks it; the HF engine stays the CPU path. One ``vllm.LLM``
per policy lives in the trainer's process (GRAFT builds two; a VH-GPO LM teacher gets its
own through ``teacher.engine``), on the same GPU as the training shard:

- **Memory.** Built with ``enable_sleep_mode``; after every ``generate`` it sleeps
  (level 1: weights to CPU, KV cache freed; level 2: both freed) so training has the
  memory, and wakes before the next one.
- **Weights.** After every update the trained policy's parameters are streamed into the
  engine one tensor at a time (``model.load_weights``): a sharded (FSDP2) parameter is
  all-gathered alone (``DTensor.full_tensor``), handed over and freed, so no rank ever
  builds a second full copy of the model besides vLLM's own. Every rank calls
  ``prepare()`` at the start of each rollout phase (the per-tensor all-gathers are
  collectives), which syncs when the policy's version changed.
- **Sampling.** n samples per prompt, seeds, temperature / top-p / max tokens, stop
  strings (kept in the text, like the HF engine), token ids in and out.
- **Log-probs.** By default recomputed with the training policy at the sampling
  temperature (``recompute_logprobs``: exactly what the update's ratio divides by, so
  the first ratio is 1, as with the HF engine); otherwise vLLM's own sampled-token
  log-probs after temperature (``logprobs_mode="processed_logprobs"``).

Status: this path is type-checked and its tests skip without CUDA and vllm; it has not
been run on a GPU in this project yet (no GPU was available to the sessions that wrote it).
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from salvage.lm import response_logprobs
from salvage.rollout.config import call_settings
from salvage.types import Sample

log = logging.getLogger(__name__)


def vllm_available() -> tuple[bool, str]:
    """Whether this process can run the vLLM engine, and if not, why."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (vLLM needs a GPU)"
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False, "vllm is not installed (pip install 'salvage[gpu]')"
    return True, ""


def iter_full_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) one parameter at a time; sharded ones all-gathered alone.

    Names are the HF checkpoint names vLLM's ``load_weights`` expects (FSDP2 keeps the
    module's own names). Every rank must iterate in step (each ``full_tensor`` is a
    collective).
    """
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t
    for name, b in model.named_buffers():
        if name.endswith("inv_freq"):  # rotary tables: vLLM builds its own
            continue
        yield name, b.detach()


def model_version(model: torch.nn.Module) -> int:
    """The policy's update counter (GRPOModule bumps ``_salvage_version`` after each update)."""
    return int(getattr(model, "_salvage_version", 0))


class VLLMEngine:
    """``RolloutEngine`` on a colocated ``vllm.LLM`` holding a copy of the live policy."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        stop: Sequence[str] = (),
        logprob_batch_size: int = 8,
        gpu_memory_utilization: float = 0.3,
        sleep_level: int = 1,
        recompute_logprobs: bool = True,
        max_model_len: int | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        frozen: bool = False,
    ) -> None:
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"engine.backend=vllm: {why}")
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"engine.vllm_sleep_level must be 0, 1 or 2, got {sleep_level}")
        from vllm import LLM

        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.logprob_batch_size = logprob_batch_size
        self.sleep_level = sleep_level
        self.recompute_logprobs = recompute_logprobs
        self.frozen = frozen
        if frozen and sleep_level == 2:
            self.sleep_level = 1  # a frozen model has nothing to reload its weights from
        self._calls = 0
        self.last_timings: dict[str, float] = {}
        source = self._source(model, tokenizer)
        kwargs: dict[str, Any] = dict(
            model=source,
            tokenizer=source,
            dtype=dtype,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_level > 0,
            enable_prefix_caching=True,
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # one engine per training rank, inside the trainer's processes (TRL's "colocate")
            kwargs["distributed_executor_backend"] = "external_launcher"
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if not recompute_logprobs:
            kwargs["logprobs_mode"] = "processed_logprobs"
        self.llm = LLM(**kwargs)
        self._synced = model_version(model)
        self._asleep = False
        self._weights_lost = False
        self.release()

    # -- weights -----------------------------------------------------------------
    @staticmethod
    def _source(model: torch.nn.Module, tokenizer: Any) -> str:
        """A path or hub id vLLM can build the architecture from (built-ins are saved once)."""
        name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        if name and (Path(name).is_dir() or "/" in name):
            return name
        out = Path(tempfile.mkdtemp(prefix="salvage-vllm-"))
        state = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()
        }
        save: Any = model.save_pretrained  # an HF PreTrainedModel
        save(out, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return str(out)

    def _runner_model(self) -> Any:
        """The ``nn.Module`` inside the in-process vLLM worker (layouts differ across versions)."""
        ex = self.llm.llm_engine.model_executor
        worker = getattr(ex, "driver_worker", None)
        for path in ("worker.model_runner.model", "model_runner.model"):
            obj: Any = worker
            for part in path.split("."):
                obj = getattr(obj, part, None)
            if obj is not None:
                return obj
        raise RuntimeError(
            "VLLMEngine: cannot reach the vLLM worker's model to load weights; "
            "this vLLM version is not supported (set VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )

    def prepare(self) -> None:
        """Wake the engine and sync the policy's weights if they changed or were discarded.

        Called by every rank at the start of a rollout phase (sharded parameters are
        gathered one at a time, each a collective)."""
        self._wake()
        if self.frozen or (model_version(self.model) == self._synced and not self._weights_lost):
            return
        runner = self._runner_model()
        t0 = time.perf_counter()
        for name, tensor in iter_full_parameters(self.model):
            runner.load_weights(weights=[(name, tensor)])
            del tensor
        self.llm.reset_prefix_cache()
        self._synced = model_version(self.model)
        self._weights_lost = False
        self.last_timings["sync_s"] = time.perf_counter() - t0

    def _wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def release(self) -> None:
        """Free the engine's GPU memory for training (end of a rollout phase)."""
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = True
            self._weights_lost = self.sleep_level == 2

    # -- sampling ----------------------------------------------------------------
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
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seed, temperature, top_p, max_new, stop = call_settings(
            self, seed, temperature, top_p, max_new_tokens, stop
        )
        if self._asleep or model_version(self.model) != self._synced:
            self.prepare()  # outside a phase (or a gathered policy): no collectives needed
        t0 = time.perf_counter()
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new,
                stop=list(stop) or None,
                include_stop_str_in_output=True,
                logprobs=0,
                seed=(seed * 1_000_003 + i) % (2**31 - 1),
            )
            for i in range(len(prompts))
        ]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
        )
        if self.frozen:
            self.release()  # a teacher sleeps between its calls
        t1 = time.perf_counter()
        groups: list[list[Sample]] = []
        for prompt, out in zip(prompts, outs, strict=True):
            group = []
            for c in out.outputs:
                lps = [float(next(iter(d.values())).logprob) for d in (c.logprobs or [])]
                group.append(
                    Sample(
                        prompt_ids=list(prompt),
                        response_ids=list(c.token_ids),
                        text=c.text,
                        logprobs=lps,
                        finish_reason="length" if c.finish_reason == "length" else "stop",
                        seed=seed,
                    )
                )
            groups.append(group)
        if self.recompute_logprobs:
            flat = [s for g in groups for s in g]
            exact = response_logprobs(
                self.model,
                [s.prompt_ids for s in flat],
                [s.response_ids for s in flat],
                int(self.tokenizer.pad_token_id),
                temperature=temperature if temperature > 0 else 1.0,
                batch_size=self.logprob_batch_size,
            )
            for s, lp in zip(flat, exact, strict=True):
                s.logprobs = lp
        self.last_timings.update(sample_s=t1 - t0, logprob_s=time.perf_counter() - t1)
        return groups
