"""What everything else runs on: the lifecycle owner of threads and processes, the prefetcher."""
