"""``salvage export CKPT OUT_DIR``: a trained policy as a Hugging Face directory.

Reads a Lightning checkpoint safely (``torch.load(weights_only=True)``: salvage stores its
hyper-parameters as plain data), rebuilds the policy from its ``PolicySpec``, loads the
trained weights and writes ``config.json``, ``model.safetensors``, ``generation_config.json``
and the tokenizer, so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.
GRAFT checkpoints hold two policies: pick one with ``--policy a`` or ``--policy b``.
A distributed checkpoint (a directory, written by ``ModelParallelStrategy`` / FSDP2) is
consolidated on the fly: its shards are merged on one process, no process group needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from salvage.models import PolicySpec, load_model, load_tokenizer


def load_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint as one dict: a file, or a distributed checkpoint directory."""
    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        return torch.load(str(path), map_location="cpu", weights_only=True)
    if not (path / ".metadata").exists():
        raise ValueError(f"{path} is a directory but not a distributed checkpoint (no .metadata)")
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(full))  # merges the shards on this process
        state = torch.load(str(full), map_location="cpu", weights_only=True)
    meta = path / "meta.pt"  # Lightning's non-tensor state (hyper-parameters, loops, ...)
    if meta.exists():
        state.update(torch.load(str(meta), map_location="cpu", weights_only=True))
    return state


def export(ckpt: str | Path, out_dir: str | Path, policy: str | None = None) -> Path:
    state = load_checkpoint(ckpt)
    hp: dict[str, Any] = state.get("hyper_parameters", {})
    sd: dict[str, torch.Tensor] = state["state_dict"]
    if any(k.startswith("a.policy.") for k in sd):  # GRAFT
        if policy not in ("a", "b"):
            raise ValueError(
                "this is a GRAFT checkpoint with two policies: pass --policy a or --policy b"
            )
        spec_dict, prefix = hp[f"policy_{policy}"], f"{policy}.policy."
    else:
        if policy not in (None, "a"):
            raise ValueError(f"--policy {policy!r}: this checkpoint holds a single policy")
        spec_dict, prefix = hp["policy"], "policy."
    spec = PolicySpec(**spec_dict)
    tok = load_tokenizer(spec)
    model = load_model(spec, tok)
    weights = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {spec.name_or_path!r}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.requires_grad_(True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="salvage export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "ckpt",
        help="a Lightning checkpoint (e.g. RUN/checkpoints/last.ckpt; a file, or a "
        "distributed checkpoint directory)",
    )
    ap.add_argument("out_dir", help="where the HF directory goes")
    ap.add_argument(
        "--policy", choices=["a", "b"], default=None, help="GRAFT: which of the two policies"
    )
    a = ap.parse_args(argv)
    print(f"wrote {export(a.ckpt, a.out_dir, a.policy)}")
