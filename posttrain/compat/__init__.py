"""Translators of foreign inputs into posttrain's own: the `openrlhf` module stand-in for user files
(`openrlhf_modules.py`), loading a user's Python file (`user_files.py`), TRL config translation (TRL <= 0.21
RLOOConfig `trl_rloo.py`, TRL 1.x GRPOConfig / RLOOConfig `trl_grpo.py`, their shared core `trl_core.py`) and
renamed or removed OpenRLHF flags (`flag_migration.py`). Imports only utils."""
