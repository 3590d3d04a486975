"""Writing one epoch into a `RolloutBatch`: buffer shapes, output checks, and the three writes
of a chunk (observation before predict, prediction, env result).

Rows are the collector's env numbering (stage start + local row); `t` is the chunk index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from envs.config import EnvConfig
from envs.vector import ChunkResult
from envs.vector.buffers import ACTION_DIM, STATE_DIM
from policies.config import PolicyConfig
from rollout.trajectory import RolloutBatch
from rollout.types import PolicyOutput


@dataclass(frozen=True)
class BatchShapes:
    """Every per-chunk shape of the RolloutBatch, from the env and policy configs."""

    cameras: dict[str, tuple[int, int, int]]  # observation key -> (S, S, 3)
    state_dim: int
    token_len: int  # L: policy.max_token_len (shorter engine outputs are zero-padded)
    num_steps: int  # K
    chunk: int  # H: the policy's chunk (chains)
    max_action_dim: int  # D
    action_dim: int
    logprob_chunk: int  # Hc
    action_chunk: int  # Ha: sub-steps the env executes per chunk (env.chunk_size)

    @classmethod
    def from_configs(cls, env_cfg: EnvConfig, policy_cfg: PolicyConfig) -> BatchShapes:
        ha, h, hc = env_cfg.chunk_size, policy_cfg.chunk_size, policy_cfg.logprob_chunk
        if h < ha:
            raise ValueError(
                f"policy.chunk_size ({h}) is shorter than env.chunk_size ({ha}): the env would execute "
                "actions the policy never produced"
            )
        if hc != ha:
            raise ValueError(
                f"the log-prob chunk (policy.sampling.logprob_chunk or policy.chunk_size = {hc}) must equal "
                f"env.chunk_size ({ha}), the actions the env executes per chunk: the GRPO ratio must cover "
                "exactly the executed actions"
            )
        if policy_cfg.action_dim != ACTION_DIM:
            raise ValueError(
                f"policy.action_dim must be {ACTION_DIM} (the env's action size), got {policy_cfg.action_dim}"
            )
        size = env_cfg.image_size
        return cls(
            cameras={f"{cam}_image": (size, size, 3) for cam in env_cfg.cameras},
            state_dim=STATE_DIM,
            token_len=policy_cfg.max_token_len,
            num_steps=policy_cfg.sampling.num_steps,
            chunk=h,
            max_action_dim=policy_cfg.max_action_dim,
            action_dim=policy_cfg.action_dim,
            logprob_chunk=hc,
            action_chunk=ha,
        )

    def allocate(self, num_envs: int, max_chunks: int, group_size: int, record_images: bool) -> RolloutBatch:
        return RolloutBatch.allocate(
            num_envs, max_chunks, self.cameras if record_images else {}, self.state_dim, self.token_len,
            self.num_steps, self.chunk, self.max_action_dim, self.action_dim, self.logprob_chunk,
            group_size=group_size, action_chunk=self.action_chunk,
        )

    def check_batch(self, batch: RolloutBatch, num_envs: int, max_chunks: int, record_images: bool) -> None:
        """A caller-provided batch must have been allocated for this collector: every array's shape
        (a smaller image or token buffer would fail mid-epoch on a bare broadcast error) and the
        cameras it records (a batch without images would silently lose them)."""
        expected = self.array_shapes(num_envs, max_chunks, record_images)
        got = {name: tuple(getattr(batch, name).shape) for name in expected if not name.startswith("images")}
        got.update({f"images[{key}]": tuple(value.shape) for key, value in batch.images.items()})
        wrong = [name for name in sorted(set(expected) | set(got)) if expected.get(name) != got.get(name)]
        if wrong:
            details = "; ".join(f"{name} {got.get(name, 'missing')} (needs {expected.get(name, 'none')})"
                                for name in wrong)
            raise ValueError(
                f"the RolloutBatch passed as `out` does not fit this collector: {details} (allocate it with "
                "collector.allocate_batch())"
            )

    def array_shapes(self, num_envs: int, max_chunks: int, record_images: bool) -> dict[str, tuple[int, ...]]:
        """The shape of every array of a batch for this collector (RolloutBatch.array_specs, which
        `allocate` makes them from, and the recorded cameras)."""
        specs = RolloutBatch.array_specs(num_envs, max_chunks, self.state_dim, self.token_len, self.num_steps,
                                         self.chunk, self.max_action_dim, self.action_dim, self.logprob_chunk,
                                         self.action_chunk)
        shapes = {name: shape for name, (shape, _) in specs.items()}
        if record_images:
            shapes.update({f"images[{key}]": (num_envs, max_chunks, *shape) for key, shape in self.cameras.items()})
        return shapes

    def check_output(self, out: PolicyOutput, rows: int, where: str) -> None:
        """Shapes of one predict's output; errors name the field, expected and received shape."""
        k, h, d, a = self.num_steps, self.chunk, self.max_action_dim, self.action_dim
        expected = {
            "actions": (rows, h, a),
            "chains": (rows, k + 1, h, d),
            "denoise_inds": (rows, k),
            "logprobs": (rows, self.logprob_chunk, a),
            "chunk_logprob": (rows,),
        }
        for name, shape in expected.items():
            got = tuple(getattr(out, name).shape)
            if got != shape:
                raise ValueError(f"engine output {name} for {where} has shape {got}, expected {shape}")
        for name in ("tokens", "token_mask"):
            got = tuple(getattr(out, name).shape)
            if len(got) != 2 or got[0] != rows or got[1] > self.token_len:
                raise ValueError(
                    f"engine output {name} for {where} has shape {got}, expected ({rows}, L <= "
                    f"{self.token_len} = policy.max_token_len)"
                )


def engine_inputs(obs: dict[str, Any], cameras: list[str], rows: np.ndarray, all_rows: bool) -> dict[str, Any]:
    """The predict input for `rows` of a stage's observation (views when every row is active:
    predict runs before the stage's next env step overwrites them)."""
    take = (lambda a: a) if all_rows else (lambda a: a[rows])
    inputs: dict[str, Any] = {key: take(obs[key]) for key in cameras}
    inputs["state"] = take(obs["state"])
    prompts = obs["prompt"]
    inputs["prompt"] = list(prompts) if all_rows else [prompts[i] for i in rows]
    return inputs


def record_observation(batch: RolloutBatch, rows: np.ndarray, t: int, inputs: dict[str, Any]) -> None:
    """The observation each row's chunk t is predicted from."""
    for key, images in batch.images.items():
        images[rows, t] = inputs[key]
    batch.states[rows, t] = inputs["state"]


def record_prediction(batch: RolloutBatch, rows: np.ndarray, t: int, out: PolicyOutput,
                      actions: np.ndarray) -> None:
    """The engine's output for `rows` at chunk t; `actions` are the clipped executed actions."""
    width = out.tokens.shape[1]
    batch.tokens[rows, t, :width] = out.tokens.numpy()
    batch.tokens[rows, t, width:] = 0
    batch.token_mask[rows, t, :width] = out.token_mask.numpy()
    batch.token_mask[rows, t, width:] = False
    batch.chains[rows, t] = out.chains.numpy()
    batch.denoise_inds[rows, t] = out.denoise_inds.numpy()
    batch.logprobs[rows, t] = out.logprobs.numpy()
    batch.chunk_logprob[rows, t] = out.chunk_logprob.numpy()
    batch.versions[rows, t] = out.version
    batch.prefix_rows[rows, t] = -1 if out.prefix_rows is None else out.prefix_rows.numpy()
    batch.actions[rows, t] = actions


def record_result(batch: RolloutBatch, stage_rows: slice, active: np.ndarray, t: int, result: ChunkResult) -> None:
    """The env's answer to chunk t of one stage. `active` (local rows) were predicted and sent;
    a row lost during this chunk gets no valid chunk."""
    batch.rewards[stage_rows, t] = result.rewards
    batch.substep_valid[stage_rows, t] = result.valid
    batch.dones[stage_rows, t] = (result.terminated | result.truncated) & result.valid
    start = stage_rows.start
    kept = active[~result.lost[active]]
    batch.chunk_valid[start + kept, t] = True
    batch.success[stage_rows] = result.success


def finalize(batch: RolloutBatch, done: np.ndarray, lost: np.ndarray) -> None:
    """After the last chunk: lost envs lose their whole trajectory (never trained on)."""
    batch.lost[:] = lost
    batch.done[:] = done & ~lost
    batch.chunk_valid[lost] = False
    batch.success[lost] = False
    batch.num_chunks[:] = batch.chunk_valid.sum(axis=1)
