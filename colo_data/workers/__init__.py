"""Pools that compute a host pipeline's chunk work elsewhere than on its own thread: local worker processes."""
