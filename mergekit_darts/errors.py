"""One error root for everything mergekit-darts refuses or fails at, and the one way to show it.

Every message is one line that names what is wrong and how to fix it. A failure a user can cause
(a block, a model argument, a file, an environment variable) is a ``DartsError`` subclass; the
ones that callers have long caught as ``ValueError`` or ``RuntimeError`` keep that second base.
Every command prints one the same way, :func:`error_line`: the click commands (``mergekit-darts``,
the hooked ``mergekit-yaml`` and ``mergekit-multi``) through
:mod:`mergekit_darts.hosts.click_errors`, ``lm_eval`` and ``lm-eval-darts`` through
:mod:`lm_eval_darts.cli`. Nothing here depends on click; library callers catch the class they
care about.
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


class ReportError(DartsError, ValueError):
    """A report that cannot be written where asked, or a stored file it cannot read."""


class EnvFlagError(DartsError, ValueError):
    """A boolean environment variable holds something that is not a boolean."""


class ModelArgsError(DartsError, ValueError):
    """``hf-darts`` model arguments (``surgery=``, ``surgery_map=``, ``surgery_path=``) or
    ``apply_surgery`` arguments that cannot be used together or as written."""


class UnsupportedModelError(DartsError, ValueError):
    """A model that surgery cannot be attached to as it is."""


class DoubleClaim(DartsError, ValueError):
    """Two surgery tasks claim one lm-eval task; each caller words it for its own source."""

    def __init__(self, eval_task: str, first: str, second: str) -> None:
        super().__init__(
            f"lm-eval task {eval_task!r} is claimed by surgery tasks {first!r} and {second!r}"
        )
        self.eval_task, self.first, self.second = eval_task, first, second


class NonFiniteCapture(DartsError, ValueError):
    """The model itself computed a value that is not finite: nothing to calibrate on."""


def error_line(err: BaseException) -> str:
    """``Error: <message>`` on one line: what every command prints for a ``DartsError``."""
    return "Error: " + " ".join(line.strip() for line in str(err).splitlines() if line.strip())


SurgeryError = DartsError  # the name the first releases used for the root
