"""Running a study on Ray: the runner and its session, Tune experiments, one trial per cell,
checkpoints, the study's lease, preconditions, progress, termination."""
