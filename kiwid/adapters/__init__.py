"""Kiwi adapters package."""
