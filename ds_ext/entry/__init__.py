"""The ways into ds_ext above the runtime: ``ds_ext.initialize`` (``initialize.py``), activation
for unmodified scripts (``activation.py``) and DeepSpeed's MoE layer replaced by TED's before the
model is built (``moe_substitution.py``). Nothing is imported here: the activation hook runs at
interpreter start and must not pull in torch or DeepSpeed."""
