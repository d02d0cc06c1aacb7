"""Translators of foreign inputs into posttrain's own: the `openrlhf` module stand-in for user files
(`openrlhf_modules.py`), loading a user's Python file (`user_files.py`), TRL RLOOConfig translation
(`trl_rloo.py`) and renamed or removed OpenRLHF flags (`flag_migration.py`). Imports only utils."""
