"""Calibration: prompts -> captured hidden states (with a store) -> trained modules."""
