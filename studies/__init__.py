"""Hyperparameter studies of set-valued classification losses on Ray Tune and MLflow.

In a notebook or a script, use :mod:`studies.api` (``from studies import api``): ``load``,
``dry_run``, ``run``, ``resume`` and ``report`` do what the ``studies`` command does;
``table`` (one row per finished cell) and ``histories`` (per-epoch metrics, tidy) give a
study's results as pandas DataFrames, swept parameters as columns, accuracies in percent;
``set_output`` (or the ``STUDIES_OUTPUT`` environment variable) sets the output folder once.
Walk-through: docs/notebook.md. The command line: ``studies --help``, docs/commands.md.

Packages, one per stage a study goes through: ``studyfile`` (read and validate a study file),
``cells`` (its (config, seed) cells), ``scheduling``, ``running`` (the Ray Tune runner),
``tracking`` (MLflow), ``cluster`` (submission).
"""
