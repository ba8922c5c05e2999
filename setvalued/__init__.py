"""Loss, metric, data and training core for set-valued (top-K, average-K) classification.

Pure PyTorch: nothing here imports Ray, MLflow or Optuna.
"""

#: the version of the distribution (pyproject.toml reads it here; CHANGELOG.md has its entries)
__version__ = "0.2.0"
