"""Hydra entry points researchers launch (benchmarks, GRPO, reports)."""
