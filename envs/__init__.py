"""LIBERO suites as gymnasium envs and the shared-memory vectorized env."""
