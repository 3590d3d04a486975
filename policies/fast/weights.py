"""The fast path's view of the model's weights, and its weight-derived tables.

Parameters already in the fast dtype are used as they are (the model's own storage), so an
in-place weight update (`param.copy_(new)`, what the engine's weight sync does) is seen at the
next call, inside captured CUDA graphs too. Parameters kept in another dtype (LeRobot's bf16
mode keeps SigLIP and the norms in fp32) get a shadow copy in the fast dtype; `refresh()`
copies them again. The AdaRMS modulation table of the fixed time grid depends only on weights
and t: it is computed outside any graph into a fixed buffer and refreshed in place, so a
weight update never forces a graph re-capture.

With precision "fp8" the linear weights of the groups in `fp8_gemms` (vision tower and prefix
projections, config.FP8_GEMM_GROUPS) also get FP8 shadows
(policies/fast/fp8.py: e4m3 + one fp32 scale per output channel) in fixed buffers. `refresh()`
re-quantises, in place, only those whose parameter changed since it was last quantised: the
parameter's version counter, which every in-place write through the parameter or a `detach()`ed
view bumps (copy_, optimizer steps, load_state_dict, `state_dict()` views). Writes through
`param.data` bypass the counter: call `refresh(force=True)` after those.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from policies import flow
from policies.fast.config import FP8_GEMM_GROUPS
from policies.fast.fp8 import Fp8Weight, make_fp8_weight, requantize_, supported


@dataclass
class LinearW:
    weight: Tensor
    bias: Tensor | None
    fp8: Fp8Weight | None = None  # FP8 shadow of `weight` (precision "fp8")


class FastWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype, num_steps: int, precision: str = "bf16",
                 fp8_gemms: tuple[str, ...] = FP8_GEMM_GROUPS):
        self.model = model
        self.dtype = dtype
        self.fp8_groups = frozenset(fp8_gemms) if precision == "fp8" else frozenset()
        self.fp8_weights: list[Fp8Weight] = []
        self.last_requantized = 0  # how many FP8 shadows the last refresh() re-quantised
        self._shadows: list[tuple[Tensor, Tensor]] = []
        self.num_steps = num_steps
        cfg = model.cfg
        self.vision = self._vision(model.vision)
        self.embed = self.cast(model.embed_tokens.weight)
        self.embed_scale = torch.tensor(cfg.prefix.width**0.5, dtype=torch.float32).to(self.embed.dtype).item()
        self.prefix = [self._gemma_layer(layer, "prefix_") for layer in model.prefix.layers]
        self.prefix_norms = [self.cast(layer.input_norm.weight) for layer in model.prefix.layers]
        self.prefix_post_norms = [self.cast(layer.post_norm.weight) for layer in model.prefix.layers]
        self.expert = [self._gemma_layer(layer) for layer in model.expert.layers]
        # fp32 like LeRobot: tiny layers whose precision matters for the flow state.
        self.action_in = LinearW(model.action_in_proj.weight, model.action_in_proj.bias)
        self.action_out = LinearW(model.action_out_proj.weight, model.action_out_proj.bias)
        self.grid = flow.time_grid(num_steps, self.embed.device)
        self.table = torch.empty(0)
        self.refresh_tables()

    def cast(self, param: Tensor) -> Tensor:
        """The parameter in the fast dtype: itself when it already is, else a refreshed shadow."""
        if param.dtype == self.dtype:
            return param.detach()
        shadow = param.detach().to(self.dtype).clone()
        self._shadows.append((param, shadow))
        return shadow

    def _linear(self, module: nn.Linear, group: str | None = None) -> LinearW:
        """The module's weights in the fast dtype, plus an FP8 shadow when `group` runs in FP8."""
        lw = LinearW(self.cast(module.weight), self.cast(module.bias) if module.bias is not None else None)
        if group in self.fp8_groups and supported(module.weight):
            lw.fp8 = make_fp8_weight(module.weight)
            self.fp8_weights.append(lw.fp8)
        return lw

    def _gemma_layer(self, layer, fp8_prefix: str | None = None) -> dict:
        """`fp8_prefix` "prefix_": the prefix's layers, whose projections are FP8 groups; None: the expert."""
        return {name: self._linear(module, fp8_prefix and fp8_prefix + name) for name, module in
                (("qkv", layer.qkv), ("o", layer.o_proj), ("gate_up", layer.gate_up), ("down", layer.down))}

    def _vision(self, vision) -> dict:
        layers = []
        for block in vision.layers:
            layers.append({
                "ln1": self._linear(block.ln1), "qkv": self._linear(block.qkv, "vision_attention"),
                "out": self._linear(block.out_proj, "vision_attention"), "ln2": self._linear(block.ln2),
                "fc1": self._linear(block.fc1, "vision_mlp"), "fc2": self._linear(block.fc2, "vision_mlp"),
            })
        return {
            "patch": self._linear(vision.patch_embed), "pos": self.cast(vision.position_embedding),
            "layers": layers, "post_ln": self._linear(vision.post_ln),
            "proj": self._linear(vision.projector, "vision_projector"),
        }

    @torch.no_grad()
    def refresh(self, force: bool = False) -> None:
        """After an in-place weight update: re-copy the shadows, re-quantise the FP8 shadows of
        changed parameters (all with `force`), recompute the tables; every buffer in place."""
        for param, shadow in self._shadows:
            shadow.copy_(param.detach())
        changed = [w for w in self.fp8_weights if force or w.source._version != w.version]
        for w in changed:
            requantize_(w)
        self.last_requantized = len(changed)
        self.refresh_tables()

    @torch.no_grad()
    def refresh_tables(self) -> None:
        table = self.model.modulation_table(self.grid[:-1]).float()  # (K, 2L+1, 3W)
        if self.table.shape != table.shape:
            self.table = table.contiguous()
        else:
            self.table.copy_(table)

    def modulation(self, step: int, norm: int) -> tuple[Tensor, Tensor, Tensor]:
        """[scale, shift, gate] (each (W,), fp32 views) of expert norm `norm` at grid step `step`."""
        return self.table[step, norm].chunk(3)
