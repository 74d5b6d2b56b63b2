"""``salvage fit|validate|test``: LightningCLI with salvage's defaults.

- ``salvage fit|validate|test --config configs/....yaml``; every constructor argument of
  the module, datamodule and callbacks is a config key (``salvage fit --help``).
- ``salvage test ... --repeats N``: N evaluation runs, mean ± std (``salvage.callbacks.repeats``).
- ``rescue``: VH-GPO's rescue stage (``salvage.callbacks.relay``) as its own key, so an
  ablation fragment changes only it (``trainer.callbacks`` lists replace each other).
- omegaconf parser mode: YAMLs may interpolate (``${data.group_size}``).
- Default logger: CSV under ``trainer.default_root_dir`` (``version_N/metrics.csv``);
  W&B by config (``--config configs/logger/wandb.yaml``): a config's W&B logger runs as
  ``salvage.loggers.WandbLogger`` and always beside a CSV logger, which comes first and names
  the run directory (W&B's files go there too); ``WandbDashboard`` (always on unless the
  config lists its own) adds tables and plots.
- Always on: ``CostTracker`` (GPU-hours), ``CheckpointCost`` (GPU-hours through each model's
  best validation, and the joint cost; printed by ``salvage test``) and ``RunSummary`` (a
  table at the end of fit); unless the config has its own ``ModelCheckpoint``,
  ``last.ckpt`` is refreshed after every update, so a crashed run resumes with
  ``salvage fit ... --ckpt_path last``. One step of the trainer = one RL update.
- ``--print_memory true``: the per-phase, per-GPU memory estimate of a fit config
  (``salvage.memory``), before any weights are loaded.
- Exit status: 75 (``EX_TEMPFAIL``) when stopped by SIGTERM (Lightning ends the update in
  flight, ``last.ckpt`` holds it: resume with ``--ckpt_path last``); 130 when stopped by
  SIGINT (Ctrl-C; ``last.ckpt`` holds the last finished update, so it resumes the same
  way). A run that exits 75 or 130 is never "done": ``salvage study`` resumes it on its
  next call.

This module imports Lightning (and through the callbacks torch): ``salvage.commands.cli``
imports it only for these subcommands.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import set_parsing_settings
from jsonargparse._common import debug_mode_active
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from salvage.callbacks.cost import CheckpointCost, CostTracker
from salvage.callbacks.dashboard import WandbDashboard
from salvage.callbacks.repeats import RepeatTable, repeats_argv
from salvage.callbacks.summary import RunSummary
from salvage.checkpointing import (
    RESUMABLE_KEYS,
    RunConfigRecorder,
    SafeCheckpointIO,
    config_diff,
    find_last_checkpoint,
    read_checkpoint,
)
from salvage.commands import EXIT_INTERRUPTED, EXIT_STOPPED
from salvage.commands.parse_errors import one_line
from salvage.errors import ConfigError, user_error
from salvage.loggers import SafeCSVLogger, WandbLogger

# dataclass fields document themselves with a string under the field: show it in --help
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class ResumeError(ConfigError):
    """A resume that would continue another run, or this run under other settings."""


def _stored_config(ckpt: Path) -> str | None:
    """The resolved config YAML a checkpoint was written under (``salvage_config``), if any;
    a checkpoint that cannot be read is a ``ConfigError`` naming it (``read_checkpoint``)."""
    if ckpt.is_dir() and not (ckpt / "meta.pt").exists():
        return None  # a distributed checkpoint without Lightning's meta file
    return read_checkpoint(ckpt).get("salvage_config")


def print_memory(cfg: dict[str, Any]) -> None:
    """The per-phase, per-GPU memory estimate of a fit config, on stdout."""
    from salvage.core.memory import estimate, format_estimate
    from salvage.memory import plan_from_config

    plan = plan_from_config(cfg)
    print(format_estimate(plan, estimate(plan)))


def _option_strings(parser: Any) -> list[str]:
    """Every option a parser and its subcommands' parsers take (``--trainer.max_steps``)."""
    out = list(getattr(parser, "_option_string_actions", {}))
    subs = getattr(parser, "_subcommands_action", None)
    for sub in (getattr(subs, "_name_parser_map", None) or {}).values():
        out += list(getattr(sub, "_option_string_actions", {}))
    return out


class SalvageArgumentParser(LightningArgumentParser):
    """A parse or instantiation error caused by a ``SalvageError`` (a config value a salvage
    class refused) is raised as that error, so ``main`` prints its one line, not
    jsonargparse's usage and dump of every union member."""

    def error(self, message: str, ex: Exception | None = None) -> Any:
        err = user_error(ex) if ex is not None else None
        if err is not None:
            raise err
        if not self.exit_on_error or debug_mode_active() or "subcommand" in message:
            return super().error(message, ex)  # caught inside, --debug, or a bare `salvage`
        # one line naming the key, the value and the reason, not the usage text above it
        parser = getattr(ex, "subcommand_parser", None) or self
        line = one_line(message, options=_option_strings(parser))
        print(f"salvage: error: {line}", file=sys.stderr, flush=True)
        raise SystemExit(2)


class SalvageCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", SalvageArgumentParser)
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault(
            "trainer_defaults",
            {
                "num_sanity_val_steps": 0,
                "log_every_n_steps": 1,
                "enable_model_summary": False,
                "callbacks": [
                    CostTracker(),
                    CheckpointCost(),
                    RunSummary(),
                    RepeatTable(),
                    WandbDashboard(),
                ],
            },
        )
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        from salvage.callbacks.relay import RescueCallback

        parser.add_lightning_class_args(
            RescueCallback, "rescue", subclass_mode=True, required=False
        )

        parser.add_argument(
            "--allow_config_change",
            type=bool,
            default=False,
            help="Resume (--ckpt_path) even when the config differs from the checkpoint's in "
            "keys that are not resumable (the differing keys are printed as a warning).",
        )
        parser.add_argument(
            "--print_memory",
            type=bool,
            default=False,
            help="Print the estimated memory per GPU of each phase (rollout, update) for this "
            "config and exit, before any weights are loaded (salvage.core.memory).",
        )

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a stop by signal exits 75 (SIGTERM) or 130 (SIGINT), never 0.

        Lightning turns SIGTERM into ``SIGTERMException`` (a ``SystemExit`` without a code, so
        status 0) after the update in flight, whose checkpoint is then written, and SIGINT
        into ``sys.exit(1)``; salvage names both.
        """
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            raise SystemExit(self._stopped("SIGTERM", EXIT_STOPPED)) from None
        except SystemExit as e:
            if isinstance(e.__context__, KeyboardInterrupt):
                raise SystemExit(self._stopped("SIGINT", EXIT_INTERRUPTED)) from None
            raise
        except KeyboardInterrupt:
            raise SystemExit(self._stopped("SIGINT", EXIT_INTERRUPTED)) from None

    def _stopped(self, what: str, code: int) -> int:
        """The line a stopped run prints; returns its exit status."""
        trainer = getattr(self, "trainer", None)
        step = getattr(trainer, "global_step", None)
        after = f" after {step} update(s)" if step is not None else ""
        resume = (
            "; resume with the same command and --ckpt_path last"
            if self.subcommand == "fit"
            else ""
        )
        print(
            f"salvage: {self.subcommand} stopped by {what}{after} (exit {code}){resume}",
            file=sys.stderr,
            flush=True,
        )
        return code

    def _set_seed(self) -> None:
        """Lightning's, after the seed's range is checked (numpy's error, a traceback, else)."""
        check_seed(self._get(self.config, "seed_everything"))
        super()._set_seed()

    def _parse_ckpt_path(self) -> None:
        """Never read settings from a checkpoint into the config.

        LightningCLI merges a checkpoint's hyper-parameters into the config; salvage does not:
        the user's config and command line decide what runs (the model source and
        ``trust_remote_code`` included), and a resume is *checked* against the checkpoint's
        stored config instead (``before_instantiate_classes``).
        """

    def before_instantiate_classes(self) -> None:
        """Checks that need no weights: max_steps, the run dir, a resume's config."""
        sub = self.subcommand
        upgrade_wandb_logger((self.config[sub] if sub else self.config).get("trainer") or {})
        if sub is None:
            return
        if sub == "fit":  # refused before anything is built
            check_max_steps(self.config.get("fit.trainer.max_steps"))
            if self.config[sub].get("print_memory"):
                print_memory(self.config[sub].as_dict())
                raise SystemExit(0)
        cfg = self.config[sub]
        if not cfg.trainer.get("default_root_dir"):
            # one folder per config under runs/, never the current directory itself
            files = [str(c) for c in (cfg.get("config") or []) if c]
            stem = Path(files[0]).stem if files else "salvage"
            cfg.trainer.default_root_dir = os.path.join("runs", stem)
        root = cfg.trainer.default_root_dir
        check_run_dir(root)
        check_accelerator(cfg.trainer.get("accelerator"))
        self._run_config_yaml = self._parser(sub).dump(cfg, skip_none=False, skip_validation=True)
        if cfg.get("ckpt_path") == "last":  # this run dir's newest checkpoint, any version
            found = find_last_checkpoint(root)
            if found is None:
                print(
                    f"salvage: --ckpt_path last: no checkpoint under {root}; starting a new run",
                    file=sys.stderr,
                )
            cfg.ckpt_path = None if found is None else str(found)
        if cfg.get("ckpt_path") in (None, "hpc", "registry"):
            return
        path = Path(cfg.ckpt_path)
        if not path.exists():
            raise ResumeError(f"--ckpt_path {path}: no such checkpoint")
        if path.is_dir() and not (path / "meta.pt").exists():
            raise ResumeError(
                f"--ckpt_path {path} is a directory, not a checkpoint (a run keeps them as "
                "RUN/version_N/checkpoints/last.ckpt; --ckpt_path last finds the newest)"
            )
        stored = _stored_config(path)  # a checkpoint that cannot be read stops here
        if sub != "fit":
            return  # evaluating a checkpoint under another config is normal; weights must fit
        if stored is None:
            print(
                f"salvage: warning: {path} holds no run config (written by an older salvage); "
                "resuming without checking that the settings match",
                file=sys.stderr,
            )
            return
        diff = config_diff(yaml.safe_load(stored) or {}, yaml.safe_load(self._run_config_yaml))
        if diff:
            shown = ", ".join(diff[:12]) + (f" (+{len(diff) - 12} more)" if len(diff) > 12 else "")
            if not cfg.get("allow_config_change"):
                raise ResumeError(
                    f"--ckpt_path {path} was written under another config; differing keys: "
                    f"{shown}. Resume only with the same settings (may change: "
                    f"{', '.join(k for k in RESUMABLE_KEYS if '.' in k)}), or pass "
                    "--allow_config_change true"
                )
            print(f"salvage: warning: resuming {path} with changed keys: {shown}", file=sys.stderr)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        callbacks = [c for c in callbacks if c is not None]  # `rescue: null`: no rescue stage
        # crash safety: unless the config brings its own ModelCheckpoint, keep `last.ckpt`
        # up to date after every update, so `salvage fit --ckpt_path last` loses one step
        cbs = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(c, ModelCheckpoint) for c in cbs
        ):
            # no dirpath: Lightning puts it in this run's RUN/version_N/checkpoints (the
            # logger's version), so two runs in one RUN never share or shadow checkpoints
            callbacks = [
                *callbacks,
                ModelCheckpoint(save_last=True, every_n_train_steps=1, save_top_k=0),
            ]
        if any(isinstance(c, WandbDashboard) for c in cbs):  # the config's own, configured one
            self.trainer_defaults["callbacks"] = [
                c for c in self.trainer_defaults["callbacks"] if not isinstance(c, WandbDashboard)
            ]
        callbacks = [*callbacks, RunConfigRecorder(getattr(self, "_run_config_yaml", ""))]
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in cbs
        ):
            from salvage.progress import update_progress_bar

            callbacks = [*callbacks, update_progress_bar()]
        plugins = config.get("plugins")
        plugins = [] if plugins is None else plugins if isinstance(plugins, list) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            config["plugins"] = [*plugins, SafeCheckpointIO()]
        return super()._instantiate_trainer(config, callbacks)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        cfg = self._get(self.config_init, "trainer", default={})
        root = cfg.get("default_root_dir") or os.path.join("runs", "salvage")
        logger = cfg.get("logger")
        if logger in (None, True):
            kwargs["logger"] = SafeCSVLogger(save_dir=root, name="", flush_logs_every_n_steps=1)
        elif logger is not False:
            loggers = logger if isinstance(logger, list) else [logger]
            if any(isinstance(lg, LightningWandbLogger) for lg in loggers):
                kwargs["logger"] = self._with_csv(loggers, root)
        return super().instantiate_trainer(**kwargs)

    def _with_csv(self, loggers: list[Any], root: str) -> list[Any]:
        """W&B beside a CSV logger, the CSV logger first: it names the run directory
        (``RUN/version_N``: checkpoints, ``config.yaml``, ``metrics.csv``, and W&B's files),
        and it keeps every metric when W&B fails."""
        csv = next((lg for lg in loggers if isinstance(lg, CSVLogger)), None)
        if csv is None:
            csv = SafeCSVLogger(save_dir=root, name="", flush_logs_every_n_steps=1)
        ckpt = self._get(self.config_init, "ckpt_path")
        config_yaml = getattr(self, "_run_config_yaml", None)
        for lg in loggers:
            if isinstance(lg, WandbLogger):
                lg.bind(lambda: csv.log_dir, ckpt, config_yaml)
        return [csv, *(lg for lg in loggers if lg is not csv)]


_LIGHTNING_WANDB = {
    "lightning.pytorch.loggers.WandbLogger",
    "lightning.pytorch.loggers.wandb.WandbLogger",
    "pytorch_lightning.loggers.WandbLogger",
    "pytorch_lightning.loggers.wandb.WandbLogger",
}


def upgrade_wandb_logger(trainer_cfg: Any) -> None:
    """A config's Lightning ``WandbLogger`` runs as ``salvage.loggers.WandbLogger`` (a subclass
    taking the same arguments): the update axis, the run directory, resumes, no failed runs."""
    logger = trainer_cfg.get("logger")
    for lg in logger if isinstance(logger, list) else [logger]:
        if hasattr(lg, "get") and lg.get("class_path") in _LIGHTNING_WANDB:
            lg.class_path = "salvage.loggers.WandbLogger"


def check_max_steps(max_steps: Any) -> None:
    """``trainer.max_steps`` of a fit: -1 (no limit: ``max_epochs`` ends the run) or >= 1."""
    if max_steps is not None and (max_steps == 0 or max_steps < -1):
        raise ConfigError(
            f"trainer.max_steps must be >= 1 (or -1: no step limit), got {max_steps}: "
            "a fit of 0 updates would train nothing"
        )


def check_run_dir(root: str) -> None:
    """``trainer.default_root_dir`` is (or can be made) a directory this process can write:
    not a file, not under a file, not read-only. Creates it."""
    path = Path(root)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"trainer.default_root_dir {root!r} is a file, not a directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(
                    f"trainer.default_root_dir {root!r}: {str(parent)!r} is a file, not a directory"
                )
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".salvage-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"trainer.default_root_dir {root!r} is not writable: {e.strerror or e}"
        ) from None


def check_accelerator(accelerator: Any) -> None:
    """``trainer.accelerator`` gpu/cuda needs a CUDA device, mps an Apple GPU: refused before
    anything loads, not in Lightning's traceback."""
    name = str(accelerator).lower() if isinstance(accelerator, str) else None
    if name in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator {accelerator!r}: this machine has no CUDA GPU "
                "(torch.cuda.is_available() is False); use cpu or auto"
            )
    elif name == "mps":
        import torch

        if not torch.backends.mps.is_available():
            raise ConfigError(f"trainer.accelerator {accelerator!r}: no MPS device here")


SEED_MAX = 2**32 - 1  # numpy's RNG, which Lightning's seed_everything seeds too


def check_seed(seed: Any) -> None:
    """``seed_everything`` an integer in [0, 2**32 - 1] (or true/false/null)."""
    if isinstance(seed, bool) or seed is None:
        return
    if not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"seed_everything must be an integer in [0, {SEED_MAX}], got {seed!r}")


def check_config_files(argv: list[str]) -> None:
    """Every ``--config FILE`` on the command line is readable YAML holding a mapping.

    jsonargparse reports a YAML error without saying which of several files holds it.
    """
    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--config", "-c")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if os.path.isdir(path):
            raise ConfigError(f"--config {path!r} is a directory; expected a YAML file")
        if not os.path.isfile(path):
            if os.path.splitext(path)[1] in (".yaml", ".yml"):
                raise ConfigError(f"config file {path!r} does not exist")
            continue  # jsonargparse also takes inline YAML here
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except UnicodeDecodeError:
            raise ConfigError(f"config file {path!r} is not UTF-8 text") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file {path!r} is not valid YAML: {what}{where}") from None
        if data is not None and not isinstance(data, dict):
            raise ConfigError(
                f"config file {path!r} holds a {type(data).__name__}; expected a mapping of keys"
            )


def run_trainer(argv: list[str], from_sys_argv: bool = False) -> None:
    """``salvage fit|validate|test ARGS`` (no subcommand: LightningCLI's help), after
    ``--repeats`` is expanded and every ``--config`` file is checked; ``from_sys_argv``:
    LightningCLI reads ``sys.argv`` (set to ``argv`` here)."""
    argv = repeats_argv(argv)  # salvage test --repeats N (salvage.callbacks.repeats)
    check_config_files(argv)
    if from_sys_argv:
        sys.argv[1:] = argv  # without --debug; LightningCLI reads sys.argv itself
    try:
        SalvageCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=None if from_sys_argv else argv,
            auto_configure_optimizers=False,
        )
    except KeyboardInterrupt:  # Ctrl-C while parsing or building, before the trainer ran
        print("salvage: stopped by SIGINT", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
