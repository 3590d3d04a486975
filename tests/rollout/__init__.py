"""Tests of rollout/: engine, weight sync, collector, RLinf adapter."""
