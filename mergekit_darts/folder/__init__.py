"""The ``surgery/`` format: file names and the typed manifest (``manifest``), the validated save
and load (``artifacts``), the per-task diagnostics file, a model folder's identity, atomic writes
(``fs``)."""
