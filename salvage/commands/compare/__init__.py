"""``salvage compare STUDY_DIR [RUN_DIR ...]``: methods over seeds, as curves and a table.

Inputs: a study dir (``salvage study``'s ``STUDY_DIR/<method>/seed<k>``), method dirs, or
any run dirs; a run's method is its parent folder's name and its seed the number in ``seed<k>`` (else
its position). A run's metrics are all its ``version_*/metrics.csv`` read in version order,
a later version overriding an earlier one at the same step (a resumed run continues the
steps of the one it resumed).

Writes into ``--out`` (default ``STUDY_DIR/compare``, or ``./compare`` for run dirs):

- one PNG per metric: the mean over seeds per method with its 95% t band, for the held-out
  score (``[<model>/]val/success``, else ``[<model>/]val/aggregate``; ``--metric`` names
  others), training success (``rollout/success_rate``), the zero-signal fraction
  (``rollout/zero_signal_frac``), the extra-token ratio (``cost/extra_token_ratio``,
  VH-GPO) and GPU-hours (``cost/gpu_hours``), each where the runs logged it;
- ``compare.md`` (also printed): per held-out metric and method, the final and best
  held-out score and the area under the held-out curve over its step range divided by
  that range (the curve's average), each mean ± 95% CI over seeds (t-distribution, see
  ``salvage.core.stats``); wall time (``cost/wall_s``) relative to the baseline's mean and
  the extra-token ratio (VH-GPO's rescue tokens over the run's own rollout tokens, i.e.
  over what GRPO alone generates at the same batch shape); then the paired comparison with the baseline (``baseline:`` of
  the study, or ``--baseline``): per-seed differences of the final score and the AUC,
  their mean ± CI, over the seeds both have (a warning when the seed sets differ), and
  the power of that comparison on the final score: the paired SD (the sample SD of the
  per-seed differences, n - 1), the minimum detectable difference at 80% power for the n
  seeds run, ``MDD = (t_{0.975, n-1} + t_{0.8, n-1}) * SD / sqrt(n)`` (two-sided paired
  t-test at alpha 0.05, the standard approximation without the noncentral t), and the
  seeds needed for a difference of ``--effect`` (default 0.1): the smallest n >= 2 with
  ``(t_{0.975, n-1} + t_{0.8, n-1}) * SD / sqrt(n) <= effect`` at that SD; "n/a" with one
  paired seed or an SD of 0; above that table, the baseline's own gain on the key (per seed
  its final minus its first validation, mean ± CI; ``--start RUN``: a shared warm start's
  first validation instead, e.g. when runs first validate after update 100), and per
  comparison whether its MDD is at most half that gain;
- GRAFT runs (``exchange.jsonl`` with per-response rows): ``compat_log_s.png``, the
  distribution of ``log s`` per direction (one panel each, one histogram per method, a
  line at ``log delta``), and per method and direction the admitted fraction of the
  correct and of the incorrect transferred responses, pooled over seeds.
"""

from salvage.commands.compare.command import CURVES, OPTIONAL_CURVES, compare, main, plot
from salvage.commands.compare.runs import (
    RunData,
    collect,
    heldout_keys,
    read_exchange,
    read_run,
    read_study_json,
)
from salvage.commands.compare.tables import (
    MAX_SEEDS,
    POWER,
    admission_section,
    power_cells,
    table,
)

__all__ = [
    "CURVES",
    "MAX_SEEDS",
    "OPTIONAL_CURVES",
    "POWER",
    "RunData",
    "admission_section",
    "collect",
    "compare",
    "heldout_keys",
    "main",
    "plot",
    "power_cells",
    "read_exchange",
    "read_run",
    "read_study_json",
    "table",
]
