"""Pipelines that use `AccumulatingTrainer`: `digits/` runs locally on shipped data."""
