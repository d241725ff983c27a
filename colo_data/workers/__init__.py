"""Workers: the `workers` setting and how many a host pipeline uses, and the pools that compute
its chunk work elsewhere than on its own thread (local worker processes, Ray actors)."""
