"""Loss, metric, data and training core for set-valued (top-K, average-K) classification.

Pure PyTorch: nothing here imports Ray, MLflow or Optuna.
"""

__version__ = "0.1.0"
