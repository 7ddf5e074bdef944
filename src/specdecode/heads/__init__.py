"""Trained draft heads (networks that draft from the target's features) and how they are stored."""
