"""Validate once before the first update, so a run's held-out curve starts where its
training starts (after any warm start a callback makes in ``on_fit_start``).

A study's baseline gain on held-out data (``salvage compare``: final minus the first
validation, per seed) is then the whole run's, not the part after the first
``val_check_interval`` updates. The start point is logged at ``step`` 0, beside update 1's
training metrics; a resumed fit (``global_step > 0``) does not validate again.
"""

from __future__ import annotations

import lightning as L


class ValidateFirst(L.Callback):
    """Run the validation loop once in ``on_train_start``, before update 1.

    Add it to ``trainer.callbacks`` after any warm-start callback (OracleSFT, AnswerSFT run in
    ``on_fit_start``, before this one in any order)."""

    def __init__(self) -> None:
        self.ran = False
        """Whether this fit validated before its first update."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != 0 or not trainer.enable_validation:
            return
        loop = trainer.fit_loop.epoch_loop.val_loop
        # as the training epoch loop does around its own validation
        first_iter = trainer._logger_connector._first_loop_iter
        trainer.validating = True
        loop.run()
        trainer.training = True
        trainer._logger_connector._first_loop_iter = first_iter
        self.ran = True
