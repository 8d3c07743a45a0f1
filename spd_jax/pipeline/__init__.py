"""The pipeline: stage partitioning, the `stage` mesh, per-stage weights/caches and the stage step."""
