"""HF rollout engine: log-probs, seeding, n samples, stop strings, finish reasons."""

from __future__ import annotations

import pytest
import torch

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
