"""DeepSpeed integration: ``initialize`` (``initialize.py``), activation for unmodified
scripts (``activation.py``) and DeepSpeed's private touch points, one module per surface
behind one version gate (``ds_version.py``). Nothing is imported here: the activation
hook runs at interpreter start and must not pull in torch or DeepSpeed."""
