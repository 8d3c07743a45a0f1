"""Model math only: pure functions over parameter pytrees. No checkpoints, sampling or pipelines."""
