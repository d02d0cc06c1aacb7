"""Training loops: orchestration of data, models, engines and the algorithm math."""
