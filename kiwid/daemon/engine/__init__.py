"""The scheduler's actions carried out off the loop: the engine, its executor, their effects."""
