"""The correction (torch only): the two files every export ships, ``darts_correction.py``
(module math, router, position rule, float32 step) and ``modeling_darts.py`` (the export format
and the transformers classes), side by side under the names they ship as, so the second imports
the first relatively here and in an exported folder alike; beside them the kinds' sizes
(``spec``), seeded training modules (``modules``), the losses, the metrics and the LM head's real
output path (``head``). Nothing here imports the rest of the package but ``errors``."""
