"""Verifiers: decide which drafted tokens the target keeps."""
