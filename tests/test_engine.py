"""HF rollout engine: log-probs, seeding, n samples, stop strings, finish reasons; faults
(an error, a hang, a signal inside a call): rebuilt and retried once, or stopped, never hung."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from salvage.models import PolicySpec, load_policy
from salvage.rollout.config import EngineConfig
from salvage.rollout.hf import HFEngine


def _prompts(tok):
    texts = ["What is 2 + 3?", "Compute 7 * 8 - 8 and output the final answer within \\boxed{}."]
    out = []
    for t in texts:
        s = tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        out.append(tok(s, add_special_tokens=False)["input_ids"])
    assert len(out[0]) != len(out[1])  # padding is exercised
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_teacher_forced_forward(tiny, temperature):
    model, tok = tiny
    eng = HFEngine(model, tok, temperature=temperature, max_new_tokens=12)
    prompts = _prompts(tok)
    out = eng.generate(prompts, n=3, seed=11)
    assert [len(g) for g in out] == [3, 3]
    model.eval()
    with torch.no_grad():
        for p, group in zip(prompts, out, strict=True):
            for s in group:
                assert s.prompt_ids == p
                assert len(s.logprobs) == len(s.response_ids) > 0
                ids = torch.tensor([p + s.response_ids])
                logits = model(input_ids=ids).logits[0, :-1].float() / temperature
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
                expected = lp[len(p) - 1 :].tolist()
                assert s.logprobs == pytest.approx(expected, abs=1e-5)
    model.train()


def test_engine_same_seed_same_samples_other_seed_differs(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=10)
    prompts = _prompts(tok)
    a = eng.generate(prompts, n=2, seed=5)
    b = eng.generate(prompts, n=2, seed=5)
    c = eng.generate(prompts, n=2, seed=6)
    ids = lambda out: [s.response_ids for g in out for s in g]  # noqa: E731
    assert ids(a) == ids(b)
    assert ids(a) != ids(c)
    # n samples of one prompt are not all identical (sampling, not greedy)
    assert len({tuple(s.response_ids) for s in a[0]}) > 1


def test_engine_does_not_touch_global_rng(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=4)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    eng.generate(_prompts(tok), n=1, seed=1)
    assert torch.equal(torch.rand(1), before)


def test_engine_length_finish_reason_and_max_tokens(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=5)
    out = eng.generate(_prompts(tok), n=4, seed=3)
    for s in (s for g in out for s in g):
        assert len(s.response_ids) <= 5
        if s.finish_reason == "length":
            assert len(s.response_ids) == 5
        else:
            assert s.finish_reason == "stop"


def test_engine_stop_string_cuts_text_and_tokens(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=40, temperature=1.0)
    prompts = _prompts(tok)
    free = eng.generate(prompts, n=4, seed=9)
    # choose a stop string that occurs in an unconstrained sample: its first character
    # after the first two, so the cut is inside the text
    text = next(s.text for g in free for s in g if len(s.text) > 4)
    stop = text[2:4]
    out = eng.generate(prompts, n=4, seed=9, stop=[stop])
    hit = [s for g in out for s in g if stop in s.text]
    assert hit, "the stop string should occur in at least one sample"
    for s in hit:
        assert s.text.find(stop) == len(s.text) - len(stop)  # cut right after the first hit
        assert s.finish_reason == "stop"
        # the kept tokens decode to at least the cut text, one token fewer does not
        full = tok.decode(s.response_ids, skip_special_tokens=True)
        assert stop in full
        assert stop not in tok.decode(s.response_ids[:-1], skip_special_tokens=True)
        assert len(s.logprobs) == len(s.response_ids)


def test_engine_greedy_is_deterministic_regardless_of_seed(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=6, temperature=0.0)
    a = eng.generate(_prompts(tok), n=1, seed=1)
    b = eng.generate(_prompts(tok), n=1, seed=2)
    assert [s.response_ids for g in a for s in g] == [s.response_ids for g in b for s in g]


def test_engine_rejects_bad_settings(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="top_p"):
        HFEngine(model, tok, top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        HFEngine(model, tok, max_new_tokens=0)


def test_token_logprobs_from_first_position_equal_the_full_pass(tiny):
    from salvage.lm import pad_right, token_logprobs

    model, tok = tiny
    model.eval()
    seqs = [
        tok("what is 3 + 4 ? the answer is 7", add_special_tokens=False)["input_ids"],
        tok("go north then take the coin", add_special_tokens=False)["input_ids"],
    ]
    ids, mask = pad_right(seqs, int(tok.pad_token_id), "cpu")
    with torch.no_grad():
        full = token_logprobs(model, ids, mask, 0.7)
        part = token_logprobs(model, ids, mask, 0.7, first=4)
    assert part.shape == full.shape
    assert torch.allclose(part[:, 4:], full[:, 4:], atol=1e-6)
    assert torch.all(part[:, :4] == 0)


def test_engines_and_policies_implement_the_protocols(tiny):
    """What the stages call is what salvage.types promises (no feature probes)."""
    from salvage.core.agent import AgentFormat
    from salvage.rollout.agent import LMPolicy, OraclePolicy
    from salvage.types import Policy, RolloutEngine

    model, tok = tiny
    eng = HFEngine(model, tok, max_new_tokens=4)
    assert isinstance(eng, RolloutEngine) and eng.model is model
    eng.prepare()  # a rollout phase on an engine that samples the live module: no-ops
    eng.generate(_prompts(tok)[:1], n=1, seed=0)
    eng.release()
    assert eng.calls == 1
    fmt = AgentFormat()
    assert isinstance(LMPolicy(eng, tok, fmt), Policy) and not LMPolicy.needs_oracle
    assert isinstance(OraclePolicy(fmt), Policy) and OraclePolicy.needs_oracle


def _ragged_prompts(tok):
    """Four prompts of four different lengths (left padding of 0 to many tokens)."""
    texts = ["hi", "What is 2 + 3?", "go north then take the coin and eat it", "Compute 7 * 8 - 8."]
    out = []
    for t in texts:
        s = tok.apply_chat_template(
            [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
        )
        out.append(tok(s, add_special_tokens=False)["input_ids"])
    assert len({len(p) for p in out}) == 4
    return out


def _early_eos_tiny():
    """A fresh ``tiny`` whose generation config counts 60 token ids as eos: rows of an
    untrained model then end after a few tokens, at different steps."""
    from salvage.models import PolicySpec, load_policy

    model, tok = load_policy(PolicySpec("tiny"))
    model.generation_config.eos_token_id = [int(tok.eos_token_id), *range(4, 64)]
    return model, tok


@pytest.mark.parametrize(
    ("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.95), (0.0, 1.0)]
)
def test_own_decode_loop_samples_the_same_tokens_as_generate(temperature, top_p):
    """Same seed, same chunking: our loop (rows dropped as they end) and ``generate``
    draw the same tokens, eos-ended rows included (RNG consumed alike)."""
    model, tok = _early_eos_tiny()
    prompts = _ragged_prompts(tok)
    kw = dict(temperature=temperature, top_p=top_p, max_new_tokens=16, batch_size=6)
    own = HFEngine(model, tok, decode_loop="own", **kw).generate(prompts, n=3, seed=21)
    ref = HFEngine(model, tok, decode_loop="generate", **kw).generate(prompts, n=3, seed=21)
    flat = lambda out: [s for g in out for s in g]  # noqa: E731
    lens = [len(s.response_ids) for s in flat(own)]
    if temperature > 0:  # rows end early and at different steps (greedy: none ends)
        assert min(lens) < 16 and len(set(lens)) > 2
    for a, b in zip(flat(own), flat(ref), strict=True):
        assert a.response_ids == b.response_ids
        assert a.finish_reason == b.finish_reason and a.text == b.text
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_own_decode_loop_drops_ended_rows_from_the_batch():
    """The prefill runs each distinct prompt once (4 prompts x 3 samples: 4 rows); after it,
    each decode forward carries only rows still running: in all, one row-forward per
    generated token but the first of each row."""
    model, tok = _early_eos_tiny()
    sizes: list[tuple[int, int]] = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kw: sizes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        out = HFEngine(model, tok, max_new_tokens=16, batch_size=12).generate(
            _ragged_prompts(tok), n=3, seed=21
        )
    finally:
        hook.remove()
    lens = [len(s.response_ids) for g in out for s in g]
    assert sizes[0][0] == 4 and sizes[0][1] > 1  # the prefill: one row per prompt, whole
    steps = sizes[1:]
    assert all(w == 1 for _, w in steps)
    assert sum(b for b, _ in steps) == sum(n - 1 for n in lens) < 12 * 15
    assert [b for b, _ in steps] == sorted((b for b, _ in steps), reverse=True)
    assert len(steps) == max(lens) - 1


@pytest.mark.parametrize("loop", ["own", "generate"])
def test_sampler_logprobs_equal_the_recomputed_pass(loop):
    """Default log-probs (read off the sampler's logits, left-padded KV-cache decode) equal
    the teacher-forced recomputation within 2e-6 on ``tiny`` fp32 (measured max ~1e-6),
    rows of four prompt lengths, T = 0.7 with a nucleus; ``recompute_logprobs=True``
    returns the recomputed pass itself (``response_logprobs``, bit for bit)."""
    from salvage.lm import response_logprobs

    model, tok = _early_eos_tiny()
    prompts = _ragged_prompts(tok)
    kw = dict(temperature=0.7, top_p=0.9, max_new_tokens=20, decode_loop=loop)
    fast = HFEngine(model, tok, **kw).generate(prompts, n=3, seed=5)
    exact = HFEngine(model, tok, recompute_logprobs=True, **kw).generate(prompts, n=3, seed=5)
    a = [s for g in fast for s in g]
    b = [s for g in exact for s in g]
    assert len({len(s.response_ids) for s in a}) > 2
    ref = response_logprobs(
        model,
        [s.prompt_ids for s in b],
        [s.response_ids for s in b],
        int(tok.pad_token_id),
        temperature=0.7,
    )
    for x, y, r in zip(a, b, ref, strict=True):
        assert x.response_ids == y.response_ids
        assert len(x.logprobs) == len(x.response_ids)
        assert y.logprobs == r  # the switch: the old teacher-forced pass, unchanged
        assert x.logprobs == pytest.approx(y.logprobs, abs=2e-6)
    assert any(x.logprobs != y.logprobs for x, y in zip(a, b, strict=True))  # not the same pass


def test_engine_config_decode_switches():
    from salvage.rollout.config import EngineConfig

    with pytest.raises(ValueError, match="hf_decode_loop"):
        EngineConfig(hf_decode_loop="fast")
    cfg = EngineConfig(hf_decode_loop="generate", hf_recompute_logprobs=True)
    model, tok = _early_eos_tiny()
    eng = HFEngine.from_config(cfg, model, tok)
    assert eng.decode_loop == "generate" and eng.recompute_logprobs
    assert HFEngine.from_config(EngineConfig(), model, tok).decode_loop == "own"
    with pytest.raises(ValueError, match="decode_loop"):
        HFEngine(model, tok, decode_loop="hf")


def test_logprobs_are_recomputed_by_default_only_under_reduced_precision():
    """Unset switch: fp32 outside autocast reads the sampler's log-probs; autocast or bf16
    weights recompute them (the two computations round apart there)."""
    model, tok = _early_eos_tiny()
    eng = HFEngine(model, tok, max_new_tokens=4)
    cpu = torch.device("cpu")
    assert eng.recompute_logprobs is None and not eng.recomputes(cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert eng.recomputes(cpu)
    assert not HFEngine(model, tok, recompute_logprobs=False).recomputes(cpu)
    model.to(torch.bfloat16)
    assert eng.recomputes(cpu)
    assert not HFEngine(model, tok, recompute_logprobs=False).recomputes(cpu)


def _tall_vocab_llama(vocab: int = 16384):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tall_head_decodes_the_same_tokens_as_the_linear_head(temperature):
    """The LM head as ``W @ h.T`` (own loop, a 16384-token head): the same tokens and
    log-probs within fp32 rounding; the model's own head never runs, and is back (still tied
    to the embedding) afterwards."""
    from salvage.rollout.hf import HeadSwap, decode, tall_head_fits

    model = _tall_vocab_llama()
    head = model.get_output_embeddings()
    assert tall_head_fits(model)
    assert not tall_head_fits(_early_eos_tiny()[0])  # 500-odd rows: F.linear as before
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 16384, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # one left-padded row
    calls = []
    hook = head.register_forward_hook(lambda *a: calls.append(1))
    out = {}
    try:
        for tall in (False, True):
            calls.clear()
            gen = torch.Generator().manual_seed(7)
            with HeadSwap(model, tall):
                out[tall] = decode(
                    model,
                    ids,
                    mask,
                    max_new=12,
                    temperature=temperature,
                    top_p=1.0,
                    eos_ids=set(),
                    pad_id=0,
                    generator=gen,
                )
            assert (len(calls) == 0) == tall
    finally:
        hook.remove()
    (t0, lp0), (t1, lp1) = out[False], out[True]
    assert t0 == t1
    for a, b in zip(lp0, lp1, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    assert model.get_output_embeddings() is head
    assert head.weight is model.get_input_embeddings().weight


def test_tall_head_needs_a_bias_free_linear_head():
    from salvage.rollout.config import EngineConfig
    from salvage.rollout.hf import HeadSwap, tall_head_fits

    model = _tall_vocab_llama(8192)
    old = model.get_output_embeddings()
    model.set_output_embeddings(torch.nn.Linear(64, 8192, bias=True))
    assert not tall_head_fits(model)
    with pytest.raises(ValueError, match="hf_tall_head"), HeadSwap(model, True):
        pass
    eng = HFEngine.from_config(EngineConfig(hf_tall_head=True), model, _early_eos_tiny()[1])
    assert eng.tall_head is True
    model.set_output_embeddings(old)
    assert tall_head_fits(model)
    assert not tall_head_fits(model.to(torch.bfloat16))


def test_engine_takes_the_tall_head_by_default_where_it_fits():
    model = _tall_vocab_llama()
    tok = _early_eos_tiny()[1]  # its ids fit the 16384-token model
    head = model.get_output_embeddings()
    calls = []
    hook = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        prompts = _ragged_prompts(tok)
        eng = HFEngine(model, tok, max_new_tokens=3)
        eng.generate(prompts, n=1, seed=0)
        assert calls == []  # W @ h.T, the model's own head never ran
        wrapper = eng._swap.tall
        eng.generate(prompts, n=1, seed=1)
        assert eng._swap.tall is wrapper  # the same wrapper again: a compiled step keeps its graph
        assert wrapper is not None and wrapper.head is head
        HFEngine(model, tok, max_new_tokens=3, tall_head=False).generate(prompts, n=1, seed=0)
        assert calls
    finally:
        hook.remove()
    assert model.get_output_embeddings() is head


@pytest.mark.slow  # compiling tiny's two graphs: ~35 s cold on 2 cores
def test_compiled_decode_draws_the_same_tokens_and_follows_weight_updates():
    """``compile_decode``: the KV-cache steps run through ``torch.compile``; the same seed
    gives the same tokens and log-probs (within 1e-4: fused fp32 rounding) as the eager loop, and after
    an in-place weight update (what an optimizer step does) it samples the new weights, not
    those it was compiled with."""
    from torch._dynamo.utils import counters

    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig

    with pytest.raises(ValueError, match="hf_compile_decode"):
        EngineConfig(hf_compile_decode=True, hf_decode_loop="generate")
    model, tok = load_policy(PolicySpec("tiny"))  # its own copy: the weights change below
    model.eval()
    prompts = _prompts(tok)
    eager = HFEngine(model, tok, temperature=1.0, max_new_tokens=8)
    comp = HFEngine.from_config(
        EngineConfig(temperature=1.0, max_new_tokens=8, hf_compile_decode=True), model, tok
    )
    graphs = counters["stats"]["unique_graphs"]
    runs = []
    for _ in range(2):
        a, b = (e.generate(prompts, n=2, seed=5) for e in (eager, comp))
        ta = [s.response_ids for g in a for s in g]
        assert ta == [s.response_ids for g in b for s in g]
        for sa, sb in zip((s for g in a for s in g), (s for g in b for s in g), strict=True):
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-4)
        runs.append(ta)
        with torch.no_grad():  # an update, in place
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(0.5 * torch.randn(p.shape, generator=g))
    assert runs[0] != runs[1]  # the update changed what is sampled, in both loops alike
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled step did run


def test_compiled_decode_refuses_sharded_weights():
    """Weights of a tensor subclass (FSDP's DTensor shards) get a clear error, not a
    compile of the wrong thing."""
    from salvage.models import PolicySpec, load_policy

    class _Shard(torch.Tensor):
        pass

    model, tok = load_policy(PolicySpec("tiny"))
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().as_subclass(_Shard))
    eng = HFEngine(model, tok, max_new_tokens=2, compile_decode=True)
    with pytest.raises(ValueError, match="hf_compile_decode=true needs plain weights"):
        eng.generate(_prompts(tok), n=1, seed=0)


def test_decode_runs_the_step_runner_only_for_small_batches():
    """``runner`` (the compiled step) takes the KV-cache steps of at most
    ``runner_max_rows`` live rows; the prefill and larger steps run the model itself."""
    from salvage.models import PolicySpec, load_policy
    from salvage.rollout.config import EngineConfig
    from salvage.rollout.hf import decode

    model, _ = load_policy(PolicySpec("tiny"))
    model.eval()
    ids = torch.randint(3, 500, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    rows_seen: list[int] = []

    def runner(**kw):
        rows_seen.append(kw["input_ids"].shape[0])
        return model(**kw)

    out = {}
    for cap in (3, 4):
        rows_seen.clear()
        out[cap] = decode(
            model,
            ids,
            mask,
            max_new=5,
            temperature=1.0,
            top_p=1.0,
            eos_ids=set(),  # no row ends early: 4 rows throughout
            pad_id=0,
            generator=torch.Generator().manual_seed(3),
            runner=runner,
            runner_max_rows=cap,
        )
        assert rows_seen == ([] if cap == 3 else [4] * 4)  # 5 tokens: 4 KV-cache steps
    assert out[3] == out[4]  # same model either way: same tokens and log-probs
    with pytest.raises(ValueError, match="hf_compile_max_rows"):
        EngineConfig(hf_compile_max_rows=0)


# -- faults: no hang after an engine error ---------------------------------------------


class _Engine:
    """A stand-in engine: ``faults`` lists what each call does (``raise``, ``hang``, ``ok``)."""

    def __init__(self, faults, timeout_s=None, rebuildable=True):
        self.faults, self.calls, self.rebuilds = list(faults), 0, 0
        self.generate_timeout_s = timeout_s
        if rebuildable:
            self.rebuild = self._rebuild

    def _rebuild(self):
        self.rebuilds += 1

    def generate(self, prompts, n=1, **kw):
        self.calls += 1
        what = self.faults.pop(0) if self.faults else "ok"
        if what == "raise":
            raise RuntimeError(f"fault {self.calls}")
        while what == "hang":
            pass
        return [["sample"] * n for _ in prompts]


def test_engine_error_is_retried_on_a_rebuilt_engine_only():
    from salvage.rollout.config import RolloutEngineError, generate_with_retry

    eng = _Engine(["raise"])
    assert generate_with_retry(eng, [[1]], n=2) == [["sample", "sample"]]
    assert (eng.calls, eng.rebuilds) == (2, 1)
    eng = _Engine(["raise", "raise"])
    with pytest.raises(RolloutEngineError, match="failed twice.*fault 1.*fault 2"):
        generate_with_retry(eng, [[1]])
    assert (eng.calls, eng.rebuilds) == (2, 1)
    eng = _Engine(["raise"], rebuildable=False)  # never retried on the same engine
    with pytest.raises(RolloutEngineError, match="has no rebuild"):
        generate_with_retry(eng, [[1]])
    assert eng.calls == 1


def test_generate_past_its_time_limit_is_interrupted_and_retried_rebuilt():
    import signal

    from salvage.rollout.config import GenerateTimeout, RolloutEngineError, generate_with_retry

    before = signal.getsignal(signal.SIGALRM)
    eng = _Engine(["hang"], timeout_s=0.3)
    t0 = time.perf_counter()
    assert generate_with_retry(eng, [[1]]) == [["sample"]]
    assert (eng.calls, eng.rebuilds) == (2, 1) and time.perf_counter() - t0 < 5
    eng = _Engine(["hang", "hang"], timeout_s=0.3)
    with pytest.raises(RolloutEngineError, match="generate_timeout_s=0.3") as err:
        generate_with_retry(eng, [[1]])
    assert isinstance(err.value.__cause__, GenerateTimeout)
    assert (
        signal.getsignal(signal.SIGALRM) is before and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )


def test_engine_config_generate_timeout():
    from salvage.rollout.hf import HFEngine

    assert EngineConfig().generate_timeout_s == 600.0
    assert EngineConfig(generate_timeout_s=None).generate_timeout_s is None
    with pytest.raises(ValueError, match="engine.generate_timeout_s"):
        EngineConfig(generate_timeout_s=0)
    model, tok = load_policy(PolicySpec("tiny"))
    assert (
        HFEngine.from_config(EngineConfig(generate_timeout_s=5), model, tok).generate_timeout_s == 5
    )


def test_hf_rebuild_puts_the_lm_head_back_after_a_cut_off_call():
    from salvage.rollout.hf import HeadSwap, HFEngine

    model, tok = load_policy(PolicySpec("tiny"))
    head = model.get_output_embeddings()
    eng = HFEngine(model, tok, max_new_tokens=4)
    HeadSwap(model, True).__enter__()  # a call interrupted inside the swap
    assert model.get_output_embeddings() is not head
    eng.rebuild()
    assert model.get_output_embeddings() is head
    assert len(eng.generate(_prompts(tok), n=2, seed=0)[0]) == 2


_ROOT = Path(__file__).resolve().parents[1]
_FAULT_FIT = [
    "fit",
    "--config",
    str(_ROOT / "configs/grpo/math_tiny.yaml"),
    "--trainer.enable_progress_bar",
    "false",
    "--data.init_args.prompts_per_step",
    "2",
    "--data.init_args.engine.max_new_tokens",
    "8",
]


def _fault_fit(tmp_path, mode, timeout_s, *, steps=2, sig=None, limit=120):
    """``salvage fit`` (tiny GRPO) with a fault in the HF engine; (exit status, stderr, s).

    ``sig``: sent once the fault started. The subprocess limit bounds the test: a hang
    fails it instead of hanging the suite."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", WANDB_MODE="offline")
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, str(_ROOT / "tests/engine_fault_worker.py"), mode, *_FAULT_FIT]
    cmd += ["--trainer.max_steps", str(steps), "--trainer.default_root_dir", str(tmp_path)]
    cmd += ["--data.init_args.engine.generate_timeout_s", str(timeout_s)]
    err_file = tmp_path / "stderr.txt"
    t0 = time.perf_counter()
    with open(err_file, "w") as err:
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            if sig is not None:
                while "FAULT 1" not in err_file.read_text():
                    assert proc.poll() is None, err_file.read_text()
                    assert time.perf_counter() - t0 < limit, "the fault never started"
                    time.sleep(0.05)
                time.sleep(0.5)
                proc.send_signal(sig)
            proc.wait(timeout=max(1.0, limit - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"{mode}: still running after {limit} s:\n{err_file.read_text()[-3000:]}")
    return proc.returncode, err_file.read_text(), time.perf_counter() - t0


def _ckpts(root):
    return list(root.glob("version_*/checkpoints/last.ckpt"))


# the fault fits but the hung call's are slow tests (a fresh `salvage fit` each, 20-40 s on a
# make-test worker); the default suite keeps the hung call's fit and the in-process retries
# (test_engine_error_is_retried_on_a_rebuilt_engine_only, test_generate_past_its_time_limit_...)
@pytest.mark.slow
def test_fit_recovers_from_an_engine_error_on_a_rebuilt_engine(tmp_path):
    code, err, _ = _fault_fit(tmp_path, "raise-once", 600)
    assert code == 0, err[-3000:]
    assert err.count("REBUILD") == 1 and "injected engine fault 1" in err
    assert _ckpts(tmp_path)


def test_fit_recovers_from_a_hung_generate_call(tmp_path):
    code, err, took = _fault_fit(tmp_path, "hang-once", 3)
    assert code == 0, err[-3000:]
    assert err.count("REBUILD") == 1 and "generate_timeout_s=3" in err


@pytest.mark.slow
def test_fit_fails_with_a_clear_error_when_the_rebuilt_engine_fails_too(tmp_path):
    code, err, _ = _fault_fit(tmp_path, "raise-always", 600)
    assert code not in (0, 75, 130), err[-3000:]
    line = "salvage: error: rollout engine failed twice (the second time rebuilt)"
    assert code == 1 and line in err and "injected engine fault 2" in err, err[-3000:]
    assert "Traceback" not in err  # one line, not the stack (issue 47 item 8)
    assert err.count("REBUILD") == 1


# (test_signals stops fits by signal in the default suite)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code", "name"), [(signal.SIGTERM, 75, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")]
)
def test_a_signal_during_a_hung_generate_call_stops_the_fit(tmp_path, sig, code, name):
    got, err, took = _fault_fit(tmp_path, "hang-always", 600, steps=100, sig=sig)
    assert got == code, err[-3000:]
    assert f"salvage: fit stopped by {name} after 0 update(s)" in err
    assert "REBUILD" not in err  # a stop is not an engine error


@pytest.mark.slow
def test_a_call_stuck_outside_python_ends_the_process(tmp_path):
    from salvage.rollout.config import EXIT_ENGINE_HUNG, hard_exit_grace_s

    code, err, took = _fault_fit(tmp_path, "stuck-native", 2, limit=90)
    assert code == EXIT_ENGINE_HUNG, err[-3000:]
    assert "did not stop within" in err and hard_exit_grace_s(2) == 10
