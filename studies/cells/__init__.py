"""Cells, one (config, seed) pair each: the expansion of a study's configs over its seeds
(`space.expand`), the order Tune is handed them in, and their readable run names."""
