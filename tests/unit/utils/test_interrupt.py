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


def test_an_in_process_caller_gets_its_handlers_back_after_an_interrupt():
    """`posttrain.cli.main(argv)` in a sweep or notebook: after a Ctrl-C (before or during training) the
    process keeps its own SIGINT / SIGTERM handling; only the console command ignores later signals."""
    from posttrain.cli.exits import user_errors

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        with user_errors("posttrain sft"):
            raise KeyboardInterrupt  # Ctrl-C before training started
    assert e.value.code == 2 and (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with pytest.raises(SystemExit) as e:
        with user_errors("posttrain sft"), interrupt_as_error(lambda how: how):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
    assert e.value.code == 143
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_second_signal_during_the_clean_up_is_ignored():
    cleaned = []
    with pytest.raises(Terminated):
        with interrupt_as_error(lambda how: how):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            finally:
                os.kill(os.getpid(), signal.SIGINT)  # ignored: the clean-up below still runs
                cleaned.append(True)
    assert cleaned


THIRD_SIGNAL = """
import os, signal, time
from posttrain.cli.exits import command_line, user_errors
from posttrain.utils.interrupt import interrupt_as_error

# a console's SIGINT: the suite may run as a background job (`make test &` in a script), which ignores SIGINT;
# a child inherits that, and posttrain keeps an ignored SIGINT ignored (as test_faults_endings's script)
signal.signal(signal.SIGINT, signal.default_int_handler)

def hang():  # short sleeps: a signal that another thread of the process took is handled within 0.1 s
    for _ in range(300):
        time.sleep(0.1)

with command_line(), user_errors("prog"), interrupt_as_error(lambda how: how):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        hang()
    finally:  # a clean-up that hangs
        os.kill(os.getpid(), signal.SIGTERM)
        print("second ignored", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        hang()
        print("clean-up finished", flush=True)
"""


@pytest.mark.e2e
def test_a_third_signal_ends_the_process_at_once():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", THIRD_SIGNAL], capture_output=True, text=True, timeout=120,
                         check=False)
    assert (out.returncode, out.stdout) == (143, "second ignored\n"), out.stderr
    assert "[posttrain] SIGINT a third time: exiting at once, the clean-up unfinished" in out.stderr
