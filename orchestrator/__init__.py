"""retrospec: orchestrator."""
