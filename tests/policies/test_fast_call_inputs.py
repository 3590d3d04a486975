"""policies/fast/call_inputs.py: the host side of a fast-path call, against hand-computed values."""

import pytest
import torch

from policies.fast import call_inputs
from policies.observation import ModelInputs


def test_token_layout_puts_valid_tokens_first_and_pads_rows_with_row_0():
    """One camera of 2 patches and a 3-token prompt (P = 5), chunk 2, 3 rows for 2 samples:
    row 0: image kept, prompt [1, 1, 0] -> valid [1 1 1 1 0], already in order, 4 valid;
    row 1: image masked, prompt [1, 0, 1] -> valid [0 0 1 0 1]: tokens 2 and 4 first, their RoPE
    positions 0 and 1, the pads after (position of the last valid token before them);
    row 2 repeats row 0. Suffix slots follow each row's valid tokens."""
    image_masks = torch.tensor([[True], [False]])
    token_mask = torch.tensor([[True, True, False], [True, False, True]])
    packed, n_valid = call_inputs.token_layout(image_masks, token_mask, rows=3, prompt_len=3, num_patches=2,
                                               chunk=2)
    order, positions, suffix = packed[:15].view(3, 5), packed[15:30].view(3, 5), packed[30:].view(3, 2)
    assert order.tolist() == [[0, 1, 2, 3, 4], [2, 4, 0, 1, 3], [0, 1, 2, 3, 4]]
    assert positions.tolist() == [[0, 1, 2, 3, 3], [0, 1, -1, -1, 0], [0, 1, 2, 3, 3]]
    assert suffix.tolist() == [[4, 5], [2, 3], [4, 5]]
    assert n_valid.tolist() == [4, 2, 4] and n_valid.dtype == torch.int32


def test_token_layout_pads_a_short_prompt_to_its_bucket():
    packed, n_valid = call_inputs.token_layout(torch.tensor([[True]]), torch.tensor([[True, True]]), rows=1,
                                               prompt_len=4, num_patches=1, chunk=1)
    assert packed[:5].tolist() == [0, 1, 2, 3, 4] and n_valid.tolist() == [3] and packed[-1].item() == 3


def test_pick_and_row_helpers():
    assert call_inputs.pick([1, 2, 4], 3, "batch size") == 4
    with pytest.raises(ValueError, match="batch size 5 exceeds the largest fast-path bucket 4"):
        call_inputs.pick([1, 2, 4], 5, "batch size")
    values = torch.arange(6).view(2, 3)
    assert call_inputs.pad_rows(values, 4).tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [0, 1, 2]]
    buf = torch.full((3, 3), -1)
    call_inputs.copy_rows(buf, values)
    assert buf.tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_host_masks_from_the_cpu_are_bools_without_staging():
    inputs = ModelInputs(torch.zeros(1, 2, 3, 4, 4), torch.tensor([[1, 0]]), torch.zeros(1, 3, dtype=torch.long),
                         torch.tensor([[1, 1, 0]]))
    staging = {}
    token_mask, image_masks = call_inputs.host_masks(inputs, staging)
    assert token_mask.dtype == image_masks.dtype == torch.bool and staging == {}
    assert token_mask.tolist() == [[True, True, False]] and image_masks.tolist() == [[True, False]]
    rows = call_inputs.split_rows(inputs, 0, 1)
    assert rows.images.shape == (1, 2, 3, 4, 4) and rows.token_mask.tolist() == [[1, 1, 0]]


def test_take_rows_keeps_pixel_less_images_a_view():
    """Images whose rows all share one memory (zero stride, the actor's pixel-less rows) are taken as a view of the
    asked length, not gathered; the other tensors are gathered as usual, and the values are the gather's."""
    images = torch.full((), -1.0).expand(4, 2, 3, 8, 8)
    inputs = ModelInputs(images, torch.ones(4, 2, dtype=torch.bool), torch.arange(12).view(4, 3),
                         torch.ones(4, 3, dtype=torch.bool))
    index = torch.tensor([3, 1, 3])
    rows = call_inputs.take_rows(inputs, index)
    assert rows.images.shape == (3, 2, 3, 8, 8) and not any(rows.images.stride())
    assert torch.equal(rows.images, images[index]) and torch.equal(rows.tokens, inputs.tokens[index])
    assert torch.equal(call_inputs.take_rows(inputs, torch.tensor([], dtype=torch.long)).images, images[:0])
