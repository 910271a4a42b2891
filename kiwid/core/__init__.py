"""Kiwi core package."""
