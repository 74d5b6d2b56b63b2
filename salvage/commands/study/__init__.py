"""``salvage study STUDY.yaml``: every (method, seed) of a study as its own ``salvage fit`` run.

A study file::

    # salvage study studies/example.yaml
    name: example                 # default: the file's stem
    base: configs/vhgpo/twx_tiny.yaml   # one config or a list, passed first as --config
    baseline: grpo                # the method `salvage compare` compares against
    seeds: [0, 1, 2]
    overrides:                    # common to every method: {dotted.key: value} or "--key value"
      trainer.max_steps: 40
      trainer.val_check_interval: 10
      trainer.check_val_every_n_epoch: null
    methods:                      # name -> list of config fragments and/or overrides
      grpo: [configs/vhgpo/ablations/grpo_baseline.yaml]
      vhgpo: []
      no_pair:
        - {model.init_args.lambda_pair: 0}
        - "--model.init_args.beta 0.2"
    seed_keys: [seed_everything, data.init_args.seed, model.init_args.seed]  # the default
    order: seeds                  # run every method of seed 0, then of seed 1, ... (default: methods)
    ray_resources: {num_gpus: 1, num_cpus: 4}    # optional, --backend ray only
    prepare:                      # optional set-up before the runs (e.g. a shared warm start):
      - creates: runs/warmstart/x_policy        # skipped when this path exists
        run: fit --config configs/... --config studies/warmstart/x.yaml   # salvage arguments
      - creates: runs/warmstart/x_policy
        run: export runs/warmstart/x runs/warmstart/x_policy
    regime:                       # optional: criteria a short calibration run must meet
      method: grpo                # whose run it calibrates (default: the baseline, else the first)
      seed: 0                     # default: the first seed
      overrides: {trainer.max_steps: 3}   # on top of that run's arguments (mapping or strings)
      criteria:                   # metric: a metrics.csv column; one of ">=", "<=", ">", "<"
        - {metric: rollout/zero_signal_frac, steps: [1, 3], stat: mean, ">=": 0.6}
        - {metric: graft/admitted_frac, stat: last, ">=": 0.3}
        - {method: vhgpo, metric: relay/retained, stat: mean, ">=": 0.5}   # another method's run

Method names are plain names (letters, digits, ``_ . -``, not starting with ``.`` or ``-``).
Paths (``base`` and fragments): absolute, or relative to the study file's folder if the file
is there, else relative to the current directory. A mapping item's values are passed as
YAML text (lists and mappings as JSON). Each run gets, in this order (later wins):
``--config`` for each base config, the common overrides, ``--config`` for each of the
method's fragments, the method's overrides, then ``--<key> k`` for every seed key and
``--trainer.default_root_dir STUDY_DIR/<method>/seed<k>``; so a method's own switches win
over the common settings (e.g. a budget-matched baseline's ``group_size``).
The seed reaches the sampling streams through ``data.init_args.seed`` and the minibatch
order through ``model.init_args.seed`` (``seed_everything`` alone does not change them);
task sets (``data.init_args.train.seed``) and model initialisations stay those of the config.

Regime checks: with a ``regime:`` block, before any record run starts, the study runs the
calibration, the method's run for that seed plus the regime's overrides (they come after the
seed keys), in ``STUDY_DIR/_calibration/<method>/seed<k>`` (like any run: resumable,
``done.json``, reused on later calls), then evaluates each criterion on its metrics.csv
(all ``version_*``, later versions winning): ``stat`` (``mean``, the default; ``min``,
``max``, ``last``) of the metric over the updates ``steps: [first, last]`` (1-based,
inclusive; default every logged update) compared with the threshold. Update k is the
``step`` value k - 1 of metrics.csv (Lightning logs update k, and the validation after it, at
step k - 1), one value per update. A criterion with its own ``method`` is measured on that
method's calibration run (same seed and overrides; every calibrated method runs, in
parallel). It prints a table (metric, value, threshold,
pass/FAIL) and writes ``STUDY_DIR/regime.json`` (the values, pass/fail, the calibration's
command, when checked). When a criterion fails, or names a metric the calibration did not log
(the failure lists the logged names), no record run starts and the study exits 3 with one
``regime: FAIL`` line per failed criterion; ``--skip-regime`` still runs and records the
check but starts the record runs anyway (``"skipped": true`` in regime.json and study.json).

The study dir (``--out``; default ``runs/studies/<name>``) holds ``study.json`` (the study as
run) and one run dir per (method, seed). A run that exited 0 has ``done.json`` (its command
and exit code) and is skipped on later calls; a run without it is started again, resuming
through ``--ckpt_path last`` when the run dir holds a ``last.ckpt``, so a study interrupted at
any point finishes on the next call. ``--methods a,b`` and ``--seeds 0,2`` start only
those record runs (the prepare steps and the regime check run as always; an unknown name or
seed is an error before any run). A run stopped by a signal (``salvage fit`` exits 75 on
SIGTERM, 130 on SIGINT) is "stopped", never done.

Processes and locks: each run's ``salvage fit`` is its own session (``RUN/child.pid`` holds
its pid while it runs) and, on Linux, gets SIGTERM if the study process dies (even by
``kill -9``). SIGTERM or SIGINT (Ctrl-C) to the study sends SIGTERM to each running fit (it
ends its update, checkpoints and exits 75), starts no further run, waits for them and exits
75 (130 for SIGINT); a second signal kills the fits' process groups. ``STUDY_DIR/.lock``
(held while the study runs; it records pid, host and start time) makes a second ``salvage
study`` on the same dir exit 2 naming the holder; ``RUN/.lock``, held by the study and the fit
while a run goes, keeps two processes out of one run dir. The locks are ``flock`` locks: the
kernel drops them when their holders exit, so a crash leaves none behind.
Exit codes: 0 every run done; 1 a run, a prepare step or the calibration failed; 2 a bad study
file or a locked study dir; 3 the regime check failed; 75 (130) the study or a run was stopped
by SIGTERM (SIGINT): call it again to resume. Runs go one after another (``--backend local``; ``--jobs
N`` runs N at a time, each its own process) or as
one Ray task each (``--backend ray``; resources from ``ray_resources`` or else from the
config: ``num_gpus = trainer.devices`` when ``trainer.accelerator`` is gpu/cuda, or auto on
a cluster with GPUs; the study dir must be on a filesystem every Ray node sees; a run whose
task is lost with its node is not retried by Ray: it fails and resumes on the next call). Each run's environment sets
``WANDB_RUN_GROUP`` = study name, ``WANDB_JOB_TYPE`` = method and ``WANDB_NAME`` =
``<method>-seed<k>``, so W&B overlays the methods of a study without set-up (add
``--config configs/logger/wandb.yaml`` to ``base``; ``wandb.init`` reads these variables,
and a ``group`` / ``job_type`` set in the config wins). ``salvage compare`` reads the CSV
logger's ``metrics.csv``, which ``salvage fit`` keeps beside a W&B logger.

Modules: ``spec`` (the study file, parsed and planned into runs), ``regime`` (the regime
check), ``runner`` (processes, locks, signals, the local and Ray backends), ``command``
(``salvage study`` itself).
"""

from salvage.commands.study.command import main, run_study
from salvage.commands.study.regime import EXIT_REGIME, Verdict, check_regime, evaluate, regime_table
from salvage.commands.study.runner import (
    EXIT_BUSY,
    EXIT_FAILED,
    STOPPED,
    Busy,
    execute,
    forwarding_signals,
    lock,
    ray_resources,
    run_env,
)
from salvage.commands.study.spec import (
    CALIBRATION_DIR,
    COMPARISONS,
    DEFAULT_SEED_KEYS,
    STATS,
    STUDY_KEYS,
    Criterion,
    Regime,
    Run,
    Study,
    calibration_runs,
    load_study,
    plan,
)

__all__ = [
    "CALIBRATION_DIR",
    "COMPARISONS",
    "DEFAULT_SEED_KEYS",
    "EXIT_BUSY",
    "EXIT_FAILED",
    "EXIT_REGIME",
    "STATS",
    "STOPPED",
    "STUDY_KEYS",
    "Busy",
    "Criterion",
    "Regime",
    "Run",
    "Study",
    "Verdict",
    "calibration_runs",
    "check_regime",
    "evaluate",
    "execute",
    "forwarding_signals",
    "load_study",
    "lock",
    "main",
    "plan",
    "ray_resources",
    "regime_table",
    "run_env",
    "run_study",
]
