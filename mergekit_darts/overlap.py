"""Token n-gram overlap with calibration prompts, the way lm-eval's decontamination counts it.

One owner for the rule that ``hf-darts`` uses to report evaluation requests containing
calibration prompts (:mod:`lm_eval_darts.leakage`) and that ``select: {metric: lm_eval}`` uses to
refuse dev documents containing them (:mod:`mergekit_darts.hosts.lm_eval_dev`): a text
overlaps when it contains 13 consecutive tokens of a calibration sequence, or the whole of a
shorter one that was not cut.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

NGRAM = 13  # lm-eval's decontamination n-gram length


class CalibrationGrams:
    """The n-grams of one module's calibration sequences (whole sequences when shorter than n).

    ``cut[i]`` marks sequence ``i`` as possibly cut short: it then counts only through full
    n-grams, never as a whole. Templated prompts share a frame (a chat template plus a fixed
    instruction, longer than 13 tokens) that every request of the task carries, so a window
    that is mostly frame says nothing about which prompt it came from (SmolLM2's real family:
    half of the disjoint evaluation prompts shared a window of frame + one word with some
    calibration prompt). So the prefix and suffix every sequence shares are cut off, and a
    sequence matches through n-grams of what is left, or, when that is shorter than n, only
    as a whole. An n-gram found in more than half of the sequences (two at least) is a frame
    inside the prompts and is dropped too.
    """

    def __init__(
        self, sequences: Iterable[Sequence[int]], n: int = NGRAM, cut: Iterable[bool] = ()
    ) -> None:
        # size -> gram -> the first sequence holding it (for messages that name it)
        self._grams: dict[int, dict[tuple[int, ...], int]] = defaultdict(dict)
        sequences, cut = [list(seq) for seq in sequences], list(cut)
        start, end = shared_ends(sequences)
        found_in: Counter[tuple[int, ...]] = Counter()  # sequences holding each gram
        first: dict[tuple[int, ...], int] = {}
        for index, seq in enumerate(sequences):
            own = seq[start : len(seq) - end]
            if len(own) >= n:
                grams = {tuple(own[i : i + n]) for i in range(len(own) - n + 1)}
            elif seq and not (index < len(cut) and cut[index]):
                grams = {tuple(seq)}
            else:
                continue
            found_in.update(grams)
            for gram in grams:
                first.setdefault(gram, index)
        shared = max(2, len(sequences) // 2 + 1)
        for gram, count in found_in.items():
            if count < shared:
                self._grams[len(gram)][gram] = first[gram]

    def update(self, other: CalibrationGrams) -> None:
        """Add another module's n-grams (each module's frame is judged on its own prompts)."""
        for size, grams in other._grams.items():
            self._grams[size] = {**grams, **self._grams[size]}

    def found(self, ids: Sequence[int]) -> int | None:
        """The index of a calibration sequence whose n-gram ``ids`` contains, or None (after
        :meth:`update`, an index in whichever module's sequences)."""
        for size, grams in self._grams.items():
            for i in range(len(ids) - size + 1):
                index = grams.get(tuple(ids[i : i + size]))
                if index is not None:
                    return index
        return None

    def found_in(self, ids: Sequence[int]) -> bool:
        """Whether ``ids`` contains one of the n-grams."""
        return self.found(ids) is not None


def shared_ends(sequences: Sequence[Sequence[int]]) -> tuple[int, int]:
    """Lengths of the prefix and the suffix that every sequence has (none for fewer than two)."""
    if len(sequences) < 2:
        return 0, 0
    first, shortest = sequences[0], min(len(seq) for seq in sequences)
    start = 0
    while start < shortest and all(seq[start] == first[start] for seq in sequences):
        start += 1
    end = 0
    while end < shortest - start and all(seq[-1 - end] == first[-1 - end] for seq in sequences):
        end += 1
    return start, end
