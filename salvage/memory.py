"""A run's memory plan from its resolved config (``salvage fit --print_memory``).

Reads the config as plain data (``trainer``, ``model``, ``data``, ``rescue``), finds each
model's shape (``salvage.core.memory.KNOWN_SHAPES`` for the shipped configs' hub models, else
the model's own config on the meta device: no weights are loaded) and hands the arithmetic to
``salvage.core.memory``.
"""

from __future__ import annotations

from typing import Any

from salvage.core.memory import KNOWN_SHAPES, MemoryPlan, ModelMem, Shape

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, None: 4}
_SHARDING = ("FSDP2Strategy", "ModelParallelStrategy")


def shape_of(spec: dict[str, Any]) -> Shape:
    """The shape of a ``PolicySpec`` (as a dict): known, or built on the meta device."""
    name = spec.get("name_or_path") or "tiny"
    if name in KNOWN_SHAPES:
        return KNOWN_SHAPES[name]
    import torch

    from salvage.models import PolicySpec, load_model, load_tokenizer

    if name in ("tiny", "small"):
        ps = PolicySpec(**{k: v for k, v in spec.items() if k in PolicySpec.__dataclass_fields__})
        model = load_model(ps, load_tokenizer(ps))
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        from salvage.models import smollm2_checkpoint

        path = str(smollm2_checkpoint()) if name == "smollm2-135m-instruct" else name
        conf = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf)
    c: Any = model.config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return Shape(
        params=sum(p.numel() for p in model.parameters()),
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        intermediate=c.intermediate_size,
        kv_dim=getattr(c, "num_key_value_heads", heads) * head_dim,
        vocab=c.vocab_size,
    )


def _short(class_path: Any) -> str:
    return str(class_path or "").rsplit(".", 1)[-1]


def _devices(trainer: dict[str, Any]) -> int:
    dev = trainer.get("devices", 1)
    n = len(dev) if isinstance(dev, list) else (1 if dev in (None, "auto", -1) else int(dev))
    return n * int(trainer.get("num_nodes") or 1)


def _policy_specs(cls: str, init: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The trained policies' specs by config key (one, GRAFT's two, or N peers a, b, c)."""
    if cls == "PeerGroupModule":
        peers = init.get("policies") or [{"name_or_path": "tiny"}] * 3
        return {f"policy_{chr(97 + i)}": p for i, p in enumerate(peers)}
    if cls == "GRAFTModule":
        return {k: init.get(k) or {"name_or_path": "tiny"} for k in ("policy_a", "policy_b")}
    return {"policy": init.get("policy") or {"name_or_path": "tiny"}}


def _trained_models(
    cls: str,
    init: dict[str, Any],
    engine: dict[str, Any],
    sharded: bool,
    replicate: bool,
) -> list[ModelMem]:
    """Each policy (sampling; the first engine may sleep) and, where the loss needs one (KL,
    VH-GPO's preference term), its frozen reference (scores in the update only)."""
    vllm = engine.get("backend") == "vllm"
    share = float(engine.get("vllm_gpu_memory_utilization", 0.3)) if vllm else None
    sleeps = int(engine.get("vllm_sleep_level", 1)) > 0
    needs_ref = float(init.get("kl_coef") or 0.0) > 0 or (
        cls == "VHGPOModule" and float(init.get("lambda_pair", 1.0)) > 0
    )
    specs = _policy_specs(cls, init)
    one = len(specs) == 1
    models: list[ModelMem] = []
    for i, (key, spec) in enumerate(specs.items()):
        shape, wbytes = shape_of(spec), _BYTES.get(spec.get("dtype"), 4)
        role = "policy" if one else f"policy {key[-1].upper()}"
        models.append(
            ModelMem(
                role, shape, wbytes, sharded, share, engine_sleeps=sleeps and i == 0, samples=True
            )
        )
        if needs_ref:  # the reference loads the policy's spec (same dtype)
            models.append(
                ModelMem(
                    "reference" if one else f"reference {key[-1].upper()}",
                    shape,
                    wbytes,
                    sharded and not replicate,
                    samples=False,
                    gathered_in_rollout=False,  # only the samplers are (sampling_models)
                    scores_in_update=True,
                )
            )
    return models


def _teacher_model(
    rescue: dict[str, Any], engine: dict[str, Any], sharded: bool, replicate: bool
) -> ModelMem | None:
    """VH-GPO's frozen LM teacher (None: an oracle teacher, or no rescue stage)."""
    teacher = rescue.get("teacher") or {}
    if teacher.get("kind") != "lm" or not teacher.get("policy"):
        return None
    t_engine = teacher.get("engine") or engine
    t_vllm = t_engine.get("backend") == "vllm"
    return ModelMem(
        "teacher",
        shape_of(teacher["policy"]),
        _BYTES.get(teacher["policy"].get("dtype"), 4),
        sharded and not replicate,
        float(t_engine.get("vllm_gpu_memory_utilization", 0.3)) if t_vllm else None,
        engine_sleeps=False,  # a frozen model's engine keeps its share (rollout/vllm.py)
        samples=True,
    )


def plan_from_config(cfg: dict[str, Any], gpu_gb: float = 80.0) -> MemoryPlan:
    """The per-GPU memory plan of a ``salvage fit`` config (a plain dict)."""
    from salvage.lm import DEFAULT_LOGPROB_CHUNK

    trainer = cfg.get("trainer") or {}
    model = cfg.get("model") or {}
    init = model.get("init_args") or {}
    data = (cfg.get("data") or {}).get("init_args") or {}
    strategy = trainer.get("strategy")
    sclass = _short(strategy.get("class_path") if isinstance(strategy, dict) else strategy)
    sharded = sclass in _SHARDING  # FSDP2 (over one GPU it shards nothing but still applies)
    fsdp = init.get("fsdp") or {}
    precision = str(trainer.get("precision") or "32-true")
    bf16 = precision.startswith("bf16") or (sharded and fsdp.get("param_dtype") == "bfloat16")
    engine = data.get("engine") or {}
    length = int(data.get("max_prompt_tokens") or 1024) + int(engine.get("max_new_tokens", 256))
    replicate = fsdp.get("reference") == "replicate"
    models = _trained_models(_short(model.get("class_path")), init, engine, sharded, replicate)
    rescue = (cfg.get("rescue") or {}).get("init_args") or {}
    teacher = _teacher_model(rescue, engine, sharded, replicate)
    if teacher is not None:
        models.append(teacher)
    notes = []
    if engine.get("backend") != "vllm":
        notes.append("HF engine: the KV cache grows with engine.batch_size x length")
    return MemoryPlan(
        models=tuple(models),
        gpus=_devices(trainer),
        gpu_gb=gpu_gb,
        compute_bytes=2 if bf16 else 4,
        engine_batch=int(engine.get("batch_size", 64)),
        engine_len=length,
        logprob_batch=int(engine.get("logprob_batch_size", 8)),
        micro_batch=int(init.get("micro_batch_size", 8)),
        update_len=length,
        activation_checkpointing=bool(fsdp.get("activation_checkpointing")) and sharded,
        reshard_after_forward=bool(fsdp.get("reshard_after_forward", True)),
        autocast_copies=precision == "bf16-mixed" and not sharded,
        logprob_chunk=int(init.get("logprob_chunk_size", DEFAULT_LOGPROB_CHUNK)),
        notes=tuple(notes),
    )
