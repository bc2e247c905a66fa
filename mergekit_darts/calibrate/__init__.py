"""Calibration: prompts -> captured hidden states (with a store) -> trained modules -> ``surgery/``.

Modules, each importing only those above it:

- ``data``: calibration prompts read and tokenized; ``capture``: one model's forward pass to
  cached hidden states (and entropy, head); ``continuation``: the target's greedy completions.
- ``store``: the capture cache, keyed by model identity and token sequences.
- ``runtime``: loading and releasing models, the failure context ``stage``.
- ``collect``: every task's captures, from the store or from models loaded at most once.
- ``train``: the training loop of one module; ``selection``: held-out split, metrics, choice;
  ``verdict``: the default choice, on the target's completions of the held-out prompts.
- ``fit``: one task's train phase (holdout, select); ``fit_router``: the gate of ``route:``;
  ``write``: the ``surgery/`` folder.
- ``pipeline``: the phases in order (``prepare_surgery``, ``capture_tasks``, ``calibrate``).
"""
