"""Held-out variants of lm-eval's GSM8K and HumanEval: the first 50 items calibrate the surgery."""

CALIBRATION_ITEMS = 50  # the paper's split (appendix A): calibration and evaluation are disjoint


def drop_calibration(dataset):
    return dataset.select(range(CALIBRATION_ITEMS, len(dataset)))


# lm-eval's HumanEval helpers load the `code_eval` metric from the Hub when imported: defer that
# to evaluation time so the task YAMLs can be indexed offline.
def pass_at_k(references, predictions, k=None):
    from lm_eval.tasks.humaneval.utils import pass_at_k as stock

    return stock(references, predictions, k)


def build_predictions(resps, docs):
    from lm_eval.tasks.humaneval.utils import build_predictions as stock

    return stock(resps, docs)
