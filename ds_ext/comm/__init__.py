"""Collectives, ledger, time emulation and quantizers: every ds_ext byte passes here.

The names below load on first use (PEP 562), so that the torch-free modules of this package
(``ledger``, ``emulation``) import without torch: the planner uses them for arithmetic.
"""

from ds_ext.lazy import lazy_exports

_EXPORTS = {
    "Communicator": "ds_ext.comm.collectives",
    "Handle": "ds_ext.comm.collectives",
    "Ledger": "ds_ext.comm.ledger",
    "TimeEmulator": "ds_ext.comm.emulation",
    "backend_device": "ds_ext.comm.collectives",
    "Traffic": "ds_ext.comm.ledger",
    "instrument_torch_distributed": "ds_ext.comm.instrument",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
