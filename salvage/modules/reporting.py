"""What a trained module reports: its per-update step metrics, its own rollouts' metrics
and its evaluation metrics.

``StepLog``: metrics recorded during an update go to ``callback_metrics`` at once and to the
loggers once per update (``GRPOModule`` and ``GRAFTModule``). ``PolicyReport``: one
policy's ``rollout/*`` metrics and its ``val/*`` / ``eval/*`` metrics (``GRPOModule``).
"""

from __future__ import annotations

from typing import Any

import lightning as L

from salvage.core.evaluation import repeat_metrics
from salvage.distributed import gather_objects, merge_eval_records
from salvage.metrics import StepMetrics
from salvage.types import RolloutBatch

TRAIN_METRICS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "rollout/zero_signal_frac",
    "rollout/response_len",
    "rollout/verifier_timeouts",
    "rollout/invalid_turn_frac",
    "rollout/truncated_frac",
    "rollout/turns",
    "env/errors",
    "loss/policy",
    "loss/kl",
    "loss/total",
    "loss/clip_frac",
    "loss/peer_clip_frac",
    "loss/nll",
    "loss/ratio_mean",
    "train/grad_norm",
    "train/skipped_updates",
    "perf/rollout_tokens_per_s",
    "perf/update_tokens_per_s",
)


class StepLog(L.LightningModule):
    """Step metrics of the current update, sent to the loggers once, at its end."""

    _step_log: dict[str, float]

    def step_values(self) -> dict[str, float]:
        """The metrics recorded so far in the current update (sent to the loggers at its end)."""
        return dict(self._step_log)

    def record(self, values: dict[str, float]) -> None:
        """Log metrics of the current update (module and callbacks alike).

        Values go to ``callback_metrics`` at once and to the loggers once per update, at
        step = update index, in ``on_train_batch_end``. (Lightning's own on-step logging
        re-sends a key's last value on later steps where it was not logged, which would
        make "no data this step" look like data.)
        """
        self._step_log.update({k: float(v) for k, v in values.items()})
        self.log_dict(values, on_step=True, on_epoch=False, logger=False)

    def record_later(self, values: dict[str, float]) -> None:
        """Buffer metrics for the loggers only (from hooks where ``self.log`` is not allowed)."""
        self._step_log.update({k: float(v) for k, v in values.items()})

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._step_log:
            for lg in self.loggers:
                lg.log_metrics(dict(self._step_log), step=self.global_step - 1)
            self._step_log = {}


class PolicyReport(StepLog):
    """One policy's rollout metrics (into its ``step_metrics``) and evaluation metrics."""

    step_metrics: StepMetrics

    def log_rollout(self, batch: RolloutBatch) -> None:
        """``rollout/*``: this policy's own rollouts (before any exchange replaced groups)."""
        groups = batch.groups if batch.own_groups is None else batch.own_groups
        trajs = [t for g in groups for t in g.trajectories]
        m = self.step_metrics
        for t in trajs:
            m.update("rollout/reward_mean", t.reward)
            m.update("rollout/success_rate", float(t.success))
            m.update("rollout/response_len", float(t.num_response_tokens))
            m.update("rollout/turns", float(len(t.turns)))
            for turn in t.turns:
                m.update("rollout/invalid_turn_frac", float(not turn.valid))
                # responses cut off at engine.max_new_tokens (no EOS, no stop string)
                m.update("rollout/truncated_frac", float(turn.finish_reason == "length"))
        for g in groups:
            m.update("rollout/zero_signal_frac", float(g.zero_signal))
        # returned with the update's metrics (``Learner._finish_update``): GRAFT prefixes them
        self.family_metrics = family_rollout_metrics(groups)
        st = batch.stats
        if st.time_generate is not None and st.time_generate > 0:
            m.update("perf/rollout_tokens_per_s", st.gen_tokens / st.time_generate)
        m.update("rollout/verifier_timeouts", st.verifier_timeouts)
        if st.env_errors is not None:
            m.update("env/errors", st.env_errors)

    # ------------------------------------------------------------------ eval
    def on_validation_epoch_start(self) -> None:
        # one record per evaluated problem: (repeat, benchmark, task id, successes, samples)
        self._eval_records: list[tuple[int, str, str, float, float]] = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_epoch_end(self) -> None:
        self._log_aggregate("val")

    def on_test_epoch_end(self) -> None:
        self._log_aggregate("eval")

    def _log_aggregate(self, prefix: str) -> None:
        """``<prefix>/success`` (over all samples), ``<prefix>/success/<benchmark>`` (pass@1)
        and ``<prefix>/aggregate`` (their unweighted mean, SPEC §3.4) over the problems of all
        ranks, each problem once: every rank logs the same global numbers, so checkpoint
        selection and CheckpointCost see the whole evaluation, not one rank's share."""
        mine = getattr(self, "_eval_records", [])
        merged = merge_eval_records(gather_objects(mine))  # a collective: every rank
        if not merged:
            return
        succ, n = (sum(v[i] for v in merged.values()) for i in (0, 1))
        self.log(
            f"{prefix}/success", succ / max(n, 1.0), on_step=False, on_epoch=True, sync_dist=True
        )
        counts = {k: v for k, v in merged.items() if k[1]}  # groups with a benchmark (family)
        if not counts:
            return
        values = repeat_metrics(prefix, counts)
        if len({r for r, _ in counts}) == 1:  # one run: pass@1 per benchmark and the aggregate
            values = {k: v for k, v in values.items() if "/repeat_" not in k and "_std" not in k}
        for k, v in values.items():
            self.log(k, v, on_step=False, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        self._eval_step(batch, "eval")

    def _log_sampled(self, batch: RolloutBatch, prefix: str) -> None:
        for k, (v, n) in _sampled_metrics(batch, prefix).items():
            self.log(k, v, on_step=False, on_epoch=True, batch_size=n, sync_dist=True)

    def _eval_step(self, batch: RolloutBatch, prefix: str) -> None:
        """Success (pass@1 over samples) overall and per task family / benchmark."""
        trajs = batch.trajectories
        n = len(trajs)
        if not n:
            return
        lens = sum(t.num_response_tokens for t in trajs) / n
        self.log(
            f"{prefix}/response_len",
            lens,
            on_step=False,
            on_epoch=True,
            batch_size=n,
            sync_dist=True,
        )
        if batch.sampled is not None:
            self._log_sampled(batch.sampled, prefix)
        acc = getattr(self, "_eval_records", None)
        if acc is None:
            acc = self._eval_records = []
        for g in batch.groups:  # "": no benchmark (counted in <prefix>/success only)
            fam = g.task.get("family")
            if g.trajectories:
                acc.append(
                    (
                        int(g.task.get("repeat", 0)),
                        str(fam or ""),
                        str(g.task_id),
                        float(sum(t.success for t in g.trajectories)),
                        float(len(g.trajectories)),
                    )
                )


def family_rollout_metrics(groups: list[Any]) -> dict[str, float]:
    """``rollout/success/<family>`` and ``rollout/zero_signal/<family>`` of this update's own
    groups, summed over every process, when the tasks come from two or more families (the
    learning criterion of a study with mixed difficulty reads them per family)."""
    local: dict[str, list[float]] = {}
    for g in groups:
        fam = g.task.get("family")
        if fam and g.trajectories:
            c = local.setdefault(str(fam), [0.0, 0.0, 0.0, 0.0])
            c[0] += sum(bool(t.success) for t in g.trajectories)
            c[1] += len(g.trajectories)
            c[2] += float(g.zero_signal)
            c[3] += 1.0
    total: dict[str, list[float]] = {}
    for part in gather_objects(local):
        for fam, c in part.items():
            acc = total.setdefault(fam, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate(c):
                acc[i] += v
    if len(total) < 2:
        return {}
    out = {}
    for fam, (hits, n, zero, n_groups) in sorted(total.items()):
        out[f"rollout/success/{fam}"] = hits / n
        out[f"rollout/zero_signal/{fam}"] = zero / n_groups
    return out


def _sampled_metrics(batch: RolloutBatch, prefix: str) -> dict[str, tuple[float, int]]:
    """Sampled evaluation episodes: ``<prefix>/sampled_success`` (the share of successful
    samples), ``<prefix>/sampled_pass_at_k`` (the share of tasks with a success among their
    k samples), and ``sampled_success/<family>``; each as (value, count it averages over)."""
    out: dict[str, tuple[float, int]] = {}
    trajs = batch.trajectories
    if not trajs:
        return out
    out[f"{prefix}/sampled_success"] = (sum(t.success for t in trajs) / len(trajs), len(trajs))
    groups = [g for g in batch.groups if g.trajectories]
    out[f"{prefix}/sampled_pass_at_k"] = (
        sum(any(t.success for t in g.trajectories) for g in groups) / len(groups),
        len(groups),
    )
    fams: dict[str, list[bool]] = {}
    for g in groups:
        fam = g.task.get("family")
        if fam:
            fams.setdefault(str(fam), []).extend(bool(t.success) for t in g.trajectories)
    for fam, hits in fams.items():
        out[f"{prefix}/sampled_success/{fam}"] = (sum(hits) / len(hits), len(hits))
    return out
