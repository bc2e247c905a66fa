"""``mergekit_darts.core.correction`` under the name an export ships it as.

``modeling_darts.py`` imports ``.darts_correction`` relatively: inside an exported folder that is
the copy of ``core/correction.py`` the export wrote next to it; inside this package it is this
alias, which makes the name stand for the core module itself (same module object, same classes).
"""

import sys

import mergekit_darts.core.correction as correction

sys.modules[__name__] = correction
