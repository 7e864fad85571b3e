"""PCCL for DeepSpeed's own collectives: ``"ds_ext": {"pccl": {"enabled": true}}`` (001 ch. 6).

The algorithms live in ``ds_ext.comm.algorithms`` (ds_ext's own collectives choose them with
``ds_ext.comm.algorithm``); this plugin routes unmodified DeepSpeed's ZeRO-3 all-gathers and
reduce-scatters through them.
"""
