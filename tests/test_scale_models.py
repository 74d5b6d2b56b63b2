"""The ``small`` built-in students (issue 45): sizes, domain tokenizers, per-family metrics."""

from __future__ import annotations

import pytest

from salvage.errors import ConfigError
from salvage.models import (
    PolicySpec,
    _trained_bpe,
    corpus_lines,
    load_model,
    load_tokenizer,
)
from salvage.modules.reporting import family_rollout_metrics
from salvage.types import Group, Trajectory

# a twc observation in TextWorld-Express's words (the corpus holds train-fold games' prompts)
TWX_TEXT = (
    "You are in the kitchen. In one part of the room you see a fridge that is closed. "
    "There is also a counter that has a red apple on it. To the north you see a closed "
    "wooden door.\nYour task is to pick up objects, then place them in their usual locations."
)


def _params(spec: PolicySpec) -> int:
    return sum(p.numel() for p in load_model(spec).parameters())


def test_tiny_is_unchanged_and_small_is_sized_to_learn():
    tiny = PolicySpec("tiny")
    assert (tiny.hidden_size, tiny.num_layers, tiny.vocab_size, tiny.corpus) == (
        64,
        2,
        512,
        "mixed",
    )
    assert _params(tiny) == 106_816  # the fixture every unit test pins
    small = PolicySpec("small", corpus="twx")
    assert (small.hidden_size, small.num_layers, small.vocab_size) == (256, 4, 1024)
    model = load_model(small)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 20_000_000, n
    c = model.config
    assert (
        c.num_attention_heads,
        c.num_key_value_heads,
        c.hidden_size // c.num_attention_heads,
    ) == (
        4,
        2,
        64,
    )
    # a width off the 64 grid keeps a valid head layout (one head of the whole width)
    odd = load_model(PolicySpec("small", hidden_size=200, num_layers=1)).config
    assert (odd.num_attention_heads, odd.num_key_value_heads) == (1, 1)
    assert (
        load_model(PolicySpec("small", hidden_size=384, num_layers=1)).config.num_key_value_heads
        == 3
    )


def test_a_domain_tokenizer_makes_prompts_shorter():
    mixed = load_tokenizer(PolicySpec("tiny"))
    twx = load_tokenizer(PolicySpec("small", corpus="twx"))
    arith = load_tokenizer(PolicySpec("small", corpus="arith", vocab_size=512))
    n_mixed, n_twx = len(mixed(TWX_TEXT).input_ids), len(twx(TWX_TEXT).input_ids)
    assert n_twx <= 0.65 * n_mixed, (n_twx, n_mixed)  # 85 vs 141 tokens
    # and over rendered agent prompts of train-fold games (the corpus' own lines)
    lines = corpus_lines("twx")[-2000::50]
    ratio = sum(len(twx(x).input_ids) for x in lines) / sum(len(mixed(x).input_ids) for x in lines)
    assert ratio <= 0.5, ratio
    sum_text = (
        "Calculate 47 + 38. Let's think step by step and output the final answer within \\boxed{}."
    )
    assert len(arith(sum_text).input_ids) < len(mixed(sum_text).input_ids)
    # the special tokens and the chat template every built-in shares
    for tok in (twx, arith):
        assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
        text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert text.startswith("<|im_start|>user")
        assert tok.decode(tok(TWX_TEXT).input_ids) == TWX_TEXT  # byte-level: lossless


def test_the_tokenizer_fit_is_deterministic():
    first = _trained_bpe(600, "twx")
    _trained_bpe.cache_clear()
    assert _trained_bpe(600, "twx") == first
    assert _trained_bpe(600, "arith") != first


def test_the_twx_corpus_is_train_fold_text():
    lines = corpus_lines("twx")
    assert len(lines) > 3000
    assert any("put the" in line.lower() for line in lines)  # oracle actions are there


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"corpus": "wiki"},
            r"policy.corpus must be one of \('mixed', 'twx', 'arith'\), got 'wiki'",
        ),
        ({"hidden_size": 30}, r"policy.hidden_size must be a multiple of 4 and >= 8, got 30"),
        ({"num_layers": 0}, r"policy.num_layers must be >= 1, got 0"),
        ({"vocab_size": 100}, r"policy.vocab_size must be >= 300"),
    ],
)
def test_bad_sizes_name_the_key(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        PolicySpec("small", **kwargs)


def _group(family: str, successes: list[bool]) -> Group:
    trajs = [Trajectory(turns=[], reward=float(s), success=s) for s in successes]
    return Group(
        task_id=f"{family}/x",
        trajectories=trajs,
        task={"family": family},
        zero_signal=len(set(successes)) == 1,
    )


def test_per_family_rollout_metrics_by_hand():
    groups = [
        _group("easy", [True, True, False, False]),  # 2/4, signal
        _group("easy", [True, True, True, True]),  # 4/4, zero-signal
        _group("hard", [False] * 4),  # 0/4, zero-signal
    ]
    assert family_rollout_metrics(groups) == {
        "rollout/success/easy": 0.75,
        "rollout/success/hard": 0.0,
        "rollout/zero_signal/easy": 0.5,
        "rollout/zero_signal/hard": 1.0,
    }
    # one family: nothing beside the overall rollout/success_rate
    assert family_rollout_metrics(groups[:2]) == {}
