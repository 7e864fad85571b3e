"""Comparing a ledger's link bytes (``Traffic.link_bytes_by_phase``) with an analytic model's."""

import pytest


def assert_links_equal(measured: dict, analytic: dict, phases: tuple[str, ...] | None = None) -> None:
    """``{phase: {level: bytes}}`` equal on every nonzero entry (to float summation order), over
    ``phases`` (None: every phase but ``other``, the collectives outside the engine)."""

    def kept(links: dict) -> dict:
        return {
            ph: {lv: b for lv, b in v.items() if b}
            for ph, v in links.items()
            if (ph in phases if phases is not None else ph != "other")
        }

    want = {ph: {lv: pytest.approx(b, rel=1e-12) for lv, b in v.items()} for ph, v in kept(analytic).items()}
    assert kept(measured) == want, (measured, analytic)
