"""Collectives, ledger, time emulation and quantizers: every ds_ext byte passes here."""

from ds_ext.comm.collectives import Communicator, Handle
from ds_ext.comm.emulation import TimeEmulator
from ds_ext.comm.instrument import instrument_torch_distributed
from ds_ext.comm.ledger import Ledger, Traffic

__all__ = [
    "Communicator",
    "Handle",
    "Ledger",
    "TimeEmulator",
    "Traffic",
    "instrument_torch_distributed",
]
