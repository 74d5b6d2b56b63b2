"""The ``salvage`` subcommands: the shell's top floor, nothing of the library imports it.

- ``cli``: the ``salvage`` command (``python -m salvage``): parses the subcommand and hands
  it to its module, importing Lightning and torch only for the ones that train or load
  models;
- ``fit``: ``salvage fit|validate|test`` (LightningCLI with salvage's defaults);
- ``study``: ``salvage study STUDY.yaml``, every (method, seed) of a study as its own fit;
- ``compare``: ``salvage compare STUDY_DIR|RUN_DIR...``, methods over seeds;
- ``report``: ``salvage report RUN_DIR``, plots and a markdown summary of a run;
- ``export``: ``salvage export CKPT OUT_DIR``, a trained policy as an HF directory;
- ``joint_cost``: ``salvage joint-cost RUN_DIR...``, separate runs' checkpoint costs.

What the commands share with the library (a run's history, its plots, the memory plan of
a config) lives in the library (``salvage.history``, ``salvage.plots``, ``salvage.memory``).
"""

import os

# Hugging Face tokenizers' thread pool off (before any fork: no deadlock warning in workers)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EXIT_STOPPED = 75
"""Exit status of a run stopped by SIGTERM (``EX_TEMPFAIL``): resumable with ``--ckpt_path last``."""
EXIT_INTERRUPTED = 130
"""Exit status of a run stopped by SIGINT (130, the shell's Ctrl-C status): resumable too."""
