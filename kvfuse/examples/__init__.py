"""Runnable examples (``python -m kvfuse.examples.NAME``); not part of the public API."""
