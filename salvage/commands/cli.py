"""The ``salvage`` command (``python -m salvage``): one subcommand per module of
``salvage.commands``.

- ``salvage fit|validate|test --config configs/....yaml``: LightningCLI with salvage's
  defaults (``salvage.commands.fit``; ``salvage fit --help``).
- ``salvage study STUDY.yaml``: every (method, seed) of a study as its own fit
  (``salvage.commands.study``).
- ``salvage compare STUDY_DIR|RUN_DIR...``: methods over seeds, curves and a table
  (``salvage.commands.compare``).
- ``salvage report RUN_DIR``: PNG plots and a markdown summary of a run
  (``salvage.commands.report``).
- ``salvage joint-cost RUN_A RUN_B``: separate runs' best-checkpoint GPU-hours and their sum
  (``salvage.commands.joint_cost``).
- ``salvage export CKPT OUT_DIR``: a trained policy as an HF directory
  (``salvage.commands.export``).

Only the subcommand's own module is imported: Lightning and torch load for ``fit``,
``validate``, ``test`` and ``export``, never for ``study`` (the parent process), ``compare``,
``report`` or ``joint-cost``.

- A user error (``salvage.errors.SalvageError``: a bad data file, config value or model
  path; an unreadable ``--config`` YAML) prints one line ``salvage: error: ...`` naming
  the file or key and exits with status 2; ``--debug`` anywhere shows the traceback;
  ``--verbose`` keeps the third-party messages that are silenced by default.
- A rollout engine that failed twice (the second time rebuilt; a generate timeout included)
  is one line ``salvage: error: rollout engine failed ...``, exit 1 (``--debug``: traceback).
- Exit status: 0 when the subcommand finished; 2 for a user error; 75 (``EX_TEMPFAIL``) when
  ``fit``/``validate``/``test`` was stopped by SIGTERM, 130 when stopped by SIGINT (both
  resumable with ``--ckpt_path last``); anything else is a failure.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from salvage.commands import EXIT_INTERRUPTED, EXIT_STOPPED
from salvage.errors import in_chain, user_error

__all__ = ["EXIT_INTERRUPTED", "EXIT_STOPPED", "main", "quiet_third_parties", "user_error"]

LIGHT_SUBCOMMANDS = ("study", "compare", "report", "joint-cost")
"""Subcommands that import neither Lightning nor torch nor transformers: they start fast."""


def _subcommand(name: str) -> Callable[[list[str]], None] | None:
    """The ``main(argv)`` of a subcommand that is not a LightningCLI one; None for those."""
    if name == "report":
        from salvage.commands.report import main as report_main

        return report_main
    if name == "joint-cost":  # separate runs' checkpoint costs and their sum
        from salvage.commands.joint_cost import main as joint_cost_main

        return joint_cost_main
    if name == "export":
        from salvage.commands.export import main as export_main

        return export_main
    if name == "study":
        from salvage.commands.study import main as study_main

        return study_main
    if name == "compare":
        from salvage.commands.compare import main as compare_main

        return compare_main
    return None


def _run(argv: list[str], from_sys_argv: bool = False, quiet: bool = True) -> None:
    """Import the subcommand's module, then (``quiet``) silence the third parties: after the
    import, since Lightning sets its loggers to INFO when it is imported."""
    command = _subcommand(argv[0]) if argv else None
    if command is None:
        from salvage.commands.fit import run_trainer
    if quiet:
        quiet_third_parties(heavy=not argv or argv[0] not in LIGHT_SUBCOMMANDS)
    if command is not None:
        command(argv[1:])
        return
    run_trainer(argv, from_sys_argv)


def quiet_third_parties(heavy: bool = True) -> None:
    """Silence what other libraries print that a salvage user cannot act on: Lightning's
    start-up info and tips, deprecation and "possible user" warnings, transformers' weight
    loading bars (``heavy``: only for the subcommands that import transformers anyway).
    ``--verbose`` keeps them."""
    import logging
    import warnings

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", module=r"lightning(\..*)?$")
    warnings.filterwarnings("ignore", message=r".*(LeafSpec|litlogger|LitLogger).*")
    if not heavy:
        return
    # vLLM (imported later, when an engine is built) reads its level from the environment,
    # and its workers inherit it: start-up INFO and WARNING lines only with --verbose
    level = logging.getLevelName(os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR").upper())
    # ... but some of its modules log while they are imported, before vLLM configures its
    # loggers (triton_utils: "Triton is installed, but doesn't include CPU backend"): the
    # level of the "vllm" logger is set here, ahead of them
    if isinstance(level, int):
        logging.getLogger("vllm").setLevel(level)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def _run_debug(argv: list[str], from_sys_argv: bool) -> None:
    """``--debug``: parse errors with their traceback too (``JSONARGPARSE_DEBUG``)."""
    before = os.environ.get("JSONARGPARSE_DEBUG")
    os.environ["JSONARGPARSE_DEBUG"] = "true"
    try:
        _run(argv, from_sys_argv, quiet=False)
    finally:
        if before is None:
            os.environ.pop("JSONARGPARSE_DEBUG", None)
        else:
            os.environ["JSONARGPARSE_DEBUG"] = before


def _engine_error(exc: BaseException) -> BaseException | None:
    """The ``RolloutEngineError`` behind ``exc`` (a rollout engine that failed on a rebuilt
    engine too), if any: the class is looked up only when the rollout module is loaded."""
    cls = getattr(sys.modules.get("salvage.rollout.config"), "RolloutEngineError", None)
    return None if cls is None else in_chain(exc, cls)


def main(args: list[str] | None = None) -> None:
    """Run a subcommand; a user error is one line on stderr (exit 2), ``--debug`` re-raises,
    ``--verbose`` keeps third-party messages (silenced by default)."""
    argv = sys.argv[1:] if args is None else list(args)
    debug = "--debug" in argv
    verbose = "--verbose" in argv or debug
    argv = [a for a in argv if a not in ("--debug", "--verbose")]
    if debug:
        _run_debug(argv, args is None)
        return
    if not verbose:  # torch's C++ warnings (vLLM's CPU worker: "NUMA binding: ...") are
        # set by the environment before torch is imported, which the subcommands do
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        _run(argv, args is None, quiet=not verbose)
    except Exception as e:  # noqa: BLE001 - only user errors are shortened, the rest re-raised
        err = user_error(e)
        if err is None:
            engine = _engine_error(e)
            if engine is None:
                raise
            # an engine that failed twice (a timeout included): its one line, exit 1
            msg = " ".join(str(engine).split())
            print(f"salvage: error: {msg} (--debug for the traceback)", file=sys.stderr)
            raise SystemExit(1) from None
        msg = " ".join(str(err).split())
        print(f"salvage: error: {msg}", file=sys.stderr)
        raise SystemExit(2) from None


_MOVED_TO_FIT = frozenset(
    {
        "SalvageCLI",
        "SalvageArgumentParser",
        "ResumeError",
        "print_memory",
        "check_config_files",
        "check_max_steps",
        "upgrade_wandb_logger",
        "run_trainer",
    }
)


def __getattr__(name: str) -> object:
    """The LightningCLI pieces this module held before ``salvage.commands.fit`` (imported on
    first use, so importing this module stays free of Lightning)."""
    if name in _MOVED_TO_FIT:
        from salvage.commands import fit

        return getattr(fit, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":  # pragma: no cover
    main()
