"""One host's share of the pipeline: chunk work (order, read, transform, batch), the
streaming `HostPipeline`, packing, and each pipeline kind's host share."""
