"""The block quantizer's wire-format constants (ZeRO++ qwZ / qgZ, 003 §V-A), shared by its torch
path (:mod:`ds_ext.comm.quant`) and its Triton kernels (:mod:`ds_ext.comm.quant_triton`)."""

ALLOWED_BITS = (4, 8)
NONFINITE = -1.0  # scale of a block that held a non-finite value (not encoded; decodes to NaN)
