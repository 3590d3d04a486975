"""Errors of grpo/prefix_store.py name the bad value: the repeated row ids, the caller's rows."""

from __future__ import annotations

import pytest
import torch

from grpo.prefix_store import RowPrefixes
from tests.grpo.test_engine_prefixes import cache_of


def test_a_row_named_twice_past_the_eighth_id_is_named_in_the_error():
    """A duplicate past the eighth id is named (the message once showed rows[:8])."""
    store = RowPrefixes("device", rows=20)
    rows = torch.tensor([*range(10), 9])  # row 9 twice
    with pytest.raises(ValueError, match=r"row ids named twice in one cache: \[9, 9\]"):
        store.add(rows, cache_of(11))


def test_a_views_gather_names_the_update_rows_it_was_asked_for():
    """StoreView.gather's KeyError names the update rows the caller passed (it once named the store's ids: -1 for a
    row the engine never kept)."""
    one_row = cache_of(1).keys[0][0].numel() * 4 * 4 + 6 + 8
    store = RowPrefixes("device", rows=8, budget_bytes=3 * one_row)
    store.append(cache_of(2))
    store.append(cache_of(2, fill=10))  # store rows 0-2 kept, 3 not
    view = store.view(torch.tensor([2, -1, 0, 3]))
    with pytest.raises(KeyError, match=r"no kept prefix cache for rows \[1, 3\]"):
        view.gather(torch.tensor([1, 3]), torch.device("cpu"))
