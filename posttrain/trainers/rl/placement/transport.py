"""What crosses processes in a Ray placement, and how a batch is split over data-parallel ranks.

Experience travels as a dict of numpy arrays: Ray stores numpy zero-copy in its object store
(one `ray.put`, every rank on the node maps it), whereas torch tensors are pickled (`bench/rl_ray.py`
measures both). Rows are assigned to ranks by tokens, so ranks finish together."""
from __future__ import annotations

import numpy as np
import torch

from posttrain.trainers.rl.experience import Experience

_TENSORS = ("sequences", "attention_mask", "action_mask", "rollout_logp", "rewards", "old_logp", "ref_logp",
            "values", "kl", "advantages", "returns")


_IMAGE_ROWS = "image_rows/"  # + key: per row, how many dim-0 entries of "images/" + key are that row's
_IMAGES = "images/"


def experience_to_numpy(exp: Experience) -> dict[str, np.ndarray]:
    """Every tensor; a vision-language batch's per-row image tensors concatenated along dim 0 per key, with
    each row's count beside them (a row without images counts 0)."""
    arrays = {k: getattr(exp, k).numpy() for k in _TENSORS if getattr(exp, k) is not None}
    if exp.image_inputs is not None:
        keys = next(im for im in exp.image_inputs if im is not None).keys()
        for k in keys:
            parts = [np.asarray(im[k]) for im in exp.image_inputs if im is not None]
            arrays[_IMAGES + k] = np.concatenate(parts)
            arrays[_IMAGE_ROWS + k] = np.array([0 if im is None else len(im[k]) for im in exp.image_inputs])
    return arrays


def experience_from_numpy(arrays: dict[str, np.ndarray]) -> Experience:
    """Tensors that own their memory (the object store's arrays are read-only); image tensors back per row."""
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()
               if not k.startswith(("images/", "image_rows/"))}
    keys = [k[len(_IMAGES):] for k in arrays if k.startswith(_IMAGES)]
    images = None
    if keys:
        counts = {k: arrays[_IMAGE_ROWS + k] for k in keys}
        starts = {k: np.concatenate([[0], np.cumsum(counts[k])]) for k in keys}
        images = [None if counts[keys[0]][i] == 0 else
                  {k: np.array(arrays[_IMAGES + k][starts[k][i]:starts[k][i + 1]]) for k in keys}
                  for i in range(len(counts[keys[0]]))]
    return Experience(**tensors, image_inputs=images)


def split_by_tokens(rows, lengths, ranks: int) -> list[list[int]]:
    """`rows` over `ranks` shares with about equal token sums (longest first onto the lightest
    share, ties to the lower rank); each share keeps the rows' original order. A share may be empty
    when there are fewer rows than ranks."""
    rows = [int(r) for r in rows]
    shares: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for r in sorted(rows, key=lambda r: -int(lengths[r])):
        i = min(range(ranks), key=lambda k: (load[k], k))
        shares[i].append(r)
        load[i] += int(lengths[r])
    order = {r: i for i, r in enumerate(rows)}
    return [sorted(s, key=order.__getitem__) for s in shares]


def plan_steps(step_rows, lengths, ranks: int) -> list[list[list[int]]]:
    """Per rank, its share of every optimizer step: `plan[rank][k]` are rank's rows of step k."""
    plan: list[list[list[int]]] = [[] for _ in range(ranks)]
    for rows in step_rows:
        for rank, share in enumerate(split_by_tokens(rows, lengths, ranks)):
            plan[rank].append(share)
    return plan


def least_loaded(loads: list[int], costs: list[int]) -> list[int]:
    """The engine of each request, in order: each goes to the engine with the fewest rows in flight
    (ties: the lower index), which then carries its cost (OpenRLHF's heap dispatch). `loads` is updated."""
    import heapq

    heap = [(load, i) for i, load in enumerate(loads)]
    heapq.heapify(heap)
    out = []
    for cost in costs:
        load, i = heapq.heappop(heap)
        out.append(i)
        loads[i] = load + cost
        heapq.heappush(heap, (loads[i], i))
    return out
