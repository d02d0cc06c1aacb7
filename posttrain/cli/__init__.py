"""Entry points: argument parsing, validation, launching. No training logic here."""
