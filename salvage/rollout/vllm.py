"""Rollout engine on vLLM (extra ``gpu``; imported lazily): colocated with training.

``engine.backend: vllm`` picks it; the HF engine stays the CPU path. The engines live in
the trainer's process, on the same GPU as the training shard. Supported: vLLM 0.27 to
0.33 (``vllm>=0.27,<0.34``); **this path has not run on a GPU in this project yet**:
every vLLM call below was checked by reading vLLM's source, not by running it.

- **In process.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set before the first ``LLM()``
  (a user setting of 1 is refused): only then does the engine core, its executor and the
  worker holding the model live in this process.
- **Memory.** At most one engine per process uses vLLM's sleep mode (its allocator is a
  per-process singleton): the first trainable policy's. It sleeps after every rollout
  phase (level 1: weights to CPU, KV cache freed; level 2: both freed, weights re-synced)
  and wakes before the next. Every other engine (GRAFT's second policy, an LM teacher)
  runs at sleep level 0 inside its own ``gpu_memory_utilization``. Engines for the same
  live model with the same engine settings share one ``LLM`` (evaluation reuses the
  training engine with its own sampling settings).
- **Weights.** A trainable policy's engine syncs at its first ``prepare()`` (vLLM loaded
  the checkpoint on disk, not the live model) and whenever the policy's version changed
  or a level-2 sleep discarded the weights. The parameters are streamed into the worker's
  model through ``LLM.apply_model`` (one ``load_weights`` call consuming a generator): a
  sharded (FSDP2) parameter is all-gathered alone (``DTensor.full_tensor``), copied and
  freed, so no rank builds a second full copy besides vLLM's own. Every rank calls
  ``prepare()`` at the start of each rollout phase (the all-gathers are collectives).
- **Ranks.** With more than one training rank, one engine per rank joins the live
  process group through vLLM's ``external_launcher`` (``RANK`` / ``WORLD_SIZE`` set from
  the group, ``LOCAL_RANK`` from the rank's CUDA device); with one rank, vLLM's in-process executor.
- **Sampling.** n samples per prompt; request seeds spaced by n (vLLM seeds sample j
  with ``seed + j``); greedy asks for one sample and copies it n times; temperature in
  [0, 2] (not in (0, 0.01)); stop strings kept in the text; token ids in and out.
- **Log-probs.** By default recomputed with the training policy at the sampling
  temperature (``recompute_logprobs``: exactly what the update's ratio divides by);
  otherwise vLLM's sampled-token log-probs after temperature
  (``logprobs_mode="processed_logprobs"``), refused with top_p < 1 (renormalised over
  the nucleus, so the first ratio would not be 1).
- **RNG.** Building an engine reseeds Python, NumPy, torch and CUDA; the states are put
  back after every vLLM call that may touch them.

vLLM source read (file:line in 0.33.0 / 0.27.0, both under ``vllm/``):

- ``envs.py:1444`` / same key: ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to 1, read as
  ``bool(int(...))``; ``v1/engine/core.py:248`` / ``:247`` ``enable_envs_cache()`` freezes
  all variables once an engine core exists (so it is set before the first ``LLM()``).
- ``v1/engine/llm_engine.py:170,186`` / ``:157,174``: multiprocess mode from that variable;
  ``:138`` / ``:125`` ``model_executor`` exists only in process.
- ``entrypoints/llm.py:604`` / ``:595`` ``LLM.apply_model(func)`` ->
  ``v1/engine/llm_engine.py:503`` / ``:435`` ``collective_rpc("apply_model", (func,))`` ->
  ``v1/executor/uniproc_executor.py`` ``collective_rpc`` runs it on the in-process
  ``WorkerWrapperBase`` (``v1/worker/worker_base.py:370`` forwards to the worker) ->
  ``worker_base.py:165`` / ``:128`` ``fn(self.get_model())`` ->
  ``v1/worker/gpu_model_runner.py:3078`` / ``:3343`` ``get_model()`` (the CUDA-graph
  wrapper unwrapped). In process the function is called directly, not pickled.
  ``model_executor/models/qwen2.py:519`` ``load_weights(weights: Iterable[(name, tensor)])``
  returns the loaded names (HF names; stacked q/k/v and gate/up handled there).
- ``entrypoints/llm.py:839`` / ``:799`` ``sleep(level)``: level 0 there means "pause
  scheduling", so an engine at our level 0 never calls it; ``:872`` / ``:824``
  ``wake_up(tags=None)``; ``:832`` / ``:792`` ``reset_prefix_cache()``.
- ``v1/worker/gpu_worker.py:413-416`` / ``:273-275``: a second sleep-mode engine fails with
  "CuMem allocator can only be used for one instance per process";
  ``device_allocator/cumem.py:112-127`` the allocator singleton; its ``sleep`` (``:233``)
  offloads or frees every allocation in the pool, whichever engine made it.
- ``v1/worker/gpu_worker.py:517,1094`` / ``:388,820`` ``set_random_seed(seed)`` ->
  ``utils/torch_utils.py:528`` / ``:404`` seeds random, numpy, torch and all CUDA devices.
- ``v1/executor/uniproc_executor.py:77-86`` / ``:71-75``: the one-process executor
  creates a 1-process torch.distributed group; ``:186-196`` / ``:175-185`` the external
  launcher reads ``os.environ["RANK"]`` and ``["LOCAL_RANK"]`` and asserts
  multiprocessing off; ``distributed/parallel_state.py:1928`` joins an initialised group
  instead of creating one; ``v1/worker/gpu_worker.py:454,491`` the engine's device is
  ``cuda:LOCAL_RANK`` for the external launcher.
- ``sampling_params.py:668`` / ``:559`` temperature > 2 refused; ``:560`` / ``:458``
  0 < temperature < 0.01 raised to 0.01; ``:615-620,769`` / ``:643`` n > 1 refused at
  temperature 0; ``v1/engine/parallel_sampling.py:80`` (both) child j seeded ``seed + j``.
- ``v1/sample/ops/topk_topp_sampler.py:303-308`` / ``:143-148`` ``processed_logprobs`` is
  ``log_softmax`` after ``apply_top_k_top_p`` (top-p renormalised); 0.33's model runner V2
  (its default when Triton is present, ``config/vllm.py:731-766``) does the same
  (``v1/worker/gpu/sample/sampler.py:173,347``) and its ``get_model()``
  (``v1/worker/gpu/model_runner.py:568``) returns the model itself.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from salvage.errors import ConfigError
from salvage.lm import response_logprobs
from salvage.rollout.config import (
    DEFAULT_GENERATE_TIMEOUT_S,
    EngineConfig,
    call_settings,
)
from salvage.rollout.vllm_backend import (  # noqa: F401 - re-exported
    _Backend,
    _build_backend,
    _new_llm,
    _total_memory_bytes,
)
from salvage.rollout.vllm_rules import (
    REGISTRY,
    check_vllm_sampling,
    preserved_rng,
    request_seeds,
    samples_to_send,
)
from salvage.rollout.vllm_support import (  # noqa: F401 - re-exported
    SOURCE_PREFIX,
    TempCheckpoint,
    _source,
    import_vllm,
    iter_full_parameters,
    platform_facts,
    sweep_stale_checkpoints,
    vllm_available,
)
from salvage.types import Sample

log = logging.getLogger(__name__)


class VLLMEngine:
    """``RolloutEngine`` on a colocated ``vllm.LLM`` holding a copy of the live policy."""

    @classmethod
    def from_config(
        cls, cfg: EngineConfig, model: torch.nn.Module, tokenizer: Any, frozen: bool = False
    ) -> VLLMEngine:
        """Built from ``engine.*`` settings; ``frozen``: a teacher, never re-synced."""
        return cls(
            model,
            tokenizer,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            stop=cfg.stop,
            logprob_batch_size=cfg.logprob_batch_size,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
            sleep_level=cfg.vllm_sleep_level,
            recompute_logprobs=cfg.vllm_recompute_logprobs,
            max_model_len=cfg.vllm_max_model_len,
            dtype=cfg.vllm_dtype,
            enforce_eager=cfg.vllm_enforce_eager,
            cpu_kvcache_gb=cfg.vllm_cpu_kvcache_gb,
            generate_timeout_s=cfg.generate_timeout_s,
            frozen=frozen,
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
        logprob_batch_size: int = 8,
        gpu_memory_utilization: float = 0.3,
        sleep_level: int = 1,
        recompute_logprobs: bool = True,
        max_model_len: int | None = None,
        dtype: str = "bfloat16",
        seed: int = 0,
        enforce_eager: bool | None = None,
        cpu_kvcache_gb: int | None = None,
        generate_timeout_s: float | None = DEFAULT_GENERATE_TIMEOUT_S,
        frozen: bool = False,
    ) -> None:
        ok, why = vllm_available()
        if not ok:
            raise RuntimeError(f"engine.backend=vllm: {why}")
        if sleep_level not in (0, 1, 2):
            raise ConfigError(f"engine.vllm_sleep_level must be 0, 1 or 2, got {sleep_level}")
        check_vllm_sampling(temperature, top_p, recompute_logprobs)
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.logprob_batch_size = logprob_batch_size
        self.recompute_logprobs = recompute_logprobs
        self.frozen = frozen
        self.generate_timeout_s = generate_timeout_s
        if frozen and sleep_level == 2:
            sleep_level = 1  # a frozen model has nothing to reload its weights from
        self.calls = 0
        self.last_timings: dict[str, float] = {}
        key: tuple[Any, ...] = (gpu_memory_utilization, sleep_level, recompute_logprobs)
        key += (max_model_len, dtype, enforce_eager, cpu_kvcache_gb, frozen)
        found = REGISTRY.find(model, key)
        self.backend: _Backend = found or _build_backend(
            model,
            tokenizer,
            key=key,
            sleep_level=sleep_level,
            frozen=frozen,
            gpu_memory_utilization=gpu_memory_utilization,
            recompute_logprobs=recompute_logprobs,
            max_model_len=max_model_len,
            dtype=dtype,
            seed=seed,
            enforce_eager=enforce_eager,
            cpu_kvcache_gb=cpu_kvcache_gb,
        )
        self.backend.users += 1
        self._closed = False

    @property
    def llm(self) -> Any:
        return self.backend.llm

    @property
    def sleep_level(self) -> int:
        """The sleep level this engine got (0 unless it holds the process's sleep mode)."""
        return self.backend.sleep_level

    # -- weights -----------------------------------------------------------------
    def prepare(self) -> None:
        """Wake the engine and sync the policy's weights if needed (always the first time).

        Called by every rank at the start of a rollout phase (sharded parameters are
        gathered one at a time, each a collective)."""
        self.backend.wake()
        if self.backend.needs_sync():
            self.backend.load_weights()
            self.last_timings["sync_s"] = self.backend.last_sync_s

    def release(self) -> None:
        """Free the engine's GPU memory for training (end of a rollout phase)."""
        self.backend.release()

    def rebuild(self) -> None:
        """After an error inside vLLM: dispose of the ``LLM`` and build it anew (its engines
        that share it see the new one); the next call syncs the live weights."""
        self.backend.rebuild()

    def close(self) -> None:
        """This engine is done; the last engine of a shared ``LLM`` shuts it down and removes
        its temporary checkpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.backend.users -= 1
        if self.backend.users <= 0:
            self.backend.close()

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
        from vllm.inputs import TokensPrompt

        seed, temperature, top_p, max_new, stop = call_settings(
            self, seed, temperature, top_p, max_new_tokens, stop
        )
        check_vllm_sampling(temperature, top_p, self.recompute_logprobs)
        if self.backend.asleep or self.backend.needs_sync():
            self.prepare()  # outside a phase (or a gathered policy): no collectives needed
        t0 = time.perf_counter()
        params = self._sampling_params(len(prompts), n, seed, temperature, top_p, max_new, stop)
        with preserved_rng():
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False
            )
        if self.frozen:
            self.release()  # a teacher sleeps between its calls (when it holds sleep mode)
        t1 = time.perf_counter()
        groups = [
            _prompt_samples(prompt, out, n, seed) for prompt, out in zip(prompts, outs, strict=True)
        ]
        if self.recompute_logprobs:
            self._recompute_logprobs(groups, temperature)
        self.last_timings.update(sample_s=t1 - t0, logprob_s=time.perf_counter() - t1)
        return groups

    def _sampling_params(
        self,
        n_prompts: int,
        n: int,
        seed: int,
        temperature: float,
        top_p: float,
        max_new: int,
        stop: Sequence[str],
    ) -> list[Any]:
        """One ``SamplingParams`` per prompt: its seed, its samples to send, the settings."""
        from vllm import SamplingParams

        n_send = samples_to_send(temperature, n)
        return [
            SamplingParams(
                n=n_send,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new,
                stop=list(stop) or None,
                include_stop_str_in_output=True,
                logprobs=None if self.recompute_logprobs else 0,  # 0: the sampled token's
                seed=s,
            )
            for s in request_seeds(seed, n_prompts, n_send)
        ]

    def _recompute_logprobs(self, groups: list[list[Sample]], temperature: float) -> None:
        """Replace every sample's log-probs by the training policy's at the temperature."""
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


def _prompt_samples(prompt: Sequence[int], out: Any, n: int, seed: int) -> list[Sample]:
    """One prompt's ``n`` samples from its vLLM output (greedy: its one sample, copied)."""
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
    group += [copy.deepcopy(group[0]) for _ in range(n - len(group))]  # greedy copies
    return group
