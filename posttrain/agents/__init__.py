"""Agents layer: OpenRLHF's agent API (`agent_api.py`) and the loading of an agent file (`agent_file.py`),
the engine an episode sees (`episode.py`), agent episodes as a rollout batch (`multi_turn.py`) and the
OpenAI-compatible server an agent can talk to (`openai_server.py`)."""
