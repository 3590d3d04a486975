"""Raw observations with negative strides (flipped images, reversed rows) are taken like contiguous ones:
torch cannot view them, so the transform copies them (the local backend's shared memory always did)."""

from __future__ import annotations

import numpy as np
import torch

from tests.policies.conftest import raw_obs


def flipped(raw: dict) -> dict:
    """Views with negative strides: images flipped both ways, the state's envs in reverse order."""
    out = dict(raw)
    for key in ("agentview_image", "wrist_image"):
        out[key] = raw[key][:, ::-1, ::-1]
    out["state"] = raw["state"][::-1]
    out["prompt"] = raw["prompt"][::-1]
    return out


def test_negative_strides_batch_like_their_contiguous_copies(tiny_policy):
    views = flipped(raw_obs(3, image_size=56, seed=4))
    assert all(s < 0 for s in views["agentview_image"].strides[1:3]) and views["state"].strides[0] < 0
    copies = {k: (np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v) for k, v in views.items()}
    for make in (tiny_policy.make_batch, tiny_policy.transform.reference):
        got, expected = make(views), make(copies)
        for slot in expected.images:
            assert torch.equal(got.images[slot], expected.images[slot]), slot
        assert torch.equal(got.state, expected.state)
        assert torch.equal(got.tokenized_prompt, expected.tokenized_prompt)
