"""The repository's CI tools (run from the repository root: ``python -m tools.<name>``), kept out of the
shipped packages: ``aot`` (the row kernels compiled ahead of time for CUDA targets, without a GPU)."""
