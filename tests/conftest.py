"""Test set-up: quiet threads, offline W&B, a cache dir per session, shared tiny fixtures."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# under pytest-xdist (`make test` runs 2 workers on 2 cores) each worker, and every process
# it starts, takes one thread: two 2-thread workers on 2 cores slow each other many times over
_XDIST = "PYTEST_XDIST_WORKER" in os.environ
if _XDIST:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["WANDB_MODE"] = "offline"
_wb = tempfile.mkdtemp(prefix="salvage-wandb-")
os.environ.setdefault("WANDB_DIR", _wb)
os.environ.setdefault("WANDB_CACHE_DIR", _wb)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1 if _XDIST else min(2, os.cpu_count() or 1))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def shared_data(rel: str) -> Path:
    """A file under ../shared/data, or skip the test with the reason."""
    p = SHARED_DATA / rel
    if not p.exists():
        pytest.skip(f"shared data {p} is absent (tests needing it skip)")
    return p


def needs_twx() -> None:
    """Skip the test, with the reason, when TextWorld-Express (extra ``twx``) or Java is absent."""
    pytest.importorskip("textworld_express", reason="textworld-express (extra twx) is absent")
    import shutil

    if shutil.which("java") is None:
        pytest.skip("TextWorld-Express needs Java")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    """The in-process CLIs (``SalvageCLI(args=...)``) see no pytest arguments in ``sys.argv``
    (LightningCLI warns when it is given both)."""
    import sys

    monkeypatch.setattr(sys, "argv", sys.argv[:1])


@pytest.fixture(autouse=True)
def _no_process_group_left():
    """No test hands a default process group to the next one in its process.

    An in-process fit under a distributed strategy (test_gpu_configs shrinks the FSDP2 and
    GRAFT GPU configs to one CPU process) initialises torch.distributed's default group and
    Lightning leaves it up; a later test in the same xdist worker that initialises its own
    then fails with "trying to initialize the default process group twice"."""
    yield
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _environment_restored():
    """No test hands its environment variables to the next one in its process.

    Lightning's launchers write the rendezvous into ``os.environ`` (``MASTER_ADDR``,
    ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``) and ``seed_everything`` its seed, and
    leave them: after test_gpu_configs' in-process fits, a 2-process FSDP2 fit started by a
    later test in the same xdist worker inherited ``LOCAL_RANK=0``, took itself for an
    already launched rank and waited for a second rank that nobody started (600 s, then a
    timeout). Variables set by fixtures of a wider scope are set before this one and kept."""
    before = dict(os.environ)
    yield
    for k in [k for k in os.environ if k not in before]:
        del os.environ[k]
    for k, v in before.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny():
    from salvage.models import PolicySpec, load_policy

    model, tok = load_policy(PolicySpec("tiny"))
    return model, tok
