"""Sampling rules and decode loops over the model functions."""
