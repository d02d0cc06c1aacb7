"""peak_memory: the tensor memory a call held at its peak and at its end, above its start."""
import pytest
import torch

from posttrain.utils.memory import peak_memory, process_peak_rss

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_peak_and_end_of_known_allocations(device):
    before = torch.ones(1_000_000, device=device)  # held before the call: not counted
    total, peak = peak_memory(lambda: (torch.ones(1_000_000, device=device) + 1).sum(), device)
    assert float(total) == 2_000_000
    assert 8_000_000 <= peak.peak_bytes < 8_000_000 + 4096  # both 4 MB vectors at once, plus the sum
    assert 0 <= peak.end_bytes < 4096  # only the result is still held
    kept, peak = peak_memory(lambda: torch.ones(250_000, device=device), device)
    assert peak.peak_bytes == peak.end_bytes >= 1_000_000 and kept.numel() == 250_000
    assert peak.rss_peak_bytes == process_peak_rss() > 0
    assert before.sum() == 1_000_000


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        peak_memory(lambda: None, "meta")
