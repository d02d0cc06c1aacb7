"""``load_rows``: the data layer's entry point for reading (and mixing) datasets."""

from __future__ import annotations

from collections.abc import Sequence

from .errors import DataError
from .mixing import mix_rows, mixing_weights
from .readers import Row
from .sources import load_source


def _parse_max_samples(max_samples) -> int | None:
    if max_samples is None:
        return None
    if isinstance(max_samples, float) and max_samples.is_integer():
        max_samples = int(max_samples)
    if not isinstance(max_samples, int) or isinstance(max_samples, bool) or max_samples < 1:
        raise DataError(f"--data.max_samples: must be a positive integer or unset, got {max_samples!r}.")
    return max_samples


def load_rows(
    datasets: str | Sequence[str],
    probs: str | Sequence[float] | None = None,
    split: str = "train",
    seed: int = 42,
    max_samples: int | None = None,
) -> list[Row]:
    """Rows of ``split`` from every comma-separated source, mixed and capped.

    * ``datasets``: ``"a.jsonl,folder,org/hub_name"`` (or a list); see ``sources.load_source``.
    * ``probs`` None/empty or one source: the sources are concatenated in the given order.
      Otherwise ``mixing.mix_rows`` samples source k with probability probs[k] (seeded by ``seed``),
      stopping when a drawn source is exhausted.
    * ``max_samples`` keeps the first ``max_samples`` rows of the result.
    Every row has ``"__source__"`` (file path / folder / hub name) and ``"__row__"`` (1-based).
    """
    names = (
        [s.strip() for s in datasets.split(",")]
        if isinstance(datasets, str)
        else [s.strip() for s in datasets]
    )
    if not names or any(not s for s in names):
        raise DataError(
            f"--data.dataset / --data.prompt_dataset: '{datasets}' has an empty entry; give comma-separated "
            f"file paths, folders or hub names."
        )
    cap = _parse_max_samples(max_samples)
    weights = mixing_weights(probs, len(names))
    per_source = [load_source(name, split) for name in names]
    if weights is None or len(per_source) == 1:
        rows = [row for rows in per_source for row in rows]
    else:
        rows = mix_rows(per_source, weights, seed, cap)
    return rows if cap is None else rows[:cap]
