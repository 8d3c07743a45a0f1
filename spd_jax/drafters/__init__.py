"""Speculation modules: the Pipeline Speculation Module (PSM) and its checkpoints."""
