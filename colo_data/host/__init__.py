"""One host's share of the pipeline: chunk work (order, read, transform, batch),
`HostPipeline` (its feed of chunks), packing, and each pipeline kind's host share."""
