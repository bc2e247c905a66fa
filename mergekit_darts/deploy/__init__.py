"""Deploy: export a corrected Hugging Face folder; ``modeling_darts.py`` is the file shipped inside it."""
