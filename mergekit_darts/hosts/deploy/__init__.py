"""Deploy: export a corrected Hugging Face folder (``export``), with the correction shipped beside
it (``correction/modeling_darts.py`` and ``darts_correction.py``) or folded into the merge's own
tensors (``plain``)."""

LINKS = ("symlink", "hardlink", "copy")  # how an export gets the merged weights (here: no torch)
