"""Deploy: export a corrected Hugging Face folder; ``modeling_darts.py`` is the file shipped inside it."""

LINKS = ("symlink", "hardlink", "copy")  # how an export gets the merged weights (here: no torch)
