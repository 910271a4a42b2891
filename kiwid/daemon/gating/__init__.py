"""Keeping tenants off the GPU and their memory safe: gates, swaps, the state file, recovery."""
