"""The study file: read (YAML with lines), validated (schema, cross-checks, bounds), its
configs designed and identified (`spec.load_study`). Imports neither torch nor Ray."""
