"""DeepSpeed's private touch points, one module per surface, behind one version gate
(``ds_version.py``): the only place DeepSpeed-private names appear. Nothing is imported here."""
