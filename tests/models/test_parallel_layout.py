"""`models.parallel_groups.ParallelLayout`: rank = (dp * CP + cp) * TP + tp, checked by hand on 8 ranks."""
import pytest

from posttrain.models.parallel_groups import ParallelLayout


def test_eight_ranks_as_two_data_two_context_two_tensor():
    layout = ParallelLayout(8, context=2, tensor=2)
    assert layout.data == 2
    assert [layout.coordinates(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(layout.rank(*layout.coordinates(r)) == r for r in range(8))
    assert layout.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]  # consecutive
    assert layout.context_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # TP apart
    assert layout.data_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.describe().startswith("rank 0 (dp 0, cp 0, tp 0), rank 1 (dp 0, cp 0, tp 1)")


def test_context_groups_alone_are_consecutive_and_a_bad_size_is_refused():
    assert ParallelLayout(6, context=3).context_groups() == [[0, 1, 2], [3, 4, 5]]
    assert ParallelLayout(4).data_groups() == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="not a multiple"):
        ParallelLayout(6, context=4)
