"""Kiwi cli package."""
