"""Entry points: argument parsing, validation, launching. No training logic here."""
import os as _os
import shutil as _shutil

# DeepSpeed (imported by transformers/peft when installed) prints an accelerator-detection warning
# to stdout unless told which accelerator to use; on a machine without NVIDIA GPUs that is the CPU.
if "DS_ACCELERATOR" not in _os.environ and _shutil.which("nvidia-smi") is None:
    _os.environ["DS_ACCELERATOR"] = "cpu"
