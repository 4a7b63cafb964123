"""cluster_residency.padded_request (no GPU): the shared-memory request the driver is asked about holds no more
CTAs an SM than the build's registers are capped for, and never less than the build asks for."""

from __future__ import annotations

import pytest

from k3_decode.kernels.cluster_residency import padded_request

H100_SM, RESERVED = 233472, 1024  # an H100/H200 SM's shared memory and the driver's share beside each CTA


@pytest.mark.parametrize("per_sm", [1, 2, 3, 4, 8])
def test_the_padded_request_fits_exactly_the_ctas_asked(per_sm: int):
    request = padded_request(1024, per_sm, H100_SM, RESERVED)
    assert per_sm * (request + RESERVED) <= H100_SM < (per_sm + 1) * (request + RESERVED)


def test_a_larger_request_is_kept():
    """A build whose own shared memory allows fewer CTAs than asked keeps its request: the driver then counts what
    the shared memory allows (the wgmma build at two an SM asks 101888 bytes: two fit, three do not)."""
    assert padded_request(101888, 2, H100_SM, RESERVED) == 101888
    assert padded_request(150000, 3, H100_SM, RESERVED) == 150000


@pytest.mark.parametrize(("smem", "per_sm"), [(-1, 2), (0, 0)])
def test_nonsense_is_refused(smem: int, per_sm: int):
    with pytest.raises(ValueError, match="cluster residency"):
        padded_request(smem, per_sm, H100_SM, RESERVED)
