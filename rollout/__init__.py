"""Policy engine, weight sync, collector and the RLinf adapter (built on envs and policies)."""
