"""retrospec: drafter."""
