"""SIGTERM inside a training block ends like Ctrl-C, in one line; the previous handler comes back."""
import os
import signal
import time

import pytest

from posttrain.utils.interrupt import Interrupted, Terminated, interrupt_as_error


def test_sigterm_becomes_terminated_with_exit_143_and_clean_up_runs():
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    with pytest.raises(Terminated) as e:
        with interrupt_as_error(lambda how: f"{how} at step 3; last checkpoint: none"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this ends
            finally:
                cleaned.append(True)  # what RLTrainer.fit does here: Ray placement shut down, locks released
    assert str(e.value) == "terminated at step 3; last checkpoint: none" and e.value.exit_code == 143
    assert cleaned and signal.getsignal(signal.SIGTERM) == previous


def test_ctrl_c_stays_interrupted_with_exit_2():
    with pytest.raises(Interrupted) as e:
        with interrupt_as_error(lambda how: f"{how} at step 1"):
            raise KeyboardInterrupt
    assert str(e.value) == "interrupted at step 1" and not isinstance(e.value, Terminated)
    assert getattr(e.value, "exit_code", 2) == 2
