"""Kiwi config package."""
