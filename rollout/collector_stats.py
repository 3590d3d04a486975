"""Timing and counts of one rollout epoch (`RolloutCollector.last_stats`).

Times are `time.perf_counter()` seconds. The chunk loop starts after the reset; an env chunk's
end is when its `step_chunk` returned (inside the stage's thread, not when the driver got
around to reading it); with render_at before_predict, when the driver's `render` of it returned
(the observation exists only then). Round t ends when the last stage finished its chunk t.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollout.trajectory import RolloutBatch


@dataclass
class CollectStats:
    stages: int
    max_chunks: int
    reset_s: float = 0.0
    loop_start: float = 0.0
    loop_s: float = 0.0  # first predict to the last env chunk's end
    chunks: int = 0  # chunk rounds run (<= max_chunks; fewer when every env finished early)
    env_steps: int = 0  # sub-steps executed (all envs, including any lost later)
    predict_s: float = 0.0  # driver time inside engine.predict
    predict_calls: int = 0
    predict_rows: int = 0
    env_wall_s: float = 0.0  # sum over stage chunks of step_chunk wall time
    render_s: float = 0.0  # driver time inside vec.render() (render_at before_predict; else 0: workers render)
    steps_per_chunk: dict[int, int] = field(default_factory=dict)
    chunk_end: dict[int, float] = field(default_factory=dict)  # round t -> its end (since loop start)
    predict_log: list[tuple[int, int, int, float]] = field(default_factory=list)  # (stage, chunk, rows, s)
    valid_chunks: int = 0
    lost_envs: int = 0
    success_rate: float = 0.0
    nbytes: int = 0

    def start(self) -> None:
        self.loop_start = time.perf_counter()

    def add_predict(self, stage: int, chunk: int, rows: int, seconds: float) -> None:
        self.predict_s += seconds
        self.predict_calls += 1
        self.predict_rows += rows
        self.predict_log.append((stage, chunk, rows, seconds))

    def add_render(self, seconds: float) -> None:
        self.render_s += seconds

    def add_env_chunk(self, stage: int, chunk: int, steps: int, finished_at: float, wall_s: float) -> None:
        self.env_steps += steps
        self.env_wall_s += wall_s
        self.steps_per_chunk[chunk] = self.steps_per_chunk.get(chunk, 0) + steps
        end = finished_at - self.loop_start
        self.chunk_end[chunk] = max(self.chunk_end.get(chunk, 0.0), end)
        self.chunks = max(self.chunks, chunk + 1)
        self.loop_s = max(self.loop_s, end)

    def finish(self, batch: RolloutBatch) -> None:
        summary = batch.summary()
        self.valid_chunks = int(summary["valid_chunks"])
        self.lost_envs = int(summary["lost_envs"])
        self.success_rate = float(summary["success_rate"])
        self.nbytes = int(summary["nbytes"])

    def env_steps_per_s(self, skip_chunks: int = 0) -> float:
        """Throughput of the chunk loop. skip_chunks=0: every step over the whole loop (pipeline
        fill and drain included). skip_chunks=w: steps of chunks >= w over the time from the end
        of round w-1 to the end of the last round (the warm-up rounds excluded)."""
        if skip_chunks <= 0:
            return self.env_steps / self.loop_s if self.loop_s > 0 else 0.0
        if skip_chunks >= self.chunks:
            raise ValueError(f"skip_chunks ({skip_chunks}) must be below the chunks run ({self.chunks})")
        steps = sum(n for t, n in self.steps_per_chunk.items() if t >= skip_chunks)
        span = self.chunk_end[self.chunks - 1] - self.chunk_end[skip_chunks - 1]
        return steps / span if span > 0 else 0.0

    def describe(self) -> str:
        rate = self.env_steps_per_s()
        return (f"{self.chunks} chunks, {self.env_steps} env steps in {self.loop_s:.2f} s ({rate:.1f}/s; "
                f"reset {self.reset_s:.2f} s, predict {self.predict_s:.2f} s over {self.predict_calls} calls, "
                f"render {self.render_s:.2f} s), "
                f"{self.valid_chunks} valid chunks, success {self.success_rate:.2f}, {self.lost_envs} lost, "
                f"buffer {self.nbytes / 2**20:.1f} MiB")

    def to_dict(self) -> dict:
        return {
            "stages": self.stages, "max_chunks": self.max_chunks, "chunks": self.chunks,
            "reset_s": self.reset_s, "loop_s": self.loop_s, "env_steps": self.env_steps,
            "env_steps_per_s": self.env_steps_per_s(), "predict_s": self.predict_s,
            "predict_calls": self.predict_calls, "predict_rows": self.predict_rows,
            "env_wall_s": self.env_wall_s, "render_s": self.render_s, "steps_per_chunk": dict(self.steps_per_chunk),
            "chunk_end_s": dict(self.chunk_end), "valid_chunks": self.valid_chunks,
            "lost_envs": self.lost_envs, "success_rate": self.success_rate, "nbytes": self.nbytes,
        }
