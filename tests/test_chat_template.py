"""Prompt format: the model's own chat template, or a documented plain one.

The GRAFT paper formats each problem as one user message through the model's template;
``configs/graft/math_pair1.yaml`` no longer replaces the templates with raw concatenation,
and a base model whose tokenizer has none gets ``salvage.models.PLAIN_TEMPLATE`` when the
policy asks for it (``template_fallback: plain``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from salvage.models import (
    PLAIN_TEMPLATE,
    PolicySpec,
    _finish_tokenizer,
    build_tiny_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "What is 2 + 3? Put the answer in \\boxed{}."}]


def test_tokenizer_without_template_gets_the_plain_format():
    tok = build_tiny_tokenizer()
    tok.chat_template = None  # a base model's tokenizer: no template
    tok = _finish_tokenizer(tok, PolicySpec("tiny", template_fallback="plain"))
    assert tok.chat_template == PLAIN_TEMPLATE
    text = tok.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)
    assert text == MSG[0]["content"] + "\n\n"  # the problem, a blank line, no role markers
    two = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, *MSG], tokenize=False, add_generation_prompt=True
    )
    assert two == "S\n\n" + MSG[0]["content"] + "\n\n"


def test_tokenizer_with_a_template_keeps_it_under_the_fallback():
    tok = _finish_tokenizer(build_tiny_tokenizer(), PolicySpec("tiny", template_fallback="plain"))
    text = tok.apply_chat_template(MSG, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


def test_no_template_without_fallback_is_a_clear_error():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ValueError, match="template_fallback: plain"):
        _finish_tokenizer(tok, PolicySpec("tiny"))
    with pytest.raises(ValueError, match="policy.template_fallback must be one of"):
        PolicySpec("tiny", template_fallback="raw")


def test_math_pair1_uses_the_models_templates(monkeypatch):
    from test_configs import _resolve

    monkeypatch.chdir(ROOT)
    m = _resolve("configs/graft/math_pair1.yaml")["model"]["init_args"]
    for k in ("policy_a", "policy_b"):
        assert m[k]["chat_template"] is None, k  # no raw-concatenation override
        assert m[k]["template_fallback"] == "plain", k
