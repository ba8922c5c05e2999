"""Analysis of finished studies: MLflow runs to tables, confidence intervals, figures, reports.

- `analysis.collect`: one Arrow row per finished cell, failed cells listed, Parquet export;
- `analysis.stats`: mean and CI over seeds, paired comparisons by seed, Holm correction;
- `analysis.plots`: sensitivity curves, epoch time vs K, label noise, shot-group bars;
- `analysis.report`: the HTML + Markdown report of a study (`studies report NAME`), built
  from `report_schema` (the study file's `report`/`reference` blocks), `study_file`,
  `results`, `tables`, `figures` and `document` (Jinja2 template in `templates/`), with
  the tables in LaTeX beside it (`latex`).

`analysis` reads MLflow and study files; it does not need Ray. The submodules are not
imported here, so `import analysis` stays cheap (matplotlib loads only with `plots`).
"""

__all__ = ["collect", "stats", "plots", "report", "report_schema"]
