"""The in-process twin: same interface and same EnvRunner, no processes, no shared memory.

For tests (run it next to AsyncVectorEnv and compare) and for debugging (breakpoints and
tracebacks land in the env code directly).
"""

from __future__ import annotations

from envs.config import EnvConfig
from envs.vector.base import VectorEnvBase
from envs.vector.buffers import SharedBuffers
from envs.vector.catalog import make_env
from envs.vector.runner import EnvRunner


class SyncVectorEnv(VectorEnvBase):
    def __init__(self, cfg: EnvConfig):
        super().__init__(cfg)
        self._buffers = SharedBuffers.private(cfg)
        envs = [make_env(cfg, slot.task_id) for slot in self.slots]
        self._runner = EnvRunner(cfg, range(cfg.num_envs), envs, self._buffers.arrays)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        bar = _progress(self.cfg, "creating envs (in process)")
        try:
            self._runner.create(on_created=lambda env_id: bar.update(1) if bar else None)
        finally:
            if bar is not None:
                bar.close()

    def _worker_env_ids(self) -> list[list[int]]:
        return [list(range(self.num_envs))]

    def _reset_envs(self, plan) -> None:
        self._runner.reset(plan)

    def _step_envs(self, horizon: int, render: bool = True) -> list[dict]:
        self._runner.step_chunk(horizon, render)
        return []

    def _render_envs(self, unrendered, workers_at_once: int | None = None) -> list[dict]:
        self._runner.render_pending()  # the runner knows the same envs as pending (one process: no waves)
        return []

    def _close_impl(self) -> None:
        try:
            self._runner.close()
        finally:
            self._buffers.close()


def _progress(cfg: EnvConfig, description: str):
    if not cfg.show_progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.num_envs, desc=description, unit="env")
