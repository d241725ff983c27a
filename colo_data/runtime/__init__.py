"""What everything else runs on: the lifecycle owner of threads and processes, the prefetcher,
child processes' environment, and what the machine lets this process spend."""
