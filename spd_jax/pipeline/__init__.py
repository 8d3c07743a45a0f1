"""The pipeline: stage partitioning (`partition`) and per-stage weights, caches and the stage step (`stages`)."""
