"""The ``salvage`` console script: LightningCLI with salvage's defaults.

- ``salvage report RUN_DIR``: PNG plots and a markdown summary of a run (``salvage.report``).
- ``salvage export CKPT OUT_DIR``: a trained policy as an HF directory (``salvage.export``).
- ``salvage fit|validate|test --config configs/....yaml``; every constructor argument of
  the module, datamodule and callbacks is a config key (``salvage fit --help``).
- omegaconf parser mode: YAMLs may interpolate (``${data.group_size}``).
- Default logger: CSV under ``trainer.default_root_dir`` (``version_N/metrics.csv``);
  W&B by config (``trainer.logger: lightning.pytorch.loggers.WandbLogger``).
- Always on: ``CostTracker`` (GPU-hours), ``CheckpointCost`` (GPU-hours through each model's
  best validation, and the joint cost; printed by ``salvage test``) and ``RunSummary`` (a table at the end of fit);
  unless the config has its own ``ModelCheckpoint``, ``last.ckpt`` is refreshed after every
  update, so a crashed run resumes with ``salvage fit ... --ckpt_path last``. One step of the trainer = one RL update.
"""

from __future__ import annotations

import os
import sys
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningCLI  # noqa: E402

from salvage.callbacks.cost import CheckpointCost, CostTracker  # noqa: E402
from salvage.callbacks.summary import RunSummary  # noqa: E402
from salvage.loggers import SafeCSVLogger  # noqa: E402


class SalvageCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_kwargs", {"parser_mode": "omegaconf"})
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault(
            "trainer_defaults",
            {
                "num_sanity_val_steps": 0,
                "log_every_n_steps": 1,
                "enable_model_summary": False,
                "callbacks": [CostTracker(), CheckpointCost(), RunSummary()],
            },
        )
        super().__init__(*args, **kwargs)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        # crash safety: unless the config brings its own ModelCheckpoint, keep `last.ckpt`
        # up to date after every update, so `salvage fit --ckpt_path last` loses one step
        cbs = list(config.get("callbacks") or []) + list(callbacks)
        if config.get("enable_checkpointing", True) is not False and not any(
            isinstance(c, ModelCheckpoint) for c in cbs
        ):
            # one folder per run dir (not per logger version), so "last" is found on resume
            root = config.get("default_root_dir") or os.getcwd()
            callbacks = [
                *callbacks,
                ModelCheckpoint(
                    dirpath=os.path.join(root, "checkpoints"),
                    save_last=True,
                    every_n_train_steps=1,
                    save_top_k=0,
                ),
            ]
        return super()._instantiate_trainer(config, callbacks)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        cfg = self._get(self.config_init, "trainer", default={})
        if cfg.get("logger") in (None, True):
            root = cfg.get("default_root_dir") or os.getcwd()
            kwargs["logger"] = SafeCSVLogger(save_dir=root, name="", flush_logs_every_n_steps=1)
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "report":
        from salvage.report import main as report_main

        report_main(argv[1:])
        return
    if argv and argv[0] == "export":
        from salvage.export import main as export_main

        export_main(argv[1:])
        return
    if argv and argv[0] in ("study", "compare"):
        from salvage import compare, study

        (study.main if argv[0] == "study" else compare.main)(argv[1:])
        return
    SalvageCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        auto_configure_optimizers=False,
    )


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
