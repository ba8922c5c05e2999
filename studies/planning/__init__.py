"""Planning a study before it runs: ``plan`` (the ``studies plan`` command: seeds each
comparison needs, GPU-hours, wall time) and ``estimate`` (the cost model of a study's cells, from a
pilot's runs or a probe of the trainer, dealt to the trial slots)."""
