"""Falcon resources, one module per route."""
