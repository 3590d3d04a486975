"""GRPO training: advantages, losses, actor update, loop, checkpoints."""
