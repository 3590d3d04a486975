"""Action-conditioned autoregressive-denoising video models and their server.

config (presets wan1_3b / small / tiny), model (the causal Wan-family DiT), vae, readout,
loader (Self-Forcing / CausVid checkpoints), reference (the plain sequential loop, both KV
schedules), scheduler / kvpool / admission / split (plain-Python serving logic), stage + serve
(the server), env_config + initial (the world-model vector env's config and first frames; the
env itself is envs/worldmodel_env.py), baselines / flops / bench_tools / bench_pipeline /
schedule_plot (measurement).
"""

from worldmodels.config import WorldModelConfig
from worldmodels.serve import AdmissionRefused, StreamFailed, WorldModelServer
from worldmodels.serve_config import ServeConfig

__all__ = ["AdmissionRefused", "ServeConfig", "StreamFailed", "WorldModelConfig", "WorldModelServer"]
