"""The Python layout rules (cpattn.core.layout) agree with the header core (layout.h)."""

import pytest
import torch

from cpattn.core.layout import LAYOUTS, granularity, padded_length, shard_positions


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_granularity_agrees_with_the_header(layout, world):
    # layout_positions (layout.h layout_granularity) takes exactly the multiples of Python's
    # granularity and names the header's own in its error
    g = granularity(layout, world)
    for n in range(1, 3 * g + 1):
        if n % g == 0:
            pos = torch.ops.cpattn.layout_positions(n, world, world - 1, LAYOUTS[layout])
            assert pos.numel() == n // world
        else:
            with pytest.raises(RuntimeError, match=f"multiple of {g} for the {layout} layout"):
                torch.ops.cpattn.layout_positions(n, world, 0, LAYOUTS[layout])
        # any length: the shards of every rank cover 0 .. n-1 once, padding (-1) to the granularity
        shards = torch.cat([shard_positions(n, layout, world, r) for r in range(world)])
        assert shards.numel() == padded_length(n, layout, world)
        assert sorted(shards[shards >= 0].tolist()) == list(range(n))
