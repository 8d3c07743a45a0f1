"""Command-line entry points for inference (thin over `spd_jax`)."""
