"""The cluster: `studies submit` and the Ray Jobs commands (a study sent to a remote Ray
cluster with the project's working directory)."""
