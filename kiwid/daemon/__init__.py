"""Kiwi daemon package."""
