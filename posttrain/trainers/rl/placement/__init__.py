"""Where the RL roles run, as `config/placement_plan.py` plans it (OpenRLHF's placement rules, pure Python,
checked at start-up): the Ray actor groups
(`role_groups.py`), their worker processes (`workers.py`) and the placement that starts them
(`ray_placement.py`), the numpy transport between them (`transport.py`) and weight sync
(`weight_sync.py`). The controller (`trainers/rl/ppo.py`) imports this package; this package imports the RL
core (roles, updates, experience) and never the controller."""
