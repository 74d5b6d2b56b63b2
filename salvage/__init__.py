"""salvage: RL for language models that turns all-failure GRPO groups into signal.

Importing the package is cheap: heavy or optional dependencies (transformers models,
vllm, wandb, environments) are imported where they are used.
"""

__version__ = "0.1.0"
