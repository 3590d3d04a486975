"""The fast path's view of the model's weights, and its weight-derived tables.

Parameters already in the fast dtype are used as they are (the model's own storage), so an
in-place weight update (`param.copy_(new)`, what the engine's weight sync does) is seen at the
next call, inside captured CUDA graphs too. Parameters kept in another dtype (LeRobot's bf16
mode keeps SigLIP and the norms in fp32) get a shadow copy in the fast dtype; `refresh()`
copies them again. The AdaRMS modulation table of the fixed time grid depends only on weights
and t: it is computed outside any graph into a fixed buffer and refreshed in place, so a
weight update never forces a graph re-capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from policies import flow


@dataclass
class LinearW:
    weight: Tensor
    bias: Tensor | None


class FastWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype, num_steps: int):
        self.model = model
        self.dtype = dtype
        self._shadows: list[tuple[Tensor, Tensor]] = []
        self.num_steps = num_steps
        cfg = model.cfg
        self.vision = self._vision(model.vision)
        self.embed = self.cast(model.embed_tokens.weight)
        self.embed_scale = torch.tensor(cfg.prefix.width**0.5, dtype=torch.float32).to(self.embed.dtype).item()
        self.prefix = [self._gemma_layer(layer) for layer in model.prefix.layers]
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

    def _linear(self, module: nn.Linear) -> LinearW:
        return LinearW(self.cast(module.weight), self.cast(module.bias) if module.bias is not None else None)

    def _gemma_layer(self, layer) -> dict:
        return {"qkv": self._linear(layer.qkv), "o": self._linear(layer.o_proj),
                "gate_up": self._linear(layer.gate_up), "down": self._linear(layer.down)}

    def _vision(self, vision) -> dict:
        layers = []
        for block in vision.layers:
            layers.append({
                "ln1": self._linear(block.ln1), "qkv": self._linear(block.qkv), "out": self._linear(block.out_proj),
                "ln2": self._linear(block.ln2), "fc1": self._linear(block.fc1), "fc2": self._linear(block.fc2),
            })
        return {
            "patch": self._linear(vision.patch_embed), "pos": self.cast(vision.position_embedding),
            "layers": layers, "post_ln": self._linear(vision.post_ln), "proj": self._linear(vision.projector),
        }

    @torch.no_grad()
    def refresh(self) -> None:
        """After an in-place weight update: re-copy the shadows, recompute the tables in place."""
        for param, shadow in self._shadows:
            shadow.copy_(param.detach())
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
