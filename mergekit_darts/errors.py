"""One error root for everything mergekit-darts refuses or fails at.

Every message is one line that names what is wrong and how to fix it. Nothing here depends on
click: the command-line layer (``mergekit_darts.cli``, the mergekit hook) turns a ``DartsError``
into click's one-line ``Error: ...``; library callers catch the class they care about.
"""

from __future__ import annotations


class DartsError(Exception):
    """The root: a one-line message, meant to be shown without a traceback."""


class SurgeryConfigError(DartsError, ValueError):
    """The surgery block, a path it names, or a model it names cannot be used as written."""


class SurgeryRunError(DartsError, RuntimeError):
    """Surgery failed after validation; the message names the task and the stage."""


class SurgeryFormatError(DartsError, ValueError):
    """A surgery folder or file that cannot be used as it is."""


class HeadError(DartsError, ValueError):
    """The logits of this model cannot be reproduced from its final hidden state."""


class ExportError(DartsError, ValueError):
    """An export that cannot be made as asked; nothing has been written."""


class ResultsError(DartsError, ValueError):
    """Sweep results (``results.json``, a selector, a comparison) that cannot be used as asked."""


SurgeryError = DartsError  # the name the first releases used for the root
