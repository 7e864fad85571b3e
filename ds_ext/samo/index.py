"""The shared 1-D index of the unpruned entries, compression and expansion (001 §4.1.2-4.1.3).

Notation (001 §4.1): ``ind_i`` the indices of the unpruned entries of layer i. Sharding contract
of one parameter θ of ``n`` elements with ``k`` kept: its index is a 1-D int32 tensor of the kept
positions in θ's flattened (row-major, "hypothetical one-dimensional") view, ascending, so that
an N-d tensor costs one integer per kept entry instead of N (001 §4.1.2: the 2x2 tensor with
non-zeros at (0, 0), (1, 1) has the index [0, 3]). Every compressed state of θ (16- and 32-bit
gradient, fp32 master, optimizer moments) is a 1-D tensor of ``k`` elements in that order and
shares this one index. ``compress`` selects the kept entries of a dense tensor; ``expand``, its
inverse, writes ``k`` values into a dense tensor whose other entries become zero;
``expand_range`` writes a run of them and leaves every other entry as it is (ZeRO-2's bucket by
bucket expansion, :mod:`ds_ext.samo.zero2`, and the tiled step's tile by tile one,
:mod:`ds_ext.samo.tiled`).
"""

from __future__ import annotations

import torch

from ds_ext.errors import DsExtConfigError

INDEX_DTYPE = torch.int32  # 001 §4.1.2: "32-bit is sufficient for the largest models in existence"


def flat_index(mask: torch.Tensor) -> torch.Tensor:
    """The 1-D int32 index of ``mask``'s True entries in its flattened view, on its device."""
    if mask.numel() >= 2**31:
        raise DsExtConfigError(
            f"ds_ext.samo: a parameter of {mask.numel()} entries; its 32-bit index (001 §4.1.2) addresses at most "
            "2^31 - 1; allowed: parameters below 2^31 entries"
        )
    return torch.nonzero(mask.reshape(-1), as_tuple=True)[0].to(INDEX_DTYPE)


def compress(dense: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """The kept entries of ``dense`` (a new 1-D tensor); ``index`` None: the whole tensor, flat."""
    flat = dense.reshape(-1)
    return flat if index is None else flat.index_select(0, index)


def expand(values: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor) -> None:
    """Write ``values`` (1-D, compressed by ``index``) into the dense ``out`` in place, every entry
    outside ``index`` set to zero; ``index`` None: ``out`` takes ``values`` whole."""
    flat = out.view(-1)
    if index is None:
        flat.copy_(values)
        return
    flat.zero_()
    flat.index_put_((index,), values.to(flat.dtype))


def expand_range(values: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor, start: int) -> None:
    """Write ``values``, the compressed entries ``start`` to ``start + len(values)`` by ``index``,
    into the dense ``out`` in place; its other entries are left as they are."""
    flat = out.view(-1)
    if index is None:
        flat[start : start + values.numel()].copy_(values)
        return
    flat.index_put_((index[start : start + values.numel()],), values.to(flat.dtype))
