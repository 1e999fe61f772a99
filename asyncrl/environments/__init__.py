"""Environments shipped with asyncrl (the agent recipes' tasks)."""
