"""Held-out variants of lm-eval's GSM8K and HumanEval: the first 50 items calibrate the surgery."""

from lm_eval.tasks.humaneval.utils import build_predictions, pass_at_k  # noqa: F401

CALIBRATION_ITEMS = 50  # the paper's split (appendix A): calibration and evaluation are disjoint


def drop_calibration(dataset):
    return dataset.select(range(CALIBRATION_ITEMS, len(dataset)))
