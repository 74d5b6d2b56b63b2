"""``salvage export CKPT OUT_DIR``: a trained policy as a Hugging Face directory.

Reads a Lightning checkpoint safely (``torch.load(weights_only=True)``: salvage stores its
hyper-parameters as plain data), rebuilds the policy from its ``PolicySpec``, loads the
trained weights and writes ``config.json``, ``model.safetensors``, ``generation_config.json``
and the tokenizer, so ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it.
GRAFT checkpoints hold two policies: pick one with ``--policy a`` or ``--policy b``.

A checkpoint is data, never code: the model source stored in it is used only as a name
(``--model`` replaces it), remote code runs only with ``--trust_remote_code`` on the command
line (a checkpoint whose stored settings ask for remote code is refused without it), and the
export records where its weights and architecture came from in ``salvage_export.json``.
An existing non-empty ``OUT_DIR`` is refused unless ``--overwrite`` (which clears it first).
A distributed checkpoint (a directory, written by ``ModelParallelStrategy`` / FSDP2) is
consolidated on the fly: its shards are merged on one process, no process group needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# torch, Lightning and transformers are imported when a checkpoint is read, so that
# ``salvage export --help`` and its argument errors come back at once


def load_checkpoint(ckpt: str | Path) -> dict[str, Any]:
    """A Lightning checkpoint as one dict: a file, or a distributed checkpoint directory."""
    import torch

    from salvage.checkpointing import read_checkpoint

    path = Path(ckpt)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        return read_checkpoint(path, "checkpoint")  # one line for a torn or unsafe file
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
        state.update(read_checkpoint(path, "checkpoint"))
    return state


class ExportError(ValueError):
    """An export that would run code from a checkpoint or mix files in an existing folder."""


def _prepare_out_dir(out: Path, ckpt: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"export target {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(
                f"export target {out} is not empty: pass --overwrite to clear it first "
                "(old and new weight files would otherwise mix)"
            )
        resolved = out.resolve()
        protected = {Path.home().resolve(), Path.cwd().resolve(), Path("/")}
        if resolved in protected or resolved in ckpt.resolve().parents:
            raise ExportError(
                f"--overwrite refuses to clear {out} (it holds the checkpoint or is "
                "a home / working directory)"
            )
        import shutil

        shutil.rmtree(out)


def _policy_spec(
    state: dict[str, Any], policy: str | None
) -> tuple[str | None, dict[str, Any], str]:
    """(the policy asked for, its stored ``PolicySpec`` fields, its state-dict prefix): of a
    GRAFT / N-peer checkpoint (``policy`` a, b, ...) or of a single-policy one."""
    hp: dict[str, Any] = state.get("hyper_parameters", {})
    sd = state["state_dict"]
    if not any(k.startswith("a.policy.") for k in sd):
        if policy not in (None, "a"):
            raise ValueError(f"--policy {policy!r}: this checkpoint holds a single policy")
        return policy, hp["policy"], "policy."
    peers = hp.get("policies")  # PeerGroupModule: the specs in model order
    names = [chr(ord("a") + i) for i in range(len(peers))] if peers else ["a", "b"]
    if policy not in names:
        raise ValueError(
            f"this checkpoint holds {len(names)} policies: pass --policy "
            + " or --policy ".join(names)
        )
    spec_dict = peers[ord(policy) - ord("a")] if peers else hp[f"policy_{policy}"]
    return policy, spec_dict, f"{policy}.policy."


def _user_spec(
    ckpt: str | Path, spec_dict: dict[str, Any], trust_remote_code: bool, model: str | None
) -> Any:
    """The ``PolicySpec`` to rebuild: the stored one, with remote code only as the user
    allows it and the model source the user names."""
    from salvage.models import PolicySpec

    stored = dict(spec_dict)
    if stored.get("trust_remote_code") and not trust_remote_code and model is None:
        raise ExportError(
            f"{ckpt} asks for remote code (policy trust_remote_code: true, model "
            f"{stored.get('name_or_path')!r}); a checkpoint cannot turn it on: pass "
            "--trust_remote_code if you trust that model's code, or --model to name the source"
        )
    stored["trust_remote_code"] = bool(trust_remote_code)
    if model is not None:
        stored["name_or_path"] = model
    return PolicySpec(**stored)


def export(
    ckpt: str | Path,
    out_dir: str | Path,
    policy: str | None = None,
    trust_remote_code: bool = False,
    model: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write one policy of ``ckpt`` as an HF directory ``out_dir``.

    Args:
        ckpt: a Lightning checkpoint file, a distributed checkpoint directory, or a run dir
            (its newest version's ``last.ckpt``).
        out_dir: the HF directory to write.
        policy: GRAFT checkpoints: ``a`` or ``b``.
        trust_remote_code: allow the model's own code to run (the user's choice, never the
            checkpoint's).
        model: the model source (hub id or local dir) to rebuild the architecture from,
            instead of the one recorded in the checkpoint.
        overwrite: clear a non-empty ``out_dir`` first.
    """
    from salvage.checkpointing import find_last_checkpoint
    from salvage.models import load_model, load_tokenizer

    out = Path(out_dir)
    given = Path(ckpt)
    if given.is_dir() and not (given / ".metadata").exists():  # a run dir, not a DCP dir
        found = find_last_checkpoint(given)
        if found is None:
            raise FileNotFoundError(f"run dir {given} holds no last.ckpt in any version_N")
        ckpt = found
    _prepare_out_dir(out, Path(ckpt), overwrite)
    state = load_checkpoint(ckpt)
    policy, spec_dict, prefix = _policy_spec(state, policy)
    spec = _user_spec(ckpt, spec_dict, trust_remote_code, model)
    tok = load_tokenizer(spec)
    net: Any = load_model(spec, tok)  # a transformers model (``save_pretrained``)
    weights = {k[len(prefix) :]: v for k, v in state["state_dict"].items() if k.startswith(prefix)}
    missing, unexpected = net.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match {spec.name_or_path!r}: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    out.mkdir(parents=True, exist_ok=True)
    net.requires_grad_(True)
    net.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    record = {
        "checkpoint": str(Path(ckpt).resolve()),
        "policy": policy or "policy",
        "global_step": state.get("global_step"),
        "model_source": spec.name_or_path,
        "model_source_in_checkpoint": spec_dict.get("name_or_path"),
        "revision": spec.revision,
        "trust_remote_code": spec.trust_remote_code,
    }
    (out / "salvage_export.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="salvage export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "ckpt",
        help="a Lightning checkpoint (a file, or a distributed checkpoint directory), or a "
        "run dir: its newest version's checkpoints/last.ckpt",
    )
    ap.add_argument("out_dir", help="where the HF directory goes")
    ap.add_argument(
        "--policy",
        choices=list("abcdefghijklmnopqrstuvwxyz"),
        default=None,
        help="GRAFT / N peers: which policy (a, b, c, ...)",
    )
    ap.add_argument(
        "--trust_remote_code",
        action="store_true",
        help="allow the model's own code to run (never taken from the checkpoint)",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="model source (hub id or local dir) for the architecture and tokenizer, instead "
        "of the one recorded in the checkpoint",
    )
    ap.add_argument("--overwrite", action="store_true", help="clear a non-empty OUT_DIR first")
    a = ap.parse_args(argv)
    try:
        out = export(a.ckpt, a.out_dir, a.policy, a.trust_remote_code, a.model, a.overwrite)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"salvage export: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {out}")
