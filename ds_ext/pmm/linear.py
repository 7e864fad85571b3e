"""``ds_ext.pmm.Linear``: one fully connected layer parallelized by 3D-PMM (001 Algorithm 3).

Sharding contract of a *normal* layer on rank g(x=i, y=j, z=k) (001 §5.1.1; m rows =
batch x sequence of this data-parallel group, k in-features, n out-features); a
*transposed* layer swaps the roles of X and Y everywhere:

==========================  ============================================================
input  I_{k,j}              ``[..., k/G_y]``: rows = this rank's Z share of the batch,
                            in-features block j over Y, replicated over X
weight Ŵ_{j,i} (stored)     ``[(n/G_x)(k/G_y)/G_z]``: chunk k of the flattened block
                            ``W[out block i, in block j]`` of the serial ``[n, k]`` weight
bias (stored)               ``[n/G_x]``: out block i, replicated over Y and Z
line 2  ALL-GATHER_z        Ŵ -> W_{j,i} ``[n/G_x, k/G_y]`` (cached for backward, line 5)
line 3  matmul              Ô_{k,i} = I_{k,j} W_{j,i}ᵀ: partial sums over in-blocks
line 4  ALL-REDUCE_y        O_{k,i} ``[..., n/G_x]``: out block i over X, replicated over Y
line 11-12 ALL-REDUCE_x     dL/dI_{k,j} = Σ_x dL/dO W: ``[..., k/G_y]``, replicated over X
line 13-14 REDUCE-SCATTER_z dL/dŴ: the Z shares of (dL/dO)ᵀ I summed, chunk k kept
bias gradient ALL-REDUCE_z  Σ over the Z shares of the rows (not in Eqs 5.1-5.5), in the
                            forward's bucket of Z-replicated gradients (PMMEngine.replicated)
==========================  ============================================================

A layer built with ``split_out=False`` (the LM head and tables under ``ds_ext.pmm3d.tables``
"replicated") keeps all n out-features on every rank of its out axis: weight ``W[:, in block
j]`` chunked over Z, replicated over the out axis; output ``[..., n]``; no line-12 all-reduce
(each rank's dL/dI already sums over every out-feature).

So the output of a normal layer is laid out as a transposed layer's input and back:
consecutive layers alternate (QKV / FC1 normal, attention-out / FC2 transposed). With
only X in use this is Megatron's column- then row-parallel pair; with only Z, FSDP.
Parameters are initialized by slicing a serial ``nn.Linear`` (:meth:`Linear.from_serial`),
so the parallel model equals the serial one under the same seed.
"""

from __future__ import annotations

import torch
from torch import nn

from ds_ext.comm import Handle
from ds_ext.errors import DsExtConfigError
from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.grid import unsplit
from ds_ext.pmm.layout import LinearLayout


class _Algorithm3(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: "Linear", grad_pass: bool
    ):
        eng = layer.engine
        w = layer.gathered_weight(weight, grad_pass)  # line 2
        x2 = x.reshape(-1, layer.layout.k_local)
        out = eng.matmul(f"{layer.name}/fwd", x2, w.t())  # line 3
        eng.all_reduce(out, layer.in_axis, layer.name)  # line 4
        if bias is not None:
            out += bias
        ctx.save_for_backward(x2, w)  # line 5
        ctx.layer, ctx.in_shape, ctx.has_bias = layer, x.shape, bias is not None
        ctx.deferred = layer.deferrable(weight)
        return out.view(*x.shape[:-1], layer.layout.n_local)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x2, w = ctx.saved_tensors
        layer: Linear = ctx.layer
        eng = layer.engine
        if eng.prefetcher is not None:
            eng.prefetcher.note_backward()
        g2 = grad_out.reshape(-1, layer.layout.n_local).contiguous()
        grad_in = eng.matmul(f"{layer.name}/dgrad", g2, w)  # line 11
        pending = eng.all_reduce(grad_in, layer.out_axis, layer.name, async_op=eng.overlap.all_reduce)  # line 12
        grad_block = eng.matmul(f"{layer.name}/wgrad", g2.t(), x2)  # line 13
        pending.wait()  # OAR: the all-reduce ran during line 13
        grad_w = layer.reduce_gradients(grad_block, ctx.deferred)  # line 14
        grad_b = g2.sum(0) if ctx.has_bias else None  # summed over Z by the bucket
        return grad_in.view(ctx.in_shape), grad_w, grad_b, None, None


class Linear(nn.Module):
    """A 3D-PMM fully connected layer (see the module docstring for its sharding contract)."""

    # the weight is used more than once per pass (a tied embedding and LM head): autograd adds
    # its gradients as they arrive, so ORS cannot hand it buffers still being reduce-scattered
    shared_weight: bool = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        engine: PMMEngine,
        *,
        bias: bool = True,
        transposed: bool = False,
        out_chunks: int = 1,
        name: str = "linear",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """A layer initialized like ``nn.Linear(in_features, out_features)`` under the current seed."""
        super().__init__()
        serial = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup(serial.weight, serial.bias, engine, transposed, out_chunks, name)

    @classmethod
    def from_serial(
        cls,
        serial: nn.Linear,
        engine: PMMEngine,
        *,
        transposed: bool = False,
        out_chunks: int = 1,
        name: str = "linear",
        split_out: bool = True,
    ) -> "Linear":
        """The shard of ``serial``'s parameters this rank owns (001 §5.1.1)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(serial.weight, serial.bias, engine, transposed, out_chunks, name, split_out)
        return layer

    def _setup(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        engine: PMMEngine,
        transposed: bool,
        out_chunks: int,
        name: str,
        split_out: bool = True,
    ) -> None:
        """Keep this rank's shard of the serial ``[n, k]`` ``weight`` (and ``[n]`` ``bias``);
        ``split_out`` False: all out-features, replicated over the out axis."""
        self.engine, self.transposed, self.name, self.split_out = engine, transposed, name, split_out
        self.out_features, self.in_features = weight.shape
        self.out_axis, self.in_axis = (engine.y, engine.x) if transposed else (engine.x, engine.y)
        if not split_out:
            self.out_axis = unsplit(self.out_axis)
        self.layout = LinearLayout(
            n=self.out_features,
            k=self.in_features,
            out_parts=self.out_axis.size,
            out_coord=self.out_axis.rank,
            in_parts=self.in_axis.size,
            in_coord=self.in_axis.rank,
            z_parts=engine.z.size,
            z_coord=engine.z.rank,
            out_chunks=out_chunks,
        )
        with torch.no_grad():
            self.weight = nn.Parameter(self.layout.shard(weight))
            self.bias = nn.Parameter(self.layout.bias(bias)) if bias is not None else None
        if split_out:
            self.weight.pmm_sharded = True  # distinct on every tensor rank (ds_ext.pmm.norm)
        else:
            self.weight.pmm_replicated_over = (self.out_axis.name,)
        if self.bias is not None:
            self.bias.pmm_replicated_over = (self.in_axis.name, "z")

    def extra_repr(self) -> str:
        kind = ("transposed" if self.transposed else "normal") + ("" if self.split_out else ", out unsplit")
        return (
            f"{self.in_features} -> {self.out_features}, {kind}, block {self.layout.n_local}x"
            f"{self.layout.k_local} / z {self.engine.z.size}, bias={self.bias is not None}"
        )

    def shard_full(self, param_name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the serial tensor ``full`` for parameter ``param_name``."""
        return self.layout.shard(full) if param_name == "weight" else self.layout.bias(full)

    # ---- line 2 ----------------------------------------------------------------------------
    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        handle, block = self.gather_async(shard)
        handle.wait()
        return block

    def gather_async(self, shard: torch.Tensor | None = None) -> tuple[Handle, torch.Tensor]:
        shard = (self.weight if shard is None else shard).detach()
        block = shard.new_empty(self.layout.n_local, self.layout.k_local)
        return self.engine.all_gather(block, shard, self.engine.z, self.name, async_op=True), block

    def gathered_weight(self, shard: torch.Tensor, grad_pass: bool) -> torch.Tensor:
        """W_{j,i}; ``grad_pass``: the forward runs with autograd on (OAG records only those)."""
        if self.engine.prefetcher is not None:
            return self.engine.prefetcher.weight(self, shard, grad_pass)
        return self.gather(shard)

    def deferrable(self, weight: torch.Tensor) -> bool:
        """ORS may defer this call's weight-gradient reduce-scatter to the gate."""
        eng = self.engine
        return eng.deferred is not None and eng.deferred.gated(weight) and not self.shared_weight

    # ---- line 14 ---------------------------------------------------------------------------
    def reduce_gradients(self, grad_block: torch.Tensor, deferred: bool) -> torch.Tensor:
        """dL/dŴ: the block gradient reduce-scattered over Z (ORS: waited by the gate)."""
        eng = self.engine
        grad_w = grad_block.new_empty(self.layout.shard_numel)
        handle = eng.reduce_scatter(grad_w, grad_block.reshape(-1), eng.z, self.name, async_op=deferred)
        if deferred:
            eng.deferred.defer(handle)
        return grad_w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.layout.k_local:
            raise ValueError(
                f"{self.name}: input has {x.shape[-1]} features, this rank's block expects {self.layout.k_local} "
                f"(in-features {self.in_features} split over {self.in_axis.name}={self.in_axis.size})"
            )
        eng = self.engine
        weight = eng.weight_input(self.weight)
        bias = eng.replicated(self.bias) if self.bias is not None else None
        if eng.deferred is not None and torch.is_grad_enabled() and not eng.deferred.gated(weight):
            raise DsExtConfigError(
                "ds_ext.pmm3d.overlap.reduce_scatter needs the model converted by ds_ext.pmm.parallelize "
                f"(its forward opens the gate that waits for the reduce-scatters); {self.name} ran outside it"
            )
        return _Algorithm3.apply(eng.input_with_gate(x.contiguous()), weight, bias, self, torch.is_grad_enabled())
