"""Floor layer: logging sinks, checkpoints, seeding, timers, plotting."""
