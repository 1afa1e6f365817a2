"""Ray actors wrapping engines and reward scorers, and the groups the controller drives."""
