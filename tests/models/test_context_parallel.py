"""Context parallelism (`models/context_parallel.py`): a packed row split over 2 gloo ranks gives the unsplit
row's loss and gradients (samples crossing the slice boundary, padding to a multiple of the group, a row
shorter than a slice per rank, head strides), and the slicing / label helpers."""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from posttrain.models.context_parallel import next_tokens, padded_length, slice_row

HERE = os.path.dirname(os.path.abspath(__file__))


def test_a_row_is_padded_to_the_group_and_cut_into_contiguous_slices():
    row = torch.arange(1, 8)[None]  # 7 tokens over 2 ranks: padded to 8
    assert padded_length(7, 2) == 8 and padded_length(8, 2) == 8 and padded_length(1, 4) == 4
    assert slice_row(row, 0, 2, 0).tolist() == [[1, 2, 3, 4]]
    assert slice_row(row, 1, 2, 0).tolist() == [[5, 6, 7, 0]]
    assert slice_row(row, 2, 3, -1).tolist() == [[7, -1, -1]]


def test_labels_are_made_before_the_cut():
    ids = torch.tensor([[5, 6, 7, 8]])
    labels = next_tokens(ids, -100)
    assert labels.tolist() == [[6, 7, 8, -100]]
    # rank 0's last token keeps its label (8 is rank 1's)
    assert slice_row(labels, 0, 2, -100).tolist() == [[6, 7]]


@pytest.mark.e2e
@pytest.mark.parametrize("lengths,stride", [
    ("5,7,6", 1),  # the slice boundary inside the second sample
    ("5,7,5", 2),  # 17 tokens: one padding token; two key/value heads at a time
    ("9,9", 1),    # the boundary on a sample boundary
    ("1,16", 2),   # a one-token sample
    ("3", 1),      # a row shorter than two slices of its own length
])
def test_two_ranks_give_the_unsplit_rows_loss_and_gradients(tmp_path, lengths, stride):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "CP_LENGTHS": lengths, "CP_STRIDE": str(stride), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", port, os.path.join(HERE, "context_parallel_worker.py"),
                           str(tmp_path / "model")],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"max_rel_loss=(\S+) max_abs_grad=(\S+) max_grad=(\S+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    rel, diff, scale = map(float, found.groups())
    assert rel < 1e-5 and diff < 1e-5 * scale, found.group(0)
    # a loss every rank computes alike from the gathered row: its gradients summed over the ranks are the
    # loss's once (not once per rank)
    found = re.search(r"replicated: max_rel_loss=(\S+) max_abs_grad=(\S+) max_grad=(\S+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    rel, diff, scale = map(float, found.groups())
    assert rel < 1e-5 and diff < 1e-5 * scale, found.group(0)
    moved = re.search(r"moved bytes=(\d+) seconds=(\S+)", proc.stdout)
    assert moved and int(moved.group(1)) > 0 and float(moved.group(2)) > 0, proc.stdout[-2000:]
