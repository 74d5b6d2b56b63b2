"""Multi-process training helpers: FSDP2 sharding, gathered inference, lock-step collectives.

FSDP2 (``torch.distributed.fsdp.fully_shard``) is applied through Lightning's
``ModelParallelStrategy``: the strategy builds the device mesh and calls
``configure_model``, where ``shard_model`` wraps every decoder layer and then the root.

Two rules keep ranks from deadlocking, because every sharded forward and backward is a
collective (all-gather / reduce-scatter) that all ranks must issue the same number of
times:

1. **Inference runs gathered.** Rollouts (multi-turn episodes end at different turns
   on different ranks), the relay search, GRAFT's receiver likelihoods and reference
   scores run inside ``gathered(model, ...)``: the parameters are all-gathered once on
   entry (one collective, on every rank), forwards inside are local, and they are
   resharded on exit. Each phase is entered once per step by every rank.
2. **Training runs in lock step.** The update pads each rank's loop of micro-batches to
   the longest rank's (``lockstep``), running zero-weight dummy micro-batches, and
   normalises token-mean losses by the *global* token count (``global_scale``), so the
   averaged gradient equals that of one process holding the whole batch.

Without ``torch.distributed`` initialised every helper is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class FSDPConfig:
    """How a policy is sharded under ``ModelParallelStrategy`` (``model.fsdp.*``; ignored otherwise)."""

    param_dtype: str | None = None
    """Compute dtype of the gathered parameters (``bfloat16`` on GPU); None: the parameters' own."""
    reduce_dtype: str | None = "float32"
    """Dtype of the gradient reduce-scatter; None: the compute dtype."""
    reshard_after_forward: bool = True
    """Free the gathered parameters of each layer after its forward (ZeRO-3); False keeps
    them until the backward (ZeRO-2-like, more memory, fewer all-gathers)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimiser state in CPU memory."""
    reference: str = "shard"
    """Frozen models (reference, teacher): ``shard`` (FSDP, gathered for each use),
    ``offload`` (sharded in CPU memory) or ``replicate`` (a full copy per rank)."""
    init_on_rank0: bool = True
    """Only rank 0 loads the weights; the other ranks build the model on the meta device and
    receive their shards from it (False: every rank loads a full copy before sharding)."""

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            val = getattr(self, key)
            if val is not None and val not in _DTYPES:
                raise ValueError(
                    f"model.fsdp.{key} must be one of {sorted(_DTYPES)} or null, got {val!r}"
                )
        if self.reference not in ("shard", "offload", "replicate"):
            raise ValueError(
                f"model.fsdp.reference must be shard, offload or replicate, got {self.reference!r}"
            )


# ----------------------------------------------------------------------------- collectives
def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        return d.get_rank(), d.get_world_size()
    return 0, 1


def _device() -> torch.device:
    d = torch.distributed
    if d.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op: str = "sum") -> list[float]:
    """Element-wise sum / max / min of a list of numbers over ranks (identity on one process)."""
    if world()[1] == 1:
        return list(values)
    d = torch.distributed
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    d.all_reduce(t, op={"sum": d.ReduceOp.SUM, "max": d.ReduceOp.MAX, "min": d.ReduceOp.MIN}[op])
    return t.tolist()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` on one process."""
    if world()[1] == 1:
        return [obj]
    d = torch.distributed
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


def rank_share(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank``'s slice ``[start, stop)`` of ``total`` items split over ``world_size`` ranks.

    Contiguous and in rank order (concatenating the slices gives the items in their order);
    the first ``total % world_size`` ranks take one item more.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of {world_size} ranks")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def merge_eval_records(
    per_rank: list[list[tuple[int, str, str, float, float]]],
) -> dict[tuple[int, str], tuple[float, float]]:
    """(repeat, benchmark) -> (successes, samples) over all ranks' evaluated problems.

    Each record is ``(repeat, benchmark, task id, successes, samples)`` for one problem. A
    problem evaluated on several ranks (Lightning's distributed sampler pads the last
    batch with problems of the first) counts once, the lowest rank's copy: the result is
    the mean over the evaluated problems, as one process holding them all would compute.
    """
    seen: set[tuple[int, str, str]] = set()
    out: dict[tuple[int, str], tuple[float, float]] = {}
    for records in per_rank:
        for repeat, bench, task, succ, n in records:
            if (repeat, bench, task) in seen:
                continue
            seen.add((repeat, bench, task))
            s0, n0 = out.get((repeat, bench), (0.0, 0.0))
            out[(repeat, bench)] = (s0 + succ, n0 + n)
    return out


def lockstep(n: int) -> int:
    """The largest ``n`` over ranks: how many iterations every rank's loop must run."""
    return int(all_reduce([float(n)], "max")[0])


def all_true(flag: bool) -> bool:
    return bool(all_reduce([1.0 if flag else 0.0], "min")[0])


def global_scale(local: float, total: float, world_size: int) -> float:
    """Factor turning a loss normalised by a local count into one normalised by the global
    count, under gradient *averaging* over ``world_size`` ranks: ``W * local / total``.

    With it, (1/W) sum_r grad(W * local_r/total * L_r) = grad(sum_r local_r * L_r) / total:
    the gradient of one process normalising over all ranks' items.
    """
    if total <= 0:
        return 0.0
    return world_size * local / total


def run_file(trainer: Any, stem: str) -> Any:
    """``<run dir>/<stem>.jsonl`` on rank 0, ``<stem>.rank<r>.jsonl`` on rank r > 0 (each rank
    records its own share). Call it on every rank: ``trainer.log_dir`` is a collective."""
    from pathlib import Path

    root = Path(trainer.log_dir or trainer.default_root_dir)
    root.mkdir(parents=True, exist_ok=True)
    rank = trainer.global_rank
    return root / (f"{stem}.jsonl" if rank == 0 else f"{stem}.rank{rank}.jsonl")


# ----------------------------------------------------------------------------- FSDP2
def _fsdp() -> Any:
    from torch.distributed import fsdp

    return fsdp


def is_sharded(model: torch.nn.Module | None) -> bool:
    return model is not None and _has_fsdp_modules(model)


def _has_fsdp_modules(model: torch.nn.Module) -> bool:
    FSDPModule = _fsdp().FSDPModule
    return any(isinstance(m, FSDPModule) for m in model.modules())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` and common variants)."""
    for path in ("model.layers", "transformer.h", "model.decoder.layers", "gpt_neox.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return list(obj)
    raise ValueError(f"FSDP: cannot find the decoder layers of {type(model).__name__} to shard")


def shard_model(
    model: torch.nn.Module, mesh: Any, cfg: FSDPConfig, frozen: bool = False
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, on ``mesh`` (in place; returns ``model``).

    ``frozen``: a reference / teacher (no gradients; ``cfg.reference`` decides offloading).
    """
    fsdp = _fsdp()
    if frozen and cfg.reference == "replicate":
        return model
    if cfg.activation_checkpointing and not frozen:
        # an HF PreTrainedModel: transformers 5.24 renamed gradient_checkpointing_enable
        # (deprecated, a FutureWarning) to activation_checkpointing_enable
        if hasattr(model, "activation_checkpointing_enable"):
            enable: Any = model.activation_checkpointing_enable
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):
            enable = model.gradient_checkpointing_enable
            enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ValueError(
                f"model.fsdp.activation_checkpointing: {type(model).__name__} does not support it"
            )
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.param_dtype is not None or cfg.reduce_dtype is not None:
        kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(
            param_dtype=_DTYPES[cfg.param_dtype] if cfg.param_dtype else None,
            reduce_dtype=_DTYPES[cfg.reduce_dtype] if cfg.reduce_dtype else None,
        )
    if wants_offload(cfg, frozen, getattr(mesh, "device_type", "cpu")):
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    setattr(model, "_salvage_reshard", cfg.reshard_after_forward)  # noqa: B010 - read back by gathered()
    if "offload_policy" in kwargs:
        setattr(model, "_salvage_offloaded", True)  # noqa: B010 - read back by to_device()
    return model


def load_sharded(
    load: Callable[[], torch.nn.Module],
    build_empty: Callable[[], torch.nn.Module],
    mesh: Any,
    cfg: FSDPConfig,
    frozen: bool = False,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """A model sharded with ``shard_model`` on ``mesh``, its full weights read by rank 0 only.

    ``load`` builds the model with its weights (called on rank 0 only), ``build_empty`` the
    same architecture (called under ``torch.device("meta")`` on every rank). Every rank shards
    the meta model, allocates its own shards, and receives them from rank 0's full state dict
    (``set_model_state_dict(..., broadcast_from_rank0=True)``); buffers, persistent or not
    (the rotary ``inv_freq``), and the generation config are broadcast from rank 0 too. A rank
    other than 0 never holds more than its shards (and one tensor in flight), instead of the
    full model. ``frozen``: a reference / teacher (eval mode, no gradients). ``device``: where
    a frozen model that is not sharded goes. Without ``cfg.init_on_rank0``, on one process,
    or for a replicated frozen model (a full copy per rank anyway), every rank calls ``load``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    def freeze(m: torch.nn.Module) -> torch.nn.Module:
        return m.eval().requires_grad_(False) if frozen else m

    if not cfg.init_on_rank0 or world()[1] == 1 or (frozen and cfg.reference == "replicate"):
        model = freeze(load())
        if frozen and device is not None:
            model.to(device)
        return shard_model(model, mesh, cfg, frozen)
    d = torch.distributed
    full = freeze(load()) if d.get_rank() == 0 else None
    with torch.device("meta"):
        model = freeze(build_empty())
    shard_model(model, mesh, cfg, frozen)
    dev_type = getattr(mesh, "device_type", "cpu")
    if dev_type == "cpu" or wants_offload(cfg, frozen, dev_type):
        home = torch.device("cpu")  # offloaded shards live in CPU memory
    else:
        home = torch.device(dev_type, torch.accelerator.current_device_index())
    model.to_empty(device=home)  # keeps a tied LM head tied (tested)
    full_sd = full.state_dict() if full is not None else {}
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True)
    set_model_state_dict(model, full_sd, options=opts)
    del full_sd
    theirs = dict(full.named_buffers()) if full is not None else {}
    comm = _device()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            tmp = (theirs[name] if full is not None else buf).to(comm, buf.dtype, copy=True)
            d.broadcast(tmp, src=0)
            buf.copy_(tmp)
    if hasattr(model, "generation_config"):
        box = [getattr(full, "generation_config", None)]
        d.broadcast_object_list(box, src=0)
        if box[0] is not None:
            setattr(model, "generation_config", box[0])  # noqa: B010 - an HF model attribute
    del full
    return model


def wants_offload(cfg: FSDPConfig, frozen: bool, device_type: str) -> bool:
    """Whether to offload this model's shards to CPU memory; a clear error on a CPU mesh,
    where FSDP2's offload needs an accelerator (and the shards already live in CPU memory)."""
    want = cfg.cpu_offload or (frozen and cfg.reference == "offload")
    if want and device_type == "cpu":
        key = "model.fsdp.cpu_offload" if cfg.cpu_offload else "model.fsdp.reference=offload"
        raise ValueError(
            f"{key} needs a GPU mesh: on CPU the shards are in CPU memory already; "
            "use reference: shard (or cpu_offload: false)"
        )
    return want


def to_device(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``model.to(device)``, except the parameters of CPU-offloaded FSDP2 models inside it.

    FSDP2 with ``CPUOffloadPolicy`` keeps the shards in CPU memory and refuses, at its first
    forward, shards found elsewhere ("FSDP parameters should be materialized on CPU when
    enabling CPU offloading"); a plain ``.to(device)`` (Lightning's ``model_to_device``) would
    move them. Their buffers (e.g. rotary frequencies) do go to ``device``, where they compute.
    """

    def offloaded(m: torch.nn.Module) -> bool:
        return getattr(m, "_salvage_offloaded", False)

    stack = [model]
    while stack:
        m = stack.pop()
        if offloaded(m):
            for sub in m.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None:
                        sub._buffers[name] = buf.to(device)
        elif not any(offloaded(x) for x in m.modules()):
            m.to(device)  # the usual move (metrics' own states included)
        else:  # its own tensors here, the children one by one
            with torch.no_grad():
                for p in m._parameters.values():
                    if p is not None:
                        p.data = p.data.to(device)
                for name, buf in m._buffers.items():
                    if buf is not None:
                        m._buffers[name] = buf.to(device)
            stack.extend(m.children())
    return model


_GATHERED: set[int] = set()


def is_gathered(model: torch.nn.Module) -> bool:
    return id(model) in _GATHERED


@contextlib.contextmanager
def gathered(*models: torch.nn.Module | None) -> Iterator[None]:
    """All-gather the sharded parameters of ``models`` for local (no-grad) inference.

    Every rank must enter together (the all-gather is a collective); forwards inside need
    no communication, so ranks may run different numbers of them. Meant for inference:
    run the forwards under ``torch.no_grad()`` (a backward inside would reduce-scatter). Models that are not
    sharded, or already gathered by an enclosing call, are left alone.
    """
    todo = [m for m in models if m is not None and id(m) not in _GATHERED and _has_fsdp_modules(m)]
    if not todo:
        yield
        return
    FSDPModule = _fsdp().FSDPModule
    units = [u for m in todo for u in m.modules() if isinstance(u, FSDPModule)]
    for m in todo:
        _GATHERED.add(id(m))
    try:
        for u in units:
            u.set_reshard_after_forward(False, recurse=False)
        for u in units:
            u.unshard()
        yield
    finally:
        for m in todo:
            _GATHERED.discard(id(m))
        for m in todo:
            keep = getattr(m, "_salvage_reshard", True)
            for u in m.modules():
                if isinstance(u, FSDPModule):
                    u.reshard()
                    u.set_reshard_after_forward(keep, recurse=False)


def check_gathered(model: torch.nn.Module, what: str) -> None:
    """Fail clearly instead of deadlocking when sharded inference runs outside ``gathered``."""
    if world()[1] > 1 and _has_fsdp_modules(model) and not is_gathered(model):
        raise RuntimeError(
            f"{what} on an FSDP-sharded model outside salvage.distributed.gathered(): ranks would "
            "issue different numbers of all-gathers and deadlock. Wrap the phase in gathered(model)."
        )


# ----------------------------------------------------------------------------- checkpoints
REFERENCE_KEY = "salvage_reference"
"""Checkpoint key of a reference that is not the model its config names (a warm start reset
it): a full state dict, or ``"distributed"`` when its shards are in the distributed checkpoint."""
REFERENCE_PREFIX = "salvage_reference."
"""Prefix of the reference's entries in a distributed checkpoint's ``state_dict``."""


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def save_reference(ref: torch.nn.Module, checkpoint: dict[str, Any]) -> None:
    """Put ``ref`` into a checkpoint being written, each rank's shard where it belongs.

    Call on every rank (gathering a sharded model is a collective). Under FSDP2 with a
    distributed checkpoint (the module's ``state_dict`` holds DTensors) the reference's
    shards join ``state_dict`` under ``REFERENCE_PREFIX``, so every rank writes its own shard
    through ``torch.distributed.checkpoint``; otherwise (one process, a replicated reference,
    a single-file FSDP checkpoint) the full state dict goes under ``REFERENCE_KEY``.
    """
    sd = checkpoint.get("state_dict") or {}
    if is_sharded(ref):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if any(_is_dtensor(v) for v in sd.values()):
            shards = get_model_state_dict(ref, options=StateDictOptions(cpu_offload=True))
            sd.update({REFERENCE_PREFIX + k: v for k, v in shards.items()})
            checkpoint[REFERENCE_KEY] = "distributed"
            return
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        checkpoint[REFERENCE_KEY] = get_model_state_dict(ref, options=opts)  # full on rank 0
        return
    checkpoint[REFERENCE_KEY] = {k: v.detach().cpu() for k, v in ref.state_dict().items()}


def load_reference(ref: torch.nn.Module, checkpoint: dict[str, Any], path: Any) -> None:
    """Restore what ``save_reference`` wrote into ``ref`` (sharded or not); a collective under
    FSDP2. ``path``: the checkpoint being loaded (read when the shards are in it).

    A checkpoint of salvage before this format holds, under FSDP2, only rank 0's shard of the
    reference (as DTensors in its metadata): it is refused, naming the way out.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    state = checkpoint[REFERENCE_KEY]
    sd = checkpoint.get("state_dict")
    if isinstance(sd, dict):  # keep the module's own strict load clean
        for k in [k for k in sd if k.startswith(REFERENCE_PREFIX)]:
            del sd[k]
    if state == "distributed":
        if path is None:
            raise ValueError(
                f"{REFERENCE_KEY}: the reference is in a distributed checkpoint but no path is known"
            )
        import torch.distributed.checkpoint as dcp

        template = get_model_state_dict(ref)
        wanted = {"state_dict": {REFERENCE_PREFIX + k: v for k, v in template.items()}}
        dcp.load(wanted, checkpoint_id=str(path))
        loaded = {k[len(REFERENCE_PREFIX) :]: v for k, v in wanted["state_dict"].items()}
        set_model_state_dict(ref, loaded, options=StateDictOptions(strict=True))
        return
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint key {REFERENCE_KEY!r}: unknown value {state!r}")
    if any(_is_dtensor(v) for v in state.values()):
        raise ValueError(
            f"checkpoint {path}: its warm-started reference was saved by an older salvage that "
            "kept only rank 0's FSDP shard of it, so it cannot be restored on every rank. "
            "Resume from a checkpoint written by this version, or start the run again."
        )
    if is_sharded(ref):
        set_model_state_dict(ref, state, options=StateDictOptions(full_state_dict=True))
    else:
        ref.load_state_dict(state)
