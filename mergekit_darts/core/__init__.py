"""Core math: the surgery modules, losses, metrics and the LM head's real output path (torch only)."""
