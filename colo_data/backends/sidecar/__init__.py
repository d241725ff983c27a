"""The sidecar transport: a process per host serving batches through shared memory."""
